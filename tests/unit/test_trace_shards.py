"""codi.data.trace_shards: the finished shards of a killed extract are reused by the rerun, never a stale one,
and the rows put together from reused and fresh shards are the rows of one uninterrupted run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from codi.data.trace_shards import ShardStore, remove_stale_temporaries, run_fingerprint, trace_resumable
from codi.data.traces import write_traces
from codi.sources.base import Sample
from codi.tracing.format import Frame
from codi.tracing.sandbox import TraceResult
from tests.tiny import shipped

SAMPLES = [Sample(f"synthetic/{i}/0", "synthetic", f"synthetic/{i}", f"def f(a):\n    return a + {i}\n", "f(1)",
                  expected=str(1 + i), difficulty=1) for i in range(10)]


class FakeTracer:
    """Answers each sample at once; dies (as a kill would end the stage) after `die_after` results."""

    isolation = "none (a test double)"

    def __init__(self, die_after: int | None = None) -> None:
        self.die_after, self.traced = die_after, []

    def trace(self, samples: Iterable[Sample]) -> Iterator[TraceResult]:
        for n, s in enumerate(samples):
            if n == self.die_after:
                raise KeyboardInterrupt("killed")
            self.traced.append(s.sample_id)
            frame = Frame("return", "    return a\n", "", repr(int(s.expected)))
            yield TraceResult(s.sample_id, "ok", "", (frame,), s.expected, True, 0.01, "")


def fingerprint(**trace_overrides) -> str:
    return run_fingerprint(shipped("extract.trace", **trace_overrides), shipped("extract.sandbox"))


def test_a_rerun_traces_only_the_shards_the_killed_run_had_not_finished(tmp_path: Path) -> None:
    whole, _, reused = trace_resumable(FakeTracer(), SAMPLES, "synthetic", ShardStore(tmp_path / "a", fingerprint()), 4)
    assert reused == 0
    store = ShardStore(tmp_path / "b", fingerprint())
    with pytest.raises(KeyboardInterrupt):   # shards [0, 4) and [4, 8) finished, the third was under way
        trace_resumable(FakeTracer(die_after=9), SAMPLES, "synthetic", store, 4)
    assert len(list((tmp_path / "b/synthetic").glob("*.parquet"))) == 2
    again = FakeTracer()
    rows, times, reused = trace_resumable(again, SAMPLES, "synthetic", store, 4)
    assert reused == 2 and again.traced == [s.sample_id for s in SAMPLES[8:]]
    assert [sid for _, sid in times] == again.traced
    assert rows == whole                     # the reused rows read back are the rows the tracer gave
    write_traces(whole, tmp_path / "whole.parquet")
    write_traces(rows, tmp_path / "resumed.parquet")
    assert (tmp_path / "whole.parquet").read_bytes() == (tmp_path / "resumed.parquet").read_bytes()
    store.clear()
    assert not store.root.exists()


@pytest.mark.parametrize("change", ["limits", "samples", "shard size"])
def test_a_change_of_limits_samples_or_shard_size_never_reuses_a_shard(tmp_path: Path, change: str) -> None:
    trace_resumable(FakeTracer(), SAMPLES, "synthetic", ShardStore(tmp_path, fingerprint()), 4)
    store, samples, size = ShardStore(tmp_path, fingerprint()), SAMPLES, 4
    if change == "limits":
        store = ShardStore(tmp_path, fingerprint(max_repr_chars=9))
    elif change == "samples":
        samples = [dataclasses.replace(s, call="f(2)") for s in SAMPLES]
    else:
        size = 5
    tracer = FakeTracer()
    _, _, reused = trace_resumable(tracer, samples, "synthetic", store, size)
    assert reused == 0 and len(tracer.traced) == len(SAMPLES)


def test_the_fingerprint_follows_the_tracers_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import codi.data.trace_shards as shards

    before = fingerprint()
    (tmp_path / "tracer.py").write_text("# another tracer\n")
    monkeypatch.setattr(shards, "TRACING_DIR", tmp_path)
    assert fingerprint() != before


def test_a_damaged_shard_is_traced_again(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    store = ShardStore(tmp_path, fingerprint())
    whole, _, _ = trace_resumable(FakeTracer(), SAMPLES, "synthetic", store, 4)
    first = store.path("synthetic", 0, SAMPLES[:4])
    first.write_bytes(first.read_bytes()[:100])
    tracer = FakeTracer()
    rows, _, reused = trace_resumable(tracer, SAMPLES, "synthetic", store, 4)
    assert reused == 2 and tracer.traced == [s.sample_id for s in SAMPLES[:4]] and rows == whole
    assert f"{first}: not a finished shard" in capsys.readouterr().out


def test_stale_temporaries_of_dead_writers_are_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    out = tmp_path / "traces"
    (tmp_path / f".traces.tmp-{dead.stdout.strip()}").mkdir()
    (tmp_path / f".traces.tmp-{os.getpid()}").mkdir()
    (tmp_path / ".other.tmp-1").mkdir()
    remove_stale_temporaries(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-1", f".traces.tmp-{os.getpid()}"]
