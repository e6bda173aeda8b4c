"""Extraction throughput, local executor vs Dask, and the projection for a million programs.

    python benchmarks/bench_extract_dask.py                                  # 600 generated samples
    python benchmarks/bench_extract_dask.py --source mbpp --mbpp data/raw/mbpp.jsonl --n 1000

Measured in one run, on the same samples: samples/s of one sandbox process (the per-worker rate), of the
local executor with one sandbox process per core, and of `extract.executor: dask` on a LocalCluster of 1
and of `--dask-workers` worker processes (one sandbox process each, shards of `--shard-size`). Cluster
start-up is timed apart. Every run must give the local executor's rows (checked). The projection for
1M samples on N workers takes the per-worker rate of the largest Dask run (each worker has about one
core there, its sandbox process included) and assumes it holds as workers are added.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_sandbox import generated, mbpp  # noqa: E402  (benchmarks/ is on sys.path as the script's dir)

from codi.infra.config import load_params  # noqa: E402
from codi.schemas.extract import ExtractConfig  # noqa: E402
from codi.sources.base import Sample  # noqa: E402
from codi.data.traces import trace_row  # noqa: E402
from codi.tracing.cluster import open_tracer  # noqa: E402

SHIPPED = load_params(ROOT / "params.yaml")  # config dataclasses have no defaults


def timed(cfg: ExtractConfig, samples: list[Sample]) -> tuple[float, float, list[dict]]:
    """(start-up seconds, tracing seconds, rows)."""
    t0 = time.perf_counter()
    with open_tracer(cfg) as tracer:
        tracer.isolation  # noqa: B018  (starts the pools, so start-up is not counted as tracing)
        t1 = time.perf_counter()
        rows = [trace_row(s, r) for s, r in zip(samples, tracer.trace(samples))]
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=600, help="samples per run")
    ap.add_argument("--source", choices=["generated", "mbpp"], default="generated")
    ap.add_argument("--mbpp", type=Path, default=ROOT.parent / "shared/datasets/mbpp/mbpp.jsonl")
    ap.add_argument("--dask-workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--shard-size", type=int, default=SHIPPED.extract.dask.shard_size)
    args = ap.parse_args()
    samples = generated(args.n) if args.source == "generated" else mbpp(args.mbpp, args.n)
    base = SHIPPED.extract
    cores = os.cpu_count() or 1

    def dask_cfg(workers: int) -> ExtractConfig:
        return dataclasses.replace(base, executor="dask", workers=1, dask=dataclasses.replace(
            base.dask, address="", local_workers=workers, shard_size=args.shard_size))

    runs = [("local, 1 sandbox process", dataclasses.replace(base, executor="local", workers=1), 1),
            (f"local, {cores} sandbox processes", dataclasses.replace(base, executor="local", workers=cores), cores),
            ("dask, 1 worker x 1 process", dask_cfg(1), 1),
            (f"dask, {args.dask_workers} workers x 1 process", dask_cfg(args.dask_workers), args.dask_workers)]
    print(f"{len(samples)} {args.source} samples, shards of {args.shard_size}, {cores} cores\n")
    print(f"{'executor':<34}{'start s':>9}{'trace s':>9}{'samples/s':>11}{'per worker':>12}  same rows")
    reference, per_worker = None, 0.0
    for name, cfg, workers in runs:
        start, seconds, rows = timed(cfg, samples)
        reference = reference if reference is not None else rows
        rate = len(samples) / seconds
        per_worker = rate / workers  # the last run: the largest Dask cluster
        print(f"{name:<34}{start:>9.2f}{seconds:>9.2f}{rate:>11.1f}{rate / workers:>12.1f}  {rows == reference}")
        if rows != reference:
            print("error: the rows differ from the local executor's", file=sys.stderr)
            return 1
    print(f"\nprojection, 1M {args.source} samples at {per_worker:.1f} samples/s per Dask worker (one core each):")
    for n in (1, 8, 32, 128, 512):
        hours = 1e6 / (per_worker * n) / 3600
        print(f"  {n:>4} workers: {hours:8.2f} h" if hours >= 1 else f"  {n:>4} workers: {hours * 60:8.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
