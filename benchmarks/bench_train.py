"""Training throughput (tokens/s) of the tiny default model on CPU: our batching vs HF's default.

    python benchmarks/bench_train.py [--steps 30] [--programs 800]

Builds a small cache the way the pipeline does (synthetic programs traced in the sandbox, the tiny
tokenizer, `codi.spans`), then times optimizer steps (forward + backward + AdamW) of the model sized by
params.yaml `model.tiny`, in one run, for: random batches with an attention mask (HF's defaults) vs
length-grouped batches without a mask (what the sft stage does), at 1 and 2 torch threads.
Tokens counted are non-padding tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from codi.base_model import tiny_model, train_tiny_tokenizer
from codi.batching import CausalLMCollator
from codi.config import load_params
from codi.sources.synthetic import generate
from codi.spans import encode_examples
from codi.tracing.format import locals_offsets, render_prompt, render_trace
from codi.tracing.sandbox import TracerPool

SHIPPED = load_params(Path(__file__).resolve().parents[1] / "params.yaml")  # config dataclasses have no defaults


def build_examples(n_programs: int, vocab: int):
    samples = generate(dataclasses.replace(SHIPPED.extract.synthetic, n_programs=n_programs, calls_per_program=2, difficulty=1, seed=0))
    with TracerPool(SHIPPED.extract.trace, SHIPPED.extract.sandbox, workers=0) as pool:
        results = [r for r in pool.trace(samples) if r.status == "ok"]
    by_id = {s.sample_id: s for s in samples}
    prompts = [render_prompt(by_id[r.sample_id].program, by_id[r.sample_id].call) for r in results]
    traces = [render_trace(list(r.frames)) for r in results]
    params = load_params("params.yaml")
    tok = train_tiny_tokenizer((p + t for p, t in zip(prompts, traces)), params.model.tiny)
    enc = encode_examples(tok, prompts, traces, [locals_offsets(list(r.frames)) for r in results])
    return tok, params.model.tiny, [{"prompt_ids": e.prompt_ids, "trace_ids": e.trace_ids} for e in enc]


def batches(examples, bs: int, grouped: bool, steps: int, seed: int = 0):
    """`steps` batches of `bs` examples: random, or length-grouped by the sampler the sft stage uses
    (HF's LengthGroupedSampler, via codi.training)."""
    g = torch.Generator().manual_seed(seed)
    if grouped:
        from transformers.trainer_pt_utils import LengthGroupedSampler
        lengths = [len(e["prompt_ids"]) + len(e["trace_ids"]) for e in examples]
        order = list(LengthGroupedSampler(bs, lengths=lengths, generator=g))
    else:
        order = torch.randperm(len(examples), generator=g).tolist()
    chunks = [order[s:s + bs] for s in range(0, len(order), bs)]
    return [[examples[i] for i in c] for c in chunks[:steps]]


def measure(tok, cfg, examples, bs, steps, grouped, mask, threads) -> float:
    torch.set_num_threads(threads)
    model = tiny_model(cfg, tok).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    col = CausalLMCollator(tok.pad_token_id, "trace", attention_mask=mask)
    todo = batches(examples, bs, grouped, steps + 3)
    for b in todo[:3]:  # warm-up
        model(**col(b)).loss.backward(); opt.step(); opt.zero_grad()
    tokens, t0 = 0, time.perf_counter()
    for b in todo[3:]:
        batch = col(b)
        tokens += sum(len(e["prompt_ids"]) + len(e["trace_ids"]) for e in b)
        model(**batch).loss.backward(); opt.step(); opt.zero_grad()
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--programs", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    tok, cfg, examples = build_examples(args.programs, 0)
    print(f"tiny model: hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {len(tok)}; batch {args.batch}, "
          f"{args.steps} timed steps; {len(examples)} examples, "
          f"{sum(len(e['prompt_ids']) + len(e['trace_ids']) for e in examples) / len(examples):.0f} tokens/example")
    rows = [("random batches + attention mask (HF default)", False, True),
            ("length-grouped, no mask (sft stage)", True, False)]
    print(f"{'batching':46s} {'1 thread':>12s} {'2 threads':>12s}")
    base = None
    for name, grouped, mask in rows:
        r1 = measure(tok, cfg, examples, args.batch, args.steps, grouped, mask, 1)
        r2 = measure(tok, cfg, examples, args.batch, args.steps, grouped, mask, 2)
        base = base or r1
        print(f"{name:46s} {r1:10.0f}/s {r2:10.0f}/s   ({r1 / base:.2f}x at 1 thread)")


if __name__ == "__main__":
    main()
