"""Stage `extract`: trace every configured source inside the sandbox.

    python -m codi extract [--out data/traces]
    python -m codi trace --source mbpp --path mbpp.jsonl --out /tmp/mbpp.parquet   # one file, same code

Writes `data/traces/<source>.parquet` (one row per sample, failed ones included, with a status and
a reason) and `data/traces/stats.json` (counts by source and status; DVC metrics). A hostile or broken
program is a status row, never a dead stage.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from codi.config import Params
from codi.sources.base import Sample
from codi.sources.registry import load_samples
from codi.tracing.format import render_trace
from codi.tracing.sandbox import TraceResult, TracerPool

FRAME_TYPE = pa.struct([("kind", pa.string()), ("source_line", pa.string()),
                        ("locals", pa.string()), ("value", pa.string())])
SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("source", pa.string()), ("problem_id", pa.string()),
    ("program", pa.string()), ("call", pa.string()), ("setup", pa.string()),
    ("frames", pa.list_(FRAME_TYPE)), ("trace_text", pa.string()), ("return_repr", pa.string()),
    ("expected", pa.string()), ("match", pa.bool_()), ("status", pa.string()), ("reason", pa.string()),
    ("n_frames", pa.int32()), ("output", pa.string()),
])
# No wall times in the rows: they differ from run to run, and DVC hashes data/traces; the same
# sources and params give byte-identical files. The slowest samples are named on stdout instead.


def result_row(sample: Sample, result: TraceResult) -> dict:
    return {
        "sample_id": sample.sample_id, "source": sample.source, "problem_id": sample.problem_id,
        "program": sample.program, "call": sample.call, "setup": sample.setup,
        "frames": [{"kind": f.kind, "source_line": f.source_line, "locals": f.locals, "value": f.value}
                   for f in result.frames],
        "trace_text": render_trace(list(result.frames)), "return_repr": result.return_repr,
        "expected": sample.expected, "match": result.match, "status": result.status, "reason": result.reason,
        "n_frames": len(result.frames), "output": result.output,
    }


def write_rows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp, compression="zstd")
    tmp.replace(path)  # a kill mid-write never leaves a complete-looking file


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


def trace_samples(pool: TracerPool, samples: list[Sample], desc: str) -> tuple[list[dict], list[tuple[float, str]]]:
    """(rows, [(wall seconds, sample id)] of each sample)."""
    rows, times = [], []
    for s, r in zip(samples, tqdm(pool.trace(samples), total=len(samples), desc=desc, unit="sample", leave=False)):
        rows.append(result_row(s, r))
        times.append((r.time_s, s.sample_id))
    return rows, times


def slowest_line(times: list[tuple[float, str]], k: int = 3) -> str:
    top = sorted(times, reverse=True)[:k]
    return "  slowest: " + ", ".join(f"{sid} {t:.2f}s" for t, sid in top) if top else ""


def summary_line(source: str, st: dict, seconds: float) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in st["status"].items())
    match = (f"; expected {st['with_expected']}: match {st['match']}, mismatch {st['mismatch']}"
             if st["with_expected"] else "")
    skip = f"; {st['skipped_records']} records gave no sample" if st["skipped_records"] else ""
    return f"extract {source}: {st['samples']} samples ({parts}){match}{skip}; {seconds:.1f}s"


def run(params: Params, out_dir: Path, metrics: Path = Path("metrics/extract.json")) -> int:
    cfg = params.extract
    out_dir.mkdir(parents=True, exist_ok=True)
    stats: dict = {}
    # Load every source first: a malformed dataset fails before minutes of tracing.
    loads = {source: load_samples(source, cfg) for source in cfg.sources}
    with TracerPool(cfg.trace, cfg.sandbox, cfg.workers) as pool:
        print(f"extract: sandbox isolation: {pool.isolation}")
        for source, load in loads.items():
            t0 = time.time()
            rows, times = trace_samples(pool, load.samples, source)
            write_rows(rows, out_dir / f"{source}.parquet")
            stats[source] = source_stats(rows, len(load.skipped))
            print(summary_line(source, stats[source], time.time() - t0))
            print(slowest_line(times))
    total = Counter()
    for st in stats.values():
        total.update({"samples": st["samples"], **st["status"]})
    stats["total"] = dict(total)
    # The same counts twice: beside the traces for people and tools, and as DVC metrics (DVC does
    # not allow a metrics file inside the tracked data/traces folder).
    for path in (out_dir / "stats.json", metrics):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(stats, indent=2) + "\n")
        tmp.replace(path)
    return 0


def trace_file(params: Params, source: str, path: str | None, out: Path) -> int:
    """Trace one dataset file outside the pipeline, with the extract stage's code and limits."""
    cfg = params.extract
    load = load_samples(source, cfg, path=path)
    t0 = time.time()
    with TracerPool(cfg.trace, cfg.sandbox, cfg.workers) as pool:
        rows, times = trace_samples(pool, load.samples, source)
    write_rows(rows, out)
    st = source_stats(rows, len(load.skipped))
    print(summary_line(source, st, time.time() - t0) + f" -> {out}")
    print(slowest_line(times))
    for where, why in [(s.where, s.why) for s in load.skipped][:20]:
        print(f"  no sample from {where}: {why}")
    return 0
