"""Stage `extract`: trace every configured source inside the sandbox.

    python -m codi extract                     # data/traces/<source>.parquet, data/traces/stats.json
    python -m codi extract --checkpoints checkpoints/extract   # where finished shards wait for a rerun (default)
    python -m codi trace --source mbpp --path some/mbpp.jsonl --out /tmp/mbpp.parquet   # one file, same code

`extract.executor: dask` traces in shards on a Dask cluster (codi/tracing/cluster.py); the files are
byte-identical to the local executor's.

Killed (kill -9, a lost machine) and rerun, the stage resumes: every shard of `extract.dask.shard_size` samples
it finished is kept in `--checkpoints` (codi.data.trace_shards), and the rerun traces only the others. The
output folder is written whole at the end (a temporary sibling, then a rename), so `data/traces` is either
the previous complete output, absent, or the new complete one: never a part.

A hostile or broken program is a status row, never a dead stage. Every local dataset file (`extract.paths`)
lives under data/raw/ (a DVC dependency of this stage), so an edit to one reruns extract and what it feeds.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from codi.data.trace_shards import ShardStore, remove_stale_temporaries, run_fingerprint, trace_resumable
from codi.data.traces import trace_samples, write_traces
from codi.infra.config import ConfigError
from codi.infra.files import atomic_dir, write_json
from codi.schemas.extract import ExtractConfig
from codi.sources.registry import load_samples
from codi.tracing.cluster import open_tracer

RAW_DIR = Path("data/raw")    # the stage's DVC dependency for dataset files (relative to the repo root)


@dataclass(frozen=True)
class ExtractParams:
    """What this stage reads from params.yaml."""

    extract: ExtractConfig


def check_tracked_paths(cfg: ExtractConfig, raw_dir: Path = RAW_DIR) -> None:
    """Every local dataset file the stage reads must lie under `raw_dir`, which DVC tracks as a dependency."""
    for source in cfg.sources:
        path = cfg.paths.get(source, "")
        if path and not path.startswith("hf:") and not Path(path).resolve().is_relative_to(raw_dir.resolve()):
            raise ConfigError(f"extract.paths.{source} = {path!r}: outside {raw_dir}/, so DVC would not rerun extract "
                              f"when it changes; put the file under {raw_dir}/ (copy it there, or `dvc add` it) and "
                              "point the key at it")


def source_stats(rows: list[dict], skipped: int) -> dict:
    status = Counter(r["status"] for r in rows)
    with_expected = [r for r in rows if r["expected"] is not None]
    return {
        "samples": len(rows),
        "skipped_records": skipped,
        "status": dict(sorted(status.items())),
        "with_expected": len(with_expected),
        "match": sum(1 for r in with_expected if r["match"] is True),
        "mismatch": sum(1 for r in with_expected if r["match"] is False),
        "mean_frames_ok": round(sum(r["n_frames"] for r in rows if r["status"] == "ok") / max(status["ok"], 1), 2),
    }


def summary_line(source: str, st: dict, seconds: float, times: list[tuple[float, str]]) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in st["status"].items())
    match = (f"; expected {st['with_expected']}: match {st['match']}, mismatch {st['mismatch']}"
             if st["with_expected"] else "")
    skip = f"; {st['skipped_records']} records gave no sample" if st["skipped_records"] else ""
    slowest = ", ".join(f"{sid} {t:.2f}s" for t, sid in sorted(times, reverse=True)[:3])
    return (f"extract {source}: {st['samples']} samples ({parts}){match}{skip}; {seconds:.1f}s"
            + (f"\n  slowest: {slowest}" if slowest else ""))


def run(params: ExtractParams, out: Path, metrics: Path, checkpoints: Path) -> int:
    cfg = params.extract
    check_tracked_paths(cfg)
    # Load every source first: a malformed dataset fails before minutes of tracing.
    loads = {source: load_samples(source, cfg) for source in cfg.sources}
    store = ShardStore(checkpoints, run_fingerprint(cfg.trace, cfg.sandbox))
    remove_stale_temporaries(out)
    stats: dict = {}
    # The folder is filled under a temporary name and renamed whole at the end: a kill never leaves a part of it.
    with open_tracer(cfg) as tracer, atomic_dir(out) as tmp:
        print(f"extract: executor {cfg.executor}; sandbox isolation: {tracer.isolation}")
        for source, load in loads.items():
            t0 = time.time()
            rows, times, reused = trace_resumable(tracer, load.samples, source, store, cfg.dask.shard_size)
            if reused:
                print(f"extract {source}: resumed: {reused} finished shards reused from {store.root}")
            write_traces(rows, tmp / f"{source}.parquet")
            stats[source] = source_stats(rows, len(load.skipped))
            print(summary_line(source, stats[source], time.time() - t0, times))
        total: Counter = Counter()
        for st in stats.values():
            total.update({"samples": st["samples"], **st["status"]})
        stats["total"] = dict(total)
        # The same counts beside the traces and as DVC metrics (DVC allows no metrics file inside a tracked out).
        write_json(tmp / "stats.json", stats)
    write_json(metrics, stats)
    store.clear()
    return 0


def trace_file(params: ExtractParams, source: str, path: str | None, out: Path) -> int:
    """Trace one dataset file outside the pipeline, with the extract stage's code and limits."""
    cfg = params.extract
    load = load_samples(source, cfg, path=path)
    t0 = time.time()
    with open_tracer(cfg) as tracer:
        rows, times = trace_samples(tracer, load.samples, source)
    write_traces(rows, out)
    print(summary_line(source, source_stats(rows, len(load.skipped)), time.time() - t0, times) + f"\n  -> {out}")
    for skipped in load.skipped[:20]:
        print(f"  no sample from {skipped.where}: {skipped.why}")
    return 0
