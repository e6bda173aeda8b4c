"""Benchmark: one codi optimizer step on the default configuration, before Performance III and after each of its changes.

    python benchmarks/bench_codi_step.py                 # data/cache + models/sft of `dvc repro`, 1 thread, 24 steps each
    python benchmarks/bench_codi_step.py --steps 60 --json /tmp/codi_step.json

What a step is: the codi stage's per-process step (params.yaml `codi.batch_size` examples, length-grouped as the
Trainer groups them, value slots as the stage computes them), CodiModel.from_config(params.codi) on models/sft,
forward + backward + clip_grad_norm(codi.max_grad_norm) + AdamW(codi.lr, codi.weight_decay) + zero_grad. Four
configurations of the same model, in one process on the same batches, interleaved batch by batch (so that load on
the machine falls on all of them alike):

- `checkpointed`: the teacher checkpointed for backward (`codi.gradient_checkpointing: true`, the setting before
  Performance III); the student computes its first round itself;
- `recompute`: the teacher not checkpointed, the student still computing the shared prefix itself;
- `reuse`: the teacher not checkpointed and the student starting from the teacher's keys and values of the shared
  prefix (CodiModel._reuses_prefix), every decoder call through the body's own (Hugging Face) forward;
- `lean`: as `reuse`, with the decoder calls through codi.modeling.fast_decoder.LeanDecoder (the body's numbers bit
  for bit, with fewer operations and autograd nodes a call): the default.

Each configuration has its own copy of the model and optimizer, so all four follow the same trajectory up to float
noise. The first batch's losses of the four are printed side by side with their largest relative difference (the
oracle test, tests/unit/test_modeling_equivalence.py, holds the exact check). Reported: examples/s as the median
over the timed steps (after --warmup), and the speed-up of each against `checkpointed`.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codi.data.cache import CacheDataset  # noqa: E402
from codi.data.values import WithValues  # noqa: E402
from codi.infra.config import load_params  # noqa: E402
from codi.infra.hf import load_causal_lm  # noqa: E402
from codi.modeling.model import CodiModel  # noqa: E402
from codi.tracing.tokens import load_tokenizer, token_ids  # noqa: E402
from codi.training.codi_trainer import collate_examples  # noqa: E402

CONFIGS = {"checkpointed": dict(teacher_checkpointing=True, reuse_prefix=False, lean_decoder=False),
           "recompute": dict(teacher_checkpointing=False, reuse_prefix=False, lean_decoder=False),
           "reuse": dict(teacher_checkpointing=False, reuse_prefix=True, lean_decoder=False),
           "lean": dict(teacher_checkpointing=False, reuse_prefix=True, lean_decoder=True)}


def grouped_batches(lengths: list[int], batch: int, n: int, seed: int) -> list[list[int]]:
    """`n` batches of indices grouped by length as HF's LengthGroupedSampler does: shuffled, megabatches of 50
    batches sorted by length (longest first), split."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    out: list[list[int]] = []
    mega = 50 * batch
    for at in range(0, len(order), mega):
        chunk = sorted(order[at:at + mega], key=lambda i: -lengths[i])
        out.extend(chunk[b:b + batch] for b in range(0, len(chunk) - batch + 1, batch))
    random.Random(seed + 1).shuffle(out)
    return out[:n]


def inputs_present(cache: Path, model: Path) -> bool:
    """Whether the cache's train split and the sft model exist; says which is missing (and the stage making it)."""
    for path, what in ((cache / "train.arrow", "the precompute stage"), (model / "config.json", "the sft stage")):
        if not path.is_file():
            print(f"error: {path} is missing: run `dvc repro` ({what}) first", file=sys.stderr)
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--cache", type=Path, default=ROOT / "data/cache", help="the precompute stage's cache")
    ap.add_argument("--model", type=Path, default=ROOT / "models/sft", help="the sft stage's model (the codi start)")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the stage: codi.torch_threads per process)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if not inputs_present(args.cache, args.model):
        return 2
    torch.set_num_threads(args.threads)
    params = load_params(args.params)
    cfg = params.codi
    tok = load_tokenizer(args.model)
    ds = CacheDataset(args.cache / "train.arrow")
    if cfg.uses_values:
        ds = WithValues(ds, tok)
    batches = grouped_batches(ds.lengths, cfg.batch_size, args.warmup + args.steps, args.seed)
    base = load_causal_lm(args.model, torch.float32)
    torch.manual_seed(cfg.seed)
    models, opts = {}, {}
    for name, kw in CONFIGS.items():
        m = CodiModel(copy.deepcopy(base), token_ids(tok), cfg.options, params.loss_weights, **kw)
        if name != "checkpointed":  # the same projector initialisation in all four
            m.projector.load_state_dict(models["checkpointed"].projector.state_dict())
        m.train()
        models[name] = m
        opts[name] = torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    first: dict[str, dict[str, float]] = {}
    tokens = 0
    for b, idx in enumerate(batches):
        examples = collate_examples([ds[i] for i in idx])["examples"]
        if b >= args.warmup:
            tokens += sum(len(ex["prompt_ids"]) + len(ex["trace_ids"]) for ex in examples)
        for name in CONFIGS:
            m, opt = models[name], opts[name]
            t0 = time.perf_counter()
            out = m(examples)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            if b == 0:
                first[name] = {k: float(v.detach()) for k, v in out.items()}
            if b >= args.warmup:
                times[name].append(dt)
    base_rate = cfg.batch_size / statistics.median(times["checkpointed"])
    rows = []
    print(f"codi step, default configuration: batch {cfg.batch_size}, {args.steps} timed steps each (median), "
          f"{args.threads} thread(s), {tokens / args.steps:.0f} prompt+trace tokens a step")
    print(f"{'configuration':<14} {'s/step':>8} {'examples/s':>11} {'vs checkpointed':>16}")
    for name in CONFIGS:
        med = statistics.median(times[name])
        rate = cfg.batch_size / med
        rows.append({"config": name, "s_per_step": med, "examples_per_s": rate, "speedup": rate / base_rate})
        print(f"{name:<14} {med:8.4f} {rate:11.2f} {rate / base_rate:15.2f}x")
    worst = 0.0
    print("first batch's losses: " + ", ".join(f"{k} {first['checkpointed'][k]:.6f}" for k in ("loss", "teacher_loss",
                                                                                                 "student_loss", "kd_loss",
                                                                                                 "value_loss", "value_kd_loss")))
    for name in CONFIGS:
        for k, v in first[name].items():
            ref = first["checkpointed"][k]
            worst = max(worst, abs(v - ref) / max(abs(ref), 1e-12))
    print(f"largest relative difference of a first-batch loss to `checkpointed`: {worst:.2e}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "first_losses": first, "max_rel_loss_diff": worst,
                                         "batch_size": cfg.batch_size, "steps": args.steps, "threads": args.threads},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
