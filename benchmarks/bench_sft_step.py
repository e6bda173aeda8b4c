"""Benchmark: where an sft step's time goes (Performance III, item 4), against the stage's own rate.

    python benchmarks/bench_sft_step.py                    # data/cache + models/sft of `dvc repro`, 1 thread
    python benchmarks/bench_sft_step.py --steps 60 --json /tmp/sft_step.json

What a step is: the sft stage's per-process step without the Trainer: params.yaml `sft.batch_size` examples,
length-grouped as the Trainer groups them, collated by the stage's own collator (right padding, no mask), the
model's forward with the labels, backward, clip_grad_norm(sft.max_grad_norm), AdamW(sft.lr, sft.weight_decay) and
zero_grad, on models/sft. Printed:
- the median milliseconds of each part (collation, forward, backward, optimizer) over the timed steps, and the
  share of padding in the batches;
- the step's tokens/s on one thread against the committed stage's (metrics/sft.json, `cpu_processes` processes):
  what the Trainer, evaluation, checkpoints and the second process add or take;
- a torch.profiler breakdown of --profile-steps steps by kind of operation: matrix products (mm, addmm, bmm),
  attention (sdpa's CPU flash kernel, forward and backward), and the rest (norms, rotary, SiLU, the loss, the
  optimizer, autograd bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_codi_step import grouped_batches, inputs_present  # noqa: E402
from codi.data.batching import CausalLMCollator  # noqa: E402
from codi.data.cache import CacheDataset  # noqa: E402
from codi.infra.config import load_params  # noqa: E402
from codi.infra.hf import load_causal_lm  # noqa: E402
from codi.tracing.tokens import load_tokenizer, token_ids  # noqa: E402

KINDS = {"matrix products": ("aten::mm", "aten::addmm", "aten::bmm"),
         "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                       "aten::_scaled_dot_product_flash_attention_for_cpu_backward")}


def kind_of(op: str) -> str:
    return next((kind for kind, ops in KINDS.items() if op in ops), "the rest")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/bench_sft_step.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--cache", type=Path, default=ROOT / "data/cache", help="the precompute stage's cache")
    ap.add_argument("--model", type=Path, default=ROOT / "models/sft", help="the sft stage's model")
    ap.add_argument("--metrics", type=Path, default=ROOT / "metrics/sft.json", help="the stage's committed metrics")
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--profile-steps", type=int, default=10, help="steps under torch.profiler after the timed ones")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the stage: sft.torch_threads per process)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if not inputs_present(args.cache, args.model):
        return 2
    torch.set_num_threads(args.threads)
    cfg = load_params(args.params).sft
    tok = load_tokenizer(args.model)
    ds = CacheDataset(args.cache / "train.arrow")
    collate = CausalLMCollator(tok.pad_token_id, "trace", ids=token_ids(tok), computed_weight=cfg.computed_weight)
    batches = grouped_batches(ds.lengths, cfg.batch_size, args.warmup + args.steps + args.profile_steps, args.seed)
    model = load_causal_lm(args.model, torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def step(idx: list[int]) -> tuple[float, float, float, float, int, int]:
        t0 = time.perf_counter()
        batch = collate([ds[i] for i in idx])
        t1 = time.perf_counter()
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        ids = batch["input_ids"]
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, ids.numel(), int((ids != tok.pad_token_id).sum())

    for idx in batches[:args.warmup]:
        step(idx)
    timed = [step(idx) for idx in batches[args.warmup:args.warmup + args.steps]]
    parts = {name: statistics.median(t[k] for t in timed) * 1e3
             for k, name in enumerate(("collate", "forward", "backward", "optimizer"))}
    step_ms = statistics.median(sum(t[:4]) for t in timed) * 1e3
    real = sum(t[5] for t in timed) / len(timed)
    pad_share = 1 - sum(t[5] for t in timed) / sum(t[4] for t in timed)
    rate = real / (step_ms / 1e3)
    print(f"sft step: batch {cfg.batch_size}, {len(timed)} timed steps (median), {args.threads} thread(s), "
          f"{real:.0f} tokens a step, padding {100 * pad_share:.1f}%")
    print("  " + ", ".join(f"{k} {v:.1f} ms" for k, v in parts.items()) + f"; the step {step_ms:.1f} ms")
    stage = json.loads(args.metrics.read_text()) if args.metrics.is_file() else {}
    stage_rate = stage.get("tokens_per_s")
    if stage_rate:
        processes = load_params(args.params).sft.cpu_processes
        print(f"  {rate:,.0f} tokens/s on {args.threads} thread(s); the committed stage {stage_rate:,.0f} tokens/s on "
              f"{processes} processes ({stage_rate / processes:,.0f} a process, {stage_rate / processes / rate:.2f} of "
              "this step's rate)")

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for idx in batches[args.warmup + args.steps:]:
            step(idx)
    by_kind: dict[str, float] = {}
    for event in prof.key_averages():
        by_kind[kind_of(event.key)] = by_kind.get(kind_of(event.key), 0.0) + event.self_cpu_time_total
    total = sum(by_kind.values())
    print(f"profile of {args.profile_steps} steps, self CPU time by kind of operation:")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<16} {us / 1e3 / args.profile_steps:8.1f} ms a step  {100 * us / total:5.1f}%")
    if args.json:
        args.json.write_text(json.dumps({"parts_ms": parts, "step_ms": step_ms, "tokens_per_step": real,
                                         "pad_share": pad_share, "tokens_per_s": rate, "stage_tokens_per_s": stage_rate,
                                         "self_cpu_share": {k: v / total for k, v in by_kind.items()},
                                         "threads": args.threads, "steps": len(timed)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
