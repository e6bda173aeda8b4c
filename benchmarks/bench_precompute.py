"""Tokenization + span location: the precompute stage's batched path vs one example at a time.

    python benchmarks/bench_precompute.py [--programs 1500] [--batch 256]

Traces synthetic programs in the sandbox, trains the tiny default tokenizer on them, then measures in one
run, on the same examples: (a) the stage's path, `codi.data.spans.encode_examples` (one call of the Rust tokenizer
per batch, spans from its character-to-token map, every span verified by one batched decode); (b) the naive
path, `tokenizer(text)` per example and spans by searching the token ids (`codi.data.spans.encode_naive`,
which verifies nothing). Prints examples/s of each and the ratio, and checks both found the same spans.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from codi.data.spans import encode_examples, encode_naive
from codi.infra.config import load_params
from codi.modeling.base_model import train_tiny_tokenizer
from codi.sources.synthetic import generate
from codi.tracing.format import locals_offsets, render_prompt, render_trace
from codi.tracing.sandbox import TracerPool
from codi.tracing.tokens import token_ids

SHIPPED = load_params(Path(__file__).resolve().parents[1] / "params.yaml")  # config dataclasses have no defaults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="timed passes of each path (best is reported)")
    args = ap.parse_args()

    samples = generate(dataclasses.replace(SHIPPED.extract.synthetic, n_programs=args.programs, calls_per_program=2, difficulty=2, seed=0))
    with TracerPool(SHIPPED.extract.trace, SHIPPED.extract.sandbox, workers=0) as pool:
        results = [r for r in pool.trace(samples) if r.status == "ok"]
    by_id = {s.sample_id: s for s in samples}
    prompts = [render_prompt(by_id[r.sample_id].program, by_id[r.sample_id].call) for r in results]
    traces = [render_trace(list(r.frames)) for r in results]
    spans = [locals_offsets(list(r.frames)) for r in results]
    tok = train_tiny_tokenizer((p + t for p, t in zip(prompts, traces)), dataclasses.replace(SHIPPED.model.tiny, vocab_size=1024))
    ids = token_ids(tok)
    n = len(traces)

    def batched():
        out = []
        for s in range(0, n, args.batch):
            out += encode_examples(tok, prompts[s:s + args.batch], traces[s:s + args.batch], spans[s:s + args.batch], ids=ids)
        return out

    def naive():
        return [encode_naive(tok, p, t, ids) for p, t in zip(prompts, traces)]

    timings = {}
    outputs = {}
    for name, fn in (("batched+char map (stage)", batched), ("one-at-a-time+id search", naive)):
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            outputs[name] = fn()
            best = min(best, time.perf_counter() - t0)
        timings[name] = best
    a, b = outputs.values()
    assert [e.spans for e in a] == [e.spans for e in b] and [e.trace_ids for e in a] == [e.trace_ids for e in b]
    tokens = sum(len(e.prompt_ids) + len(e.trace_ids) for e in a)
    print(f"{n} examples, {tokens / n:.0f} tokens/example, {sum(len(e.spans) for e in a)} spans (identical in both paths)")
    print(f"{'path':28s} {'examples/s':>12s} {'seconds':>9s}")
    for name, sec in timings.items():
        print(f"{name:28s} {n / sec:12.0f} {sec:9.3f}")
    slow, fast = timings["one-at-a-time+id search"], timings["batched+char map (stage)"]
    print(f"ratio (batched / naive): {slow / fast:.2f}x  (the batched path also verifies every span by decoding it)")


if __name__ == "__main__":
    main()
