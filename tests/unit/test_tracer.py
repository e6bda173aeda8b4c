"""The tracer through the sandbox: frame semantics, the ".." encoding, limits, determinism, statuses."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading

import pytest

from codi.sources.base import Sample
from codi.tracing.format import REPR_CUT, UNCHANGED, entry_exit, exit_kind, parse_trace, render_trace
from codi.tracing.sandbox import STATUSES, TracerPool, candidate_modes, trace_in_fresh_interpreter
from codi.tracing.tokens import FRAME_SEP
from codi.tracing.worker import build_frames, parse_stream
from tests.tiny import shipped

SANDBOX = shipped("extract.sandbox", wall_timeout_s=5.0)
# The trace grammar's diff encoding ("..") and roomy limits: what these tests read back.
TRACE = shipped("extract.trace", diff_locals=True, max_frames=512, max_repr_chars=120)
DESIGN_EXAMPLE = "def f(a, b):\n    y = a\n    for i in range(b):\n        y += y * i\n    return y\n"


def sample(program: str, call: str, expected: str | None = None, setup: str = "", sid: str = "t") -> Sample:
    return Sample(sid, "synthetic", sid, program, call, expected=expected, setup=setup)


@pytest.fixture(scope="module")
def pool():
    with TracerPool(TRACE, SANDBOX, workers=2) as p:
        yield p


def one(pool: TracerPool, *args, **kwargs):
    [result] = pool.trace([sample(*args, **kwargs)])
    return result


def test_design_example_trace_text(pool) -> None:
    r = one(pool, DESIGN_EXAMPLE, "f(1, 3)", expected="6")
    assert (r.status, r.reason, r.return_repr, r.match) == ("ok", "", "6", True)
    frames = list(r.frames)
    text = render_trace(frames)
    assert text.startswith('<|call_sep|>{"a": "1", "b": "3"}<|action_sep|>def f(a, b):\n' + FRAME_SEP
                           + '<|line_sep|>{"a": "..", "b": ".."}<|action_sep|>    y = a\n' + FRAME_SEP
                           + '<|line_sep|>{"a": "..", "b": "..", "y": "1"}<|action_sep|>    for i in range(b):\n')
    assert text.endswith('<|return_sep|><|action_sep|>    return y\n<|arg_sep|>"6"' + FRAME_SEP)
    assert render_trace(parse_trace(text)) == text
    assert entry_exit(frames) is frames[-1] and frames[-1].value_repr() == r.return_repr
    # y is 1, 1, 2, 6 after each iteration: written only when its repr changed in this scope
    ys = [f.locals_dict().get("y") for f in frames if f.kind == "line"]
    assert ys == [None, "1", UNCHANGED, UNCHANGED, UNCHANGED, "2", UNCHANGED, "6", UNCHANGED]


def test_without_diff_every_value_is_written() -> None:
    with TracerPool(dataclasses.replace(TRACE, diff_locals=False), SANDBOX, workers=1) as p:
        [r] = p.trace([sample(DESIGN_EXAMPLE, "f(1, 3)")])
    assert r.status == "ok"
    assert all(UNCHANGED not in f.locals_dict().values() for f in r.frames if f.locals)


def test_recursion_is_a_new_scope_with_full_locals(pool) -> None:
    prog = "def fact(n):\n    if n <= 1:\n        return 1\n    return n * fact(n - 1)\n"
    r = one(pool, prog, "fact(3)", expected="6")
    assert r.status == "ok" and r.match is True
    calls = [f.locals_dict() for f in r.frames if f.kind == "call"]
    assert calls == [{"n": "3"}, {"n": "2"}, {"n": "1"}]
    returns = [f.value_repr() for f in r.frames if f.kind == "return"]
    assert returns == ["1", "2", "6"]


def test_generators_lambdas_comprehensions(pool) -> None:
    prog = ("def gen(n):\n    for i in range(n):\n        yield i * 2\n\n"
            "def f(n):\n    sq = lambda x: x * x\n    out = [sq(v) for v in gen(n)]\n    return out\n")
    r = one(pool, prog, "f(2)", expected="[0, 4]")
    assert r.status == "ok" and r.match is True
    acts = [(f.kind, f.source_line.strip()) for f in r.frames]
    comp, lam = "out = [sq(v) for v in gen(n)]", "sq = lambda x: x * x"
    assert acts[:4] == [("call", "def f(n):"), ("line", lam), ("line", comp), ("call", comp)]
    # the generator: started by a call, each yield a return frame with the yielded value, each
    # resume a call frame on the yield line, the end a return of None
    gen_frames = [(f.kind, f.source_line.strip(), f.value_repr()) for f in r.frames
                  if f.source_line.strip() in ("def gen(n):", "yield i * 2", "for i in range(n):")]
    assert gen_frames[0] == ("call", "def gen(n):", None)
    assert ("return", "yield i * 2", "0") in gen_frames and ("return", "yield i * 2", "2") in gen_frames
    assert ("call", "yield i * 2", None) in gen_frames and gen_frames[-1] == ("return", "for i in range(n):", "None")
    assert [f.value_repr() for f in r.frames if f.kind == "return" and f.source_line.strip() == lam] == ["0", "4"]
    # the comprehension's implementation name `.0` is never shown
    assert all(".0" not in f.locals_dict() for f in r.frames if f.locals)


def test_exception_frames_and_raised_status(pool) -> None:
    prog = ("def g(x):\n    try:\n        return 1 / x\n    finally:\n        y = 2\n\n"
            "def f(x):\n    try:\n        g(1)\n        int('a')\n    except ValueError:\n        pass\n    return g(x)\n")
    r = one(pool, prog, "f(0)", expected="1")
    assert r.status == "raised" and "ZeroDivisionError" in r.reason
    assert r.return_repr is None and r.match is None
    frames = list(r.frames)
    assert entry_exit(frames) is frames[-1] and exit_kind(frames, frames[-1]) == "exception"
    assert frames[-1].kind == "return" and frames[-1].value_repr() == "ZeroDivisionError('division by zero')"
    # g raises at its division, runs its `finally`, then exits by the exception (a return event that unwinds,
    # on the finally's last line); f sees the exception at its call line and exits by it too
    assert [(f.kind, f.source_line.strip()) for f in frames[-5:]] == [
        ("exception", "return 1 / x"), ("line", "y = 2"), ("return", "y = 2"), ("exception", "return g(x)"),
        ("return", "return g(x)")]
    # the ValueError raised and caught inside f is an exception frame, then its handler runs
    k = next(i for i, f in enumerate(frames) if f.kind == "exception")
    assert (frames[k].source_line.strip(), frames[k + 1].source_line.strip()) == ("int('a')", "except ValueError:")
    assert frames[k].value_repr() == "ValueError(\"invalid literal for int() with base 10: 'a'\")"
    assert sum(f.kind == "exception" for f in frames) == 3


def test_decorated_function_starts_on_its_def_line(pool) -> None:
    prog = "import functools\n\n@functools.lru_cache(maxsize=None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    r = one(pool, prog, "fib(4)", expected="3")
    assert r.status == "ok" and r.match is True
    assert {f.source_line for f in r.frames if f.kind == "call"} == {"def fib(n):\n"}


def test_truncation_at_max_frames_keeps_the_frames_so_far() -> None:
    with TracerPool(dataclasses.replace(TRACE, max_frames=10), SANDBOX, workers=1) as p:
        [r] = p.trace([sample(DESIGN_EXAMPLE, "f(1, 100)")])
    assert r.status == "truncated" and "max_frames=10" in r.reason
    assert len(r.frames) == 10 and r.return_repr is None
    assert render_trace(parse_trace(render_trace(list(r.frames)))) == render_trace(list(r.frames))


def test_long_reprs_are_cut_with_the_marker() -> None:
    with TracerPool(dataclasses.replace(TRACE, max_repr_chars=20), SANDBOX, workers=1) as p:
        [r] = p.trace([sample("def f(n):\n    xs = list(range(n))\n    return xs\n", "f(1000)")])
    assert r.status == "ok"
    assert r.return_repr == "[0, 1, 2, 3, 4,<cut>" and len(r.return_repr) == 20
    assert r.frames[-2].locals_dict()["xs"].endswith(REPR_CUT)


DETERMINISM = (
    "import random\n\nclass Box:\n    pass\n\n"
    "def f(words):\n    s = set(words)\n    b = Box()\n    r = random.random()\n    return (sorted(s), s, b, r, f)\n")


def test_the_same_sample_twice_gives_identical_text(pool) -> None:
    s = sample(DETERMINISM, "f(['apple', 'banana', 'cherry', 'date', 'elder'])")
    a, b = pool.trace([s, s])
    with TracerPool(TRACE, SANDBOX, workers=1) as other:
        [c] = other.trace([s])
    fresh = trace_in_fresh_interpreter(s, TRACE, SANDBOX)
    texts = {render_trace(list(r.frames)) for r in (a, b, c, fresh)}
    assert a.status == "ok" and len(texts) == 1
    assert '"b": "<program.Box object at 0x?>"' in texts.pop()


def test_statuses_of_unrunnable_samples(pool) -> None:
    cases = [
        (sample("def f(:\n    pass\n", "f()"), "syntax_error"),
        (sample("def g():\n    pass\n", "f()"), "error"),
        (sample("def f(x):\n    return x\n", "f(1)(2)"), "error"),
        (sample("def f(x):\n    return x\n", "f(nope)"), "error"),
        (sample("def f(x):\n    yield x\n", "f(1)"), "error"),
        (sample("import sys\nsys.exit(1)\ndef f():\n    pass\n", "f()"), "error"),
        (sample("def f():\n    return 1\n", "f()", setup="raise ValueError"), "error"),
        (sample("def f():\n    return '<|frame' + '_sep|>'\n", "f()"), "unrepresentable"),
        (sample("def f():\n    return '<|frame_sep|>'\n", "f()"), "unrepresentable"),
        (sample("def f():\n    return 1\n", "f()", expected="2"), "ok"),
        (sample("def f():\n    return 1\n", "f()", expected="undefined_name"), "ok"),
    ]
    results = list(pool.trace([s for s, _ in cases]))
    assert [r.status for r in results] == [want for _, want in cases]
    assert all(r.reason for r in results[:-2]) and all(r.status in STATUSES for r in results)
    assert results[-2].match is False and results[-1].match is None


def test_setup_runs_after_the_program_and_args_are_untraced(pool) -> None:
    prog = "def f(xs):\n    return sum(xs)\n"
    r = one(pool, prog, "f(make(3))", setup="def make(n):\n    return list(range(n))\n", expected="3")
    assert r.status == "ok" and r.match is True
    assert r.frames[0].locals_dict() == {"xs": "[0, 1, 2]"} and len(r.frames) == 3


def test_output_is_captured(pool) -> None:
    r = one(pool, "import sys\ndef f():\n    print('hello')\n    print('err', file=sys.stderr)\n    return 0\n", "f()")
    assert r.status == "ok" and "hello" in r.output and "err" in r.output


def test_fresh_interpreter_gives_the_pool_result(pool) -> None:
    s = sample(DESIGN_EXAMPLE, "f(2, 4)", expected="48")
    [a] = pool.trace([s])
    b = trace_in_fresh_interpreter(s, TRACE, SANDBOX)
    assert (a.status, a.frames, a.return_repr, a.match) == (b.status, b.frames, b.return_repr, b.match)


def test_isolation_is_reported(pool) -> None:
    line = pool.isolation
    assert line and "\n" not in line and "rlimits" in line
    if os.geteuid() == 0 and "namespaces" in candidate_modes("auto"):
        assert pool.mode == "namespaces"
        assert "unprivileged uid" in line and "namespaces" in line and "read-only /" in line
    r = one(pool, "import os\ndef f():\n    st = open('/proc/self/status').read()\n"
                  "    return os.getuid(), [l.split()[1] for l in st.splitlines() if l.startswith('CapEff')]\n", "f()")
    uid, caps = eval(r.return_repr)
    assert caps == ["0000000000000000"]
    assert uid != 0 if os.geteuid() == 0 else uid in (0, os.geteuid())  # (0: inside a user namespace)


@pytest.mark.parametrize("mode", ["userns", "process"])
def test_other_modes_trace_and_say_what_they_isolate(mode: str) -> None:
    if mode not in candidate_modes("auto") and mode == "userns" and os.geteuid() != 0:
        mode = "process"  # this machine allows no user namespaces: test the fallback instead
    with TracerPool(TRACE, SANDBOX, workers=1, mode=mode) as p:
        [r] = p.trace([sample(DESIGN_EXAMPLE, "f(1, 3)", expected="6")])
        line = p.isolation
    assert (r.status, r.match) == ("ok", True)
    if mode == "userns":
        assert "user namespace" in line and "$HOME hidden" in line
    else:
        assert "NO namespaces" in line or "NOT isolated" in line


def test_stream_from_another_process_or_garbage_is_not_trusted() -> None:
    good = '["c",0,1,"a","1"],["r",0,1,"1"]'
    batch = lambda pid, text: f"B{pid},{len(text)};{text}".encode()
    events, end, match, problem = parse_stream(batch(7, good) + batch(7, '["E","ok",""],["M","1"]'), 7)
    assert (problem, end, match, len(events)) == ("", {"status": "ok", "reason": ""}, "1", 2)
    assert parse_stream(batch(7, good) + batch(8, good), 7)[3] == "another process wrote to the trace stream"
    assert parse_stream(batch(7, good) + b"garbage", 7)[3].startswith("bad batch header")
    assert parse_stream(batch(7, '["c",0,1,"a"]'), 7)[3] == "bad 'c' record"
    assert parse_stream(batch(7, '["E","ok",""],["l",0,1]'), 7)[3] == "records after the end record"
    assert parse_stream(batch(7, good)[:-3], 7)[3] == "the stream ends inside a batch"
    frames, special = build_frames(events, ["def f(a):"], diff=True)
    assert frames == [["call", "def f(a):\n", json.dumps({"a": "1"}), None], ["return", "def f(a):\n", None, '"1"']]
    assert special == ""


def test_a_result_over_max_result_bytes_is_cut_to_fit() -> None:
    sandbox = shipped("extract.sandbox", wall_timeout_s=5.0, max_result_bytes=4096)
    with TracerPool(dataclasses.replace(TRACE, max_frames=5000), sandbox, workers=1) as p:
        [r] = p.trace([sample(DESIGN_EXAMPLE, "f(1, 1000)")])
    assert r.status == "truncated" and "max_result_bytes=4096" in r.reason
    assert 0 < len(r.frames) < 200 and r.return_repr is None
    assert len(render_trace(list(r.frames)).encode()) < 4096


def test_a_dead_worker_is_replaced_and_its_sample_run_again() -> None:
    slow = sample("import time\ndef f():\n    time.sleep(1.5)\n    return 5\n", "f()")
    good = sample(DESIGN_EXAMPLE, "f(1, 3)", expected="6")
    with TracerPool(TRACE, SANDBOX, workers=1) as p:
        die = lambda: os.killpg(p._workers[0].proc.pid, signal.SIGKILL)
        timer = threading.Timer(0.5, die)  # the worker dies while the sample runs
        timer.start()
        rerun, after = p.trace([slow, good])
        timer.join()
        die()  # dies while idle
        [again] = p.trace([good])
        p.attempts = 1  # no second chance: the sample is an error row
        timer = threading.Timer(0.5, die)
        timer.start()
        [died] = p.trace([slow])
        timer.join()
    assert (rerun.status, rerun.return_repr) == ("ok", "5")
    assert (after.status, after.match, again.status, again.match) == ("ok", True, "ok", True)
    assert died.status == "error" and "worker died" in died.reason


def test_stopping_early_leaves_the_pool_in_step(pool) -> None:
    samples = [sample(DESIGN_EXAMPLE, f"f({i}, 2)", sid=f"s{i}") for i in range(6)]
    for r in pool.trace(samples):
        break
    assert [r.sample_id for r in pool.trace(samples)] == [s.sample_id for s in samples]


def test_the_child_imports_the_stdlib_modules_its_program_names() -> None:
    # a fresh interpreter pre-imports nothing: the child must import these before it drops privileges
    prog = ("import fractions, statistics as st\nfrom os import path\nfrom collections import abc\n"
            "def f():\n    return str(fractions.Fraction(1, 3)), st.mean([1, 2]), path.join('a', 'b'), abc.Sized.__name__\n")
    r = trace_in_fresh_interpreter(sample(prog, "f()", expected="('1/3', 1.5, 'a/b', 'Sized')"), TRACE, SANDBOX)
    assert (r.status, r.match) == ("ok", True)


def test_every_codec_and_a_dynamically_named_module_behave_as_natively(pool) -> None:
    """The child cannot read the interpreter's files once it has dropped its rights: what the stdlib
    imports lazily (codecs on first use, `__import__('name')`) must already be there."""
    import codecs
    import encodings.aliases
    names = sorted(set(encodings.aliases.aliases.values()))
    program = ("import codecs\n\ndef f(names):\n    missing = []\n    for n in names:\n        try:\n"
               "            codecs.lookup(n)\n        except LookupError:\n            missing.append(n)\n"
               "    return missing, __import__('lzma').__name__\n")
    native_missing = []
    for n in names:
        try:
            codecs.lookup(n)
        except LookupError:
            native_missing.append(n)
    r = one(pool, program, f"f({names!r})")
    assert r.status == "ok" and r.return_repr == repr((native_missing, "lzma"))
