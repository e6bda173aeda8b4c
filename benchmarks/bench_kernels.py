"""What each `kernels.cpu` choice costs: sft training throughput (tokens/s) of the tiny default model under each CPU
kernel pin set, measured in one run, with each set's ops md5 (codi.infra.kernels.kernel_ops_md5).

    python benchmarks/bench_kernels.py [--steps 40] [--rounds 3] [--batch 8] [--seq 186]

The pins are read once, when torch first runs an op, so every measurement is its own subprocess started with the
set's environment; the sets are interleaved round by round (A B C, A B C, ...) so that a change in the host's
load falls on all of them alike, and each set's figure is the median of its rounds. A step is what the sft
stage's step is: forward, backward and AdamW on a batch of `--batch` sequences of `--seq` tokens (186: the mean
example of the default task, metrics/precompute.json), one torch thread, the model sized by params.yaml
`model.tiny`. Besides `native` and `avx2` (the two choices of params.yaml) it measures the candidate the
reproducibility note also considered: ATen's scalar kernels with MKL's compatible path (`default-compatible`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codi.infra.kernels import CPU_KERNEL_PINS  # noqa: E402  (no torch: the parent never imports it)

SETS: dict[str, dict[str, str]] = {
    **CPU_KERNEL_PINS,
    "default-compatible": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
PIN_VARS = sorted({var for pins in SETS.values() for var in pins})


def _child(steps: int, batch: int, seq: int) -> dict:
    """One measurement in this (pinned) process: tokens/s over `steps` sft steps after 3 warm-up steps."""
    import time

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from codi.infra.config import load_params
    from codi.infra.kernels import kernel_ops_md5

    torch.set_num_threads(1)
    cfg = load_params(ROOT / "params.yaml").model.tiny
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ids = torch.randint(0, cfg.vocab_size, (steps + 3, batch, seq))

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for k in range(3):
        step(ids[k])
    t0 = time.perf_counter()
    for k in range(3, steps + 3):
        loss = step(ids[k])
    dt = time.perf_counter() - t0
    return {"tokens_per_s": steps * batch * seq / dt, "loss": float(loss),
            "capability": torch.backends.cpu.get_cpu_capability(), "ops_md5": kernel_ops_md5()}


def measure(name: str, steps: int, batch: int, seq: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARS} | SETS[name] | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps), "--batch", str(batch),
                          "--seq", str(seq)], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=186)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.steps, args.batch, args.seq)))
        return 0
    runs: dict[str, list[dict]] = {name: [] for name in SETS}
    for r in range(args.rounds):
        for name in SETS:
            runs[name].append(measure(name, args.steps, args.batch, args.seq))
            print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    base = statistics.median(x["tokens_per_s"] for x in runs["native"])
    print(f"\nsft step throughput, tiny default model, batch {args.batch} x {args.seq} tokens, one thread, "
          f"median of {args.rounds} interleaved rounds:")
    print("| kernels | pins | torch runs | tokens/s | vs native | ops md5 |")
    print("|---|---|---|---|---|---|")
    for name, xs in runs.items():
        tps = statistics.median(x["tokens_per_s"] for x in xs)
        pins = " ".join(f"{k}={v}" for k, v in SETS[name].items()) or "-"
        print(f"| {name} | {pins} | {xs[0]['capability']} | {tps:.0f} | {tps / base:.2f}x | {xs[0]['ops_md5']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
