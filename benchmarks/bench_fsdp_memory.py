"""Benchmark: what each process holds of the parameters, gradients and optimizer state, DDP against FSDP2, at 1, 2 and
4 processes (gloo, CPU), in one run.

    python benchmarks/bench_fsdp_memory.py                          # Qwen2-style, 12 layers, hidden 768, vocab 32000
    python benchmarks/bench_fsdp_memory.py --layers 2 --hidden 64 --vocab 512 --processes 1 2   # a quick look

Each configuration runs one AdamW step (fp32, a batch of 2 x 32 tokens per process) in fresh worker processes
started as the training stages start theirs (codi.infra.launch.spawn_workers), with the model sharded as the sft
stage shards it under `strategy: fsdp` (codi.training.fsdp.shard_model: each decoder layer a group, then the root).
After the step each worker counts the bytes of the tensors it holds: its parameters (its shard under FSDP),
their gradients, and the optimizer's state (AdamW's two moments and step), and its peak RSS (ru_maxrss), which adds
the Python/torch runtime, activations and, under DDP, the gradient buckets. The table shows rank 0's figures in MiB
(every rank holds the same amounts, to within a shard's rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2 ** 20


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def worker(args: argparse.Namespace) -> None:
    """One process of one configuration: build, wrap, step once, count, write rank's JSON."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64 or 1,
                      num_key_value_heads=args.hidden // 64 or 1, tie_word_embeddings=True,
                      max_position_embeddings=256)
    model = Qwen2ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if world > 1 and args.strategy == "fsdp":
        from codi.training.fsdp import shard_model
        shard_model(model, "cpu")
        trained = model
    elif world > 1:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    else:
        trained = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (2, 32), generator=torch.Generator().manual_seed(rank))
    trained(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # the moments exist after the first step; the gradients are kept (no zero_grad) to be counted
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(
        {"params": params, "grads": grads, "optim": optim, "rss": rss, "n_params": n_params}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(strategy: str, processes: int, args: argparse.Namespace) -> dict:
    from codi.infra.launch import spawn_workers

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", "--strategy", strategy, "--out", out, "--layers",
               str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if processes == 1:
            import subprocess
            code = subprocess.run(cmd, env=env).returncode
        else:
            code = spawn_workers(cmd, processes, env=env)
        if code != 0:
            raise SystemExit(f"{strategy} x {processes}: a worker exited with {code}")
        return json.loads(Path(out, "rank0.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for n in args.processes:
        for strategy in (("ddp", "fsdp") if n > 1 else ("ddp",)):
            r = measure(strategy, n, args)
            rows.append((n, strategy if n > 1 else "one process", r))
            print(f"measured {rows[-1][1]} x {n}", file=sys.stderr, flush=True)
    n_params = rows[0][2]["n_params"]
    print(f"Qwen2-style LM, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} (tied head): "
          f"{n_params / 1e6:.1f}M parameters, fp32, AdamW; per process (rank 0), MiB")
    print("| processes | strategy | parameters | gradients | optimizer state | sum | peak RSS |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n, strategy, r in rows:
        total = r["params"] + r["grads"] + r["optim"]
        print(f"| {n} | {strategy} | {r['params'] / MIB:,.1f} | {r['grads'] / MIB:,.1f} | {r['optim'] / MIB:,.1f} | "
              f"{total / MIB:,.1f} | {r['rss'] / MIB:,.0f} |")


if __name__ == "__main__":
    main()
