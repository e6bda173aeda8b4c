"""The traces files `data/traces/<source>.parquet`: one row per sample, failed ones included, with a status.

    write_traces(rows, "data/traces/mbpp.parquet")        # rows: dicts with TRACE_SCHEMA's fields
    rows = read_traces("data/traces/mbpp.parquet", ["sample_id", "trace_text", "status"])
    rows, times = trace_samples(tracer, samples, "mbpp")     # the rows of traced samples (stage extract)

No wall times in the rows: DVC hashes data/traces, and the same sources and params give byte-identical files.
A traces file that is truncated or not Parquet is a TracesFileError naming it and the stage that rebuilds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from codi.infra.files import atomic_path
from codi.tracing.format import render_trace

if TYPE_CHECKING:  # types only: the traces file does not depend on the sandbox's code
    from codi.sources.base import Sample
    from codi.tracing.cluster import Tracer
    from codi.tracing.sandbox import TraceResult

FRAME_TYPE = pa.struct([("kind", pa.string()), ("source_line", pa.string()),
                        ("locals", pa.string()), ("value", pa.string())])
TRACE_SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("source", pa.string()), ("problem_id", pa.string()),
    ("program", pa.string()), ("call", pa.string()), ("setup", pa.string()),
    ("frames", pa.list_(FRAME_TYPE)), ("trace_text", pa.string()), ("return_repr", pa.string()),
    ("expected", pa.string()), ("match", pa.bool_()), ("status", pa.string()), ("reason", pa.string()),
    ("n_frames", pa.int32()), ("output", pa.string()),
    ("difficulty", pa.int32()),  # a graded source's level (synthetic: 1-3); 0 = ungraded
])


PARQUET_MAGIC = b"PAR1"  # a Parquet file starts and ends with it
REBUILD = "rebuild the traces: dvc repro extract (or python -m codi extract)"


class TracesFileError(ValueError):
    """A traces file that this version cannot read; the message names the file."""


def _parquet_problem(path: Path, why: str) -> str:
    """Why pyarrow could not read the file, in words, from its first and last bytes (else pyarrow's `why`)."""
    size = path.stat().st_size
    if size == 0:
        return "empty"
    with open(path, "rb") as f:
        head = f.read(len(PARQUET_MAGIC))
        f.seek(max(0, size - len(PARQUET_MAGIC)))
        tail = f.read()
    if head != PARQUET_MAGIC:
        return "not a Parquet file (it does not start with the Parquet magic bytes)"
    if tail != PARQUET_MAGIC:
        return f"truncated ({size} bytes; its end holds no Parquet footer)"
    return f"corrupted ({why})"


def write_traces(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(pa.Table.from_pylist(list(rows), schema=TRACE_SCHEMA), tmp, compression="zstd")


def read_traces(path: str | Path, columns: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of a traces file, only `columns` (each must be one of TRACE_SCHEMA's)."""
    unknown = [c for c in columns if c not in TRACE_SCHEMA.names]
    if unknown:
        raise ValueError(f"read_traces: {unknown[0]!r} is not a traces column ({TRACE_SCHEMA.names})")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TracesFileError(f"{path}: {_parquet_problem(Path(path), why)}; {REBUILD}") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise TracesFileError(f"{path}: not a traces file of this version: missing column {missing[0]!r} "
                              "(rerun the extract stage)")
    return table.select(list(columns)).to_pylist()


def trace_row(sample: Sample, result: TraceResult) -> dict[str, Any]:
    """One row of a traces file (codi.data.traces.TRACE_SCHEMA)."""
    return {
        "sample_id": sample.sample_id, "source": sample.source, "problem_id": sample.problem_id,
        "program": sample.program, "call": sample.call, "setup": sample.setup,
        "frames": [{"kind": f.kind, "source_line": f.source_line, "locals": f.locals, "value": f.value}
                   for f in result.frames],
        "trace_text": render_trace(list(result.frames)), "return_repr": result.return_repr,
        "expected": sample.expected, "match": result.match, "status": result.status, "reason": result.reason,
        "n_frames": len(result.frames), "output": result.output, "difficulty": sample.difficulty,
    }


def trace_samples(tracer: Tracer, samples: list[Sample], desc: str) -> tuple[list[dict], list[tuple[float, str]]]:
    """Every sample traced by `tracer` (codi.tracing.cluster.open_tracer: the extract stage's sandbox and limits),
    with a progress bar: (rows, [(wall seconds, sample id)] of each sample)."""
    rows, times = [], []
    for s, r in zip(samples, tqdm(tracer.trace(samples), total=len(samples), desc=desc, unit="sample", leave=False)):
        rows.append(trace_row(s, r))
        times.append((r.time_s, s.sample_id))
    return rows, times
