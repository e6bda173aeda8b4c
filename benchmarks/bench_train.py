"""Training throughput (useful tokens/s) of the tiny default model on CPU: the sft stage's recipe against HF's
default batching, and against the same recipe under torch.compile.

    python benchmarks/bench_train.py [--steps 30] [--programs 800] [--batch 8] [--no-compile]

Builds a small cache the way the pipeline does (synthetic programs traced in the sandbox, the tiny tokenizer,
`codi.data.spans`), then times optimizer steps (forward + backward + AdamW) of the model sized by params.yaml
`model.tiny`, in one run: random batches with an attention mask (HF's defaults), length-grouped batches without
a mask (the sft stage), and the latter compiled (torch.compile, dynamic shapes; its compile time apart).
Useful tokens are non-padding tokens; the padding share of each batching is printed too. Where the time of a
step goes (matmuls, attention, elementwise ops, optimizer) is printed for the stage's recipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from codi.data.batching import CausalLMCollator
from codi.data.spans import encode_examples
from codi.infra.config import load_params
from codi.modeling.base_model import tiny_model, train_tiny_tokenizer
from codi.sources.synthetic import generate
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


def measure(tok, cfg, examples, bs, steps, grouped, mask, threads, compiled=False) -> dict[str, float]:
    """Useful tokens/s, padding share and (compiled) the warm-up seconds of `steps` timed optimizer steps."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = tiny_model(cfg, tok).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd = torch.compile(model, dynamic=True) if compiled else model
    col = CausalLMCollator(tok.pad_token_id, "trace", attention_mask=mask)
    todo = batches(examples, bs, grouped, steps + 3)
    t0 = time.perf_counter()
    for b in todo[:3]:  # warm-up (and compilation)
        fwd(**col(b)).loss.backward(); opt.step(); opt.zero_grad()
    warm = time.perf_counter() - t0
    tokens = slots = 0
    t0 = time.perf_counter()
    for b in todo[3:]:
        batch = col(b)
        tokens += sum(len(e["prompt_ids"]) + len(e["trace_ids"]) for e in b)
        slots += batch["input_ids"].numel()
        fwd(**batch).loss.backward(); opt.step(); opt.zero_grad()
    return {"tokens_s": tokens / (time.perf_counter() - t0), "pad": 1 - tokens / slots, "warmup_s": warm}


def time_profile(tok, cfg, examples, bs, steps) -> dict[str, float]:
    """Shares of a stage-recipe step's CPU time by operator kind (torch.profiler, one thread)."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    model = tiny_model(cfg, tok).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    col = CausalLMCollator(tok.pad_token_id, "trace")
    todo = batches(examples, bs, True, steps + 3)
    for b in todo[:3]:
        model(**col(b)).loss.backward(); opt.step(); opt.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in todo[3:]:
            model(**col(b)).loss.backward(); opt.step(); opt.zero_grad()
    kinds = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm"), "attention": ("scaled_dot_product",),
             "optimizer": ("Optimizer.step", "_foreach", "aten::lerp", "aten::addcdiv", "aten::addcmul",
                           "aten::sqrt")}
    shares = {k: 0.0 for k in (*kinds, "elementwise and other")}
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    for e in events:
        kind = next((k for k, names in kinds.items() if any(n in e.key for n in names)), "elementwise and other")
        shares[kind] += e.self_cpu_time_total / total
    return shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--programs", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8, help="per-process batch (the sft stage's default)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row (its compilation takes minutes)")
    args = ap.parse_args()
    tok, cfg, examples = build_examples(args.programs, 0)
    print(f"tiny model: hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {len(tok)}; batch {args.batch}, "
          f"{args.steps} timed steps; {len(examples)} examples, "
          f"{sum(len(e['prompt_ids']) + len(e['trace_ids']) for e in examples) / len(examples):.0f} tokens/example")
    rows = [("random batches + attention mask (HF default)", False, True, False),
            ("length-grouped, no mask (sft stage)", True, False, False)]
    if not args.no_compile:
        rows.append(("sft stage recipe + torch.compile", True, False, True))
    print(f"{'recipe':46s} {'useful tokens/s':>16s} {'padding':>8s} {'vs HF default':>14s}   (1 thread)")
    base = None
    for name, grouped, mask, compiled in rows:
        r = measure(tok, cfg, examples, args.batch, args.steps, grouped, mask, 1, compiled)
        base = base or r["tokens_s"]
        extra = f"   compile + warm-up {r['warmup_s']:.0f}s" if compiled else ""
        print(f"{name:46s} {r['tokens_s']:14.0f}/s {r['pad']:8.1%} {r['tokens_s'] / base:13.2f}x{extra}")
    two = measure(tok, cfg, examples, args.batch, args.steps, True, False, 2)
    print(f"sft stage recipe at 2 threads in one process: {two['tokens_s']:.0f}/s (the stage runs one "
          "single-threaded process per core instead)")
    shares = time_profile(tok, cfg, examples, args.batch, min(args.steps, 20))
    print("where a step's time goes (sft stage recipe): " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))


if __name__ == "__main__":
    main()
