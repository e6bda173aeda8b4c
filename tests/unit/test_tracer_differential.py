"""`codi trace` against an independent settrace reference, frame for frame, on the shipped fixtures.

The reference (tests/reference_tracer.py) runs each program natively in its own interpreter with
PYTHONHASHSEED=0 and shares no code with codi/tracing; codi runs them in its sandbox. Equal frames
mean the trace says what CPython did: every exception raised or caught, every generator resumed or
closed, and a sandboxed program that behaves as the native one (codecs, lazily imported modules).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from codi.sources.base import Sample
from codi.tracing.format import entry_exit, exit_kind
from codi.tracing.sandbox import TracerPool
from tests.fixtures.differential_programs import PROGRAMS
from tests.tiny import shipped

ROOT = Path(__file__).parents[2]
SANDBOX = shipped("extract.sandbox", wall_timeout_s=10.0)
# Every local written out (no ".." diff) and reprs never cut: what the reference writes.
TRACE = dataclasses.replace(shipped("extract.trace"), diff_locals=False, max_frames=2000, max_repr_chars=100_000)


def reference_traces() -> list[dict]:
    jobs = json.dumps([{"program": program, "call": call} for _, program, call in PROGRAMS])
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "reference_tracer.py")], input=jobs,
                          capture_output=True, text=True, env=env, timeout=120, check=True)
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def both() -> list[tuple[str, object, dict]]:
    samples = [Sample(name, "synthetic", name, program, call) for name, program, call in PROGRAMS]
    with TracerPool(TRACE, SANDBOX, workers=2) as pool:
        results = pool.trace(samples)
    return [(name, r, ref) for (name, _, _), r, ref in zip(PROGRAMS, results, reference_traces())]


def as_reference(frames) -> list[list]:
    return [[f.kind, f.source_line, list(map(list, f.locals_dict().items())) if f.locals is not None else None,
             f.value_repr()] for f in frames]


def test_the_fixture_covers_enough_programs() -> None:
    assert len(PROGRAMS) >= 40 and len({name for name, _, _ in PROGRAMS}) == len(PROGRAMS)


@pytest.mark.parametrize("index", range(len(PROGRAMS)), ids=[name for name, _, _ in PROGRAMS])
def test_codi_trace_equals_the_reference_frame_for_frame(both, index: int) -> None:
    name, result, ref = both[index]
    assert result.status in ("ok", "raised"), (name, result.status, result.reason)
    assert result.status == ref["status"], (name, result.reason)
    got, want = as_reference(result.frames), ref["frames"]
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    assert got == want, f"{name}: first difference at frame {first}: codi {got[first:first + 2]} " \
                        f"reference {want[first:first + 2]}"
    exit_frame = entry_exit(list(result.frames))
    assert exit_frame is result.frames[-1] and exit_frame.value_repr() == ref["value"]
    assert exit_kind(list(result.frames), exit_frame) == ("exception" if ref["status"] == "raised" else "return")


def frames_of(both, name: str):
    return next(r.frames for n, r, _ in both if n == name)


def test_a_caught_exception_is_shown_before_its_handler(both) -> None:
    """The documented choice (docs/design/trace-format.md, "The trace format"): an exception frame at the raising line, then the
    handler's lines; the frame goes on (no return frame, no change of depth)."""
    frames = frames_of(both, "caught_bare_except")
    kinds = [(f.kind, f.source_line.strip()) for f in frames]
    assert kinds == [("call", "def f(date):"), ("line", "try:"), ("line", "month, day, year = date.split('-')"),
                     ("exception", "month, day, year = date.split('-')"), ("line", "except:"),
                     ("line", "return None"), ("return", "return None")]
    assert frames[3].value_repr() == "ValueError('not enough values to unpack (expected 3, got 2)')"
    assert frames[-1].value_repr() == "None"


def test_a_generator_closed_early_exits_by_generator_exit(both) -> None:
    frames = frames_of(both, "all_short_circuits")
    genexpr = [(f.kind, f.value_repr()) for f in frames if f.kind in ("exception", "return")]
    # '1' is odd, '2' is not: all() stops, and the generator is closed at its yield
    assert genexpr[-3:] == [("exception", "GeneratorExit()"), ("return", "GeneratorExit()"), ("return", "False")]


def test_the_shift_jis_program_gets_the_native_result(both) -> None:
    [result] = [r for n, r, _ in both if n == "codec_shift_jis"]
    assert (result.status, result.return_repr) == ("ok", "('13:45:56', 8)")
    assert not any(f.kind == "exception" for f in result.frames)
