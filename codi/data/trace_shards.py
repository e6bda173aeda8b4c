"""Resumable tracing: the extract stage keeps every finished shard of traces, so that a killed run resumes.

    store = ShardStore(Path("checkpoints/extract"), run_fingerprint(cfg.trace, cfg.sandbox))
    rows, times, reused = trace_resumable(tracer, samples, "mbpp", store, shard_size=256)
    ...  # write the final data/traces/<source>.parquet from `rows`
    store.clear()                          # the stage finished: nothing left to resume

A shard is `shard_size` consecutive samples of one source. Each finished shard is written atomically as a
traces file `<dir>/<source>/<index>-<key>.parquet`, its key a hash of the tracer's code, the trace and sandbox
limits and the shard's own samples: a change to any of them gives a new key, so a stale shard is never reused
(it is left aside, and removed when the stage finishes). The folder lies outside the stage's DVC output
(`dvc repro` deletes an output before it reruns the stage), in checkpoints/ with the training stages' own.
The rows of a reused shard are the rows the sandbox gave, read back from the shard file: the final traces
files are byte-identical to an uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
from tqdm import tqdm

from codi.data.traces import trace_row, write_traces
from codi.tracing.cluster import shard_bounds

if TYPE_CHECKING:  # types only
    from codi.schemas.extract import SandboxConfig, TraceConfig
    from codi.sources.base import Sample
    from codi.tracing.cluster import Tracer

TRACING_DIR = Path(__file__).resolve().parents[1] / "tracing"
TRACES_MODULE = Path(__file__).resolve().parent / "traces.py"


def tracer_code_digest() -> str:
    """A digest of the code that turns a sample into a row: every module of codi/tracing and the row format."""
    h = hashlib.sha256()
    for path in sorted(TRACING_DIR.glob("*.py")) + [TRACES_MODULE]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def run_fingerprint(trace: TraceConfig, sandbox: SandboxConfig) -> str:
    """What, besides its samples, decides a shard's rows: the tracer's code and the trace and sandbox limits.
    (The executor, the worker count and the Dask cluster do not: their rows are byte-identical.)"""
    settings = json.dumps({"trace": dataclasses.asdict(trace), "sandbox": dataclasses.asdict(sandbox)},
                          sort_keys=True)
    return hashlib.sha256(f"{tracer_code_digest()}\n{settings}".encode()).hexdigest()


def shard_key(fingerprint: str, samples: Sequence[Sample]) -> str:
    h = hashlib.sha256(fingerprint.encode())
    for s in samples:
        h.update(json.dumps(dataclasses.asdict(s), sort_keys=True).encode() + b"\n")
    return h.hexdigest()[:20]


class ShardStore:
    """The finished shards of one extract run's output, in `root` (a folder no DVC output contains)."""

    def __init__(self, root: Path, fingerprint: str) -> None:
        self.root, self.fingerprint = Path(root), fingerprint

    def path(self, source: str, index: int, samples: Sequence[Sample]) -> Path:
        return self.root / source / f"{index:06d}-{shard_key(self.fingerprint, samples)}.parquet"

    def load(self, path: Path, samples: Sequence[Sample]) -> list[dict[str, Any]] | None:
        """The rows of a finished shard, or None when there is none to reuse (absent, unreadable, or not these
        samples' rows: then the shard is traced again)."""
        if not path.is_file():
            return None
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as e:  # written atomically, so only a foreign or damaged file lands here
            print(f"extract: {path}: not a finished shard ({e}); tracing it again")
            return None
        if [r["sample_id"] for r in rows] != [s.sample_id for s in samples]:
            print(f"extract: {path}: holds other samples; tracing it again")
            return None
        return rows

    def save(self, path: Path, rows: Sequence[dict[str, Any]]) -> None:
        write_traces(rows, path)

    def clear(self) -> None:
        """Forget every shard: called once the final traces are written."""
        shutil.rmtree(self.root, ignore_errors=True)


def trace_resumable(tracer: Tracer, samples: list[Sample], source: str, store: ShardStore, shard_size: int
                    ) -> tuple[list[dict[str, Any]], list[tuple[float, str]], int]:
    """The rows of every sample, in input order: finished shards read back from `store`, the others traced (in
    one stream, so the tracer's workers stay busy across shard boundaries) and saved there as each completes.

    Returns (rows, [(wall seconds, sample id)] of the samples traced now, number of shards reused)."""
    bounds = shard_bounds(len(samples), shard_size)
    paths = [store.path(source, i, samples[a:b]) for i, (a, b) in enumerate(bounds)]
    finished = {i: rows for i, (a, b) in enumerate(bounds)
                if (rows := store.load(paths[i], samples[a:b])) is not None}
    pending = [i for i in range(len(bounds)) if i not in finished]
    todo = [s for i in pending for s in samples[slice(*bounds[i])]]
    times: list[tuple[float, str]] = []
    results = iter(tqdm(tracer.trace(todo), total=len(todo), desc=source, unit="sample", leave=False))
    for i in pending:
        a, b = bounds[i]
        rows = []
        for sample, result in zip(samples[a:b], _take(results, b - a, source, i)):
            rows.append(trace_row(sample, result))
            times.append((result.time_s, sample.sample_id))
        store.save(paths[i], rows)
        finished[i] = rows
    return [row for i in range(len(bounds)) for row in finished[i]], times, len(bounds) - len(pending)


def _take(results: Iterator, n: int, source: str, shard: int) -> list:
    taken = [r for _, r in zip(range(n), results)]
    if len(taken) != n:
        raise RuntimeError(f"extract {source}: the tracer gave {len(taken)} results for the {n} samples of shard {shard}")
    return taken


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary siblings (`.<name>.tmp-<pid>`, codi.infra.files.atomic_dir) that a killed writer
    of `path` left behind; a live process's own is kept."""
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
