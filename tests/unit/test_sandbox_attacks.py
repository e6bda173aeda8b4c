"""Hostile programs, all in one `trace()` call mixed with good samples: each attack ends as a status
row, nothing reaches the host, and every good sample around it is traced correctly."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from codi.sources.base import Sample
from codi.tracing.format import REPR_CUT, render_trace
from codi.tracing.sandbox import TracerPool
from tests.tiny import shipped

SECRET = "s3cr3t-6b1f0e-do-not-leak"
SANDBOX = shipped("extract.sandbox", wall_timeout_s=1.5, cpu_time_s=1, memory_mb=256, max_processes=8,
                        max_output_bytes=4096)
# Enough frames for a RecursionError (about 2 per level); a traced endless loop ends at max_frames.
TRACE = shipped("extract.trace", max_frames=5000)
GOOD = ("def f(a, b):\n    y = a\n    for i in range(b):\n        y += len([y]) * i\n    return y\n", "f(1, 3)", "4")


def attacks(victim: Path, secret: Path, port: int) -> dict[str, tuple[str, str, str]]:
    """name -> (program, call, setup)."""
    return {
        "py_loop": ("def f():\n    while True:\n        pass\n", "f()", ""),
        "setup_loop": ("def f():\n    return 1\n", "f()", "while True:\n    pass\n"),
        "c_loop": ("import itertools\ndef f():\n    return sum(itertools.count())\n", "f()", ""),
        "re_backtrack": ("import re\ndef f():\n    return re.match(r'(a+)+$', 'a' * 64 + 'b')\n", "f()", ""),
        "sleep": ("import time\ndef f():\n    time.sleep(1000)\n", "f()", ""),
        # (untouched zero pages: RLIMIT_AS stops it; the fork_memory_bomb touches what it takes)
        "memory_bomb": ("def f():\n    x = []\n    while True:\n        x.append(bytes(10 ** 8))\n", "f()", ""),
        "fork_memory_bomb": ("import os, time\ndef f():\n    for _ in range(5):\n        if os.fork() == 0:\n"
                             "            break\n    x = bytearray(80 * 2 ** 20)\n    for i in range(0, len(x), 4096):\n"
                             "        x[i] = 1\n    time.sleep(100)\n", "f()", ""),
        "fork_bomb": ("import os, time\ndef f():\n    for _ in range(100):\n        try:\n            os.fork()\n"
                      "        except OSError:\n            break\n    time.sleep(100)\n", "f()", ""),
        "write_file": (f"def f():\n    open({str(victim)!r}, 'w').write('pwned')\n", "f()", ""),
        "truncate_file": (f"import os\ndef f():\n    os.truncate({str(victim)!r}, 0)\n", "f()", ""),
        "delete_file": (f"import os\ndef f():\n    os.remove({str(victim)!r})\n", "f()", ""),
        "read_secret": (f"def f():\n    data = open({str(secret)!r}).read()\n    return data\n", "f()", ""),
        "socket": (f"import socket\ndef f():\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
                   "    s.sendall(b'hello')\n    return 1\n", "f()", ""),
        "os_exit": ("import os\ndef f():\n    x = 1\n    os._exit(0)\n", "f()", ""),
        "settrace_none": ("import sys\ndef f():\n    sys.settrace(None)\n    x = 1\n    return x\n", "f()", ""),
        "clear_f_trace": ("import sys\ndef f():\n    sys._getframe().f_trace = None\n    x = 1\n    return x\n", "f()", ""),
        "big_local": ("def f():\n    x = 'a' * 10 ** 7\n    return len(x)\n", "f()", ""),
        "deep_list": ("def f(x):\n    y = x\n    return 1\n", "f(DEEP)",
                      "DEEP = []\nfor _ in range(200000):\n    DEEP = [DEEP]\n"),
        "repr_raises": ("class B:\n    calls = 0\n    def __repr__(self):\n        B.calls += 1\n"
                        "        raise ValueError('no')\n\ndef f():\n    b = B()\n    return B.calls * 0 + 7\n", "f()", ""),
        "repr_hangs": ("class B:\n    def __repr__(self):\n        while True:\n            pass\n\n"
                       "def f():\n    b = B()\n    return 1\n", "f()", ""),
        "recursion": ("def f(n=0):\n    return f(n + 1)\n", "f()", ""),
        "thread": ("import threading\ndef f():\n    t = threading.Thread(target=print, args=('x',))\n"
                   "    t.start()\n    t.join()\n    return 1\n", "f()", ""),
        "stdout_flood": ("import sys\ndef f():\n    sys.stdout.write('x' * 10 ** 8)\n    return 1\n", "f()", ""),
        "rebind_len": ("import builtins\ndef f():\n    builtins.len = lambda x: 42\n    return len([1])\n", "f()", ""),
        "segfault": ("import ctypes\ndef f():\n    return ctypes.string_at(0)\n", "f()", ""),
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Trace every attack between good samples in one call; return {sample_id: result} and the host state."""
    # As root, outside /tmp, so that hiding /tmp is not what protects the files (the dropped uid
    # is); as a user, under /tmp: a user namespace keeps the uid, and hides /tmp and $HOME.
    root = os.geteuid() == 0
    base = Path(tempfile.mkdtemp(dir="/var/tmp" if root and os.access("/var/tmp", os.W_OK) else None))
    try:
        os.chmod(base, 0o755)
        victim = base / "victim.txt"
        victim.write_text("original")
        os.chmod(victim, 0o644)
        secret = base / "secret.txt"
        secret.write_text(SECRET)
        os.chmod(secret, stat.S_IRUSR | stat.S_IWUSR)  # 0600: only its owner (root here) reads it
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        samples = []
        for name, (program, call, setup) in attacks(victim, secret, listener.getsockname()[1]).items():
            samples.append(Sample(name, "attack", name, program, call, setup=setup))
            samples.append(Sample(f"good/{name}", "synthetic", "good", GOOD[0], GOOD[1], expected=GOOD[2]))
        with TracerPool(TRACE, SANDBOX, workers=2) as pool:
            results = {r.sample_id: r for r in pool.trace(samples)}
            uids = set(pool._uids)
            mode, isolation = pool.mode, pool.isolation
        try:
            conn, _ = listener.accept()
            received = conn.recv(100) or b"<connected>"
        except BlockingIOError:
            received = b""
        listener.close()
        leftovers = [p for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) in uids]
        yield {"results": results, "victim": victim.read_text() if victim.exists() else None,
               "received": received, "leftovers": leftovers, "isolation": isolation,
               # what the mode in use promises (codi/tracing/sandbox.py): files need namespaces or
               # a dropped uid, the network needs namespaces
               "files_safe": mode in ("namespaces", "userns") or root,
               "net_safe": mode in ("namespaces", "userns")}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _uid_of(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def check(run, name: str, *statuses: str):
    """The attack's row has one of `statuses`; every good sample is ok and correct."""
    results = run["results"]
    for sid, r in results.items():
        if sid.startswith("good/"):
            assert (r.status, r.return_repr, r.match) == ("ok", "4", True), (sid, r.status, r.reason)
    r = results[name]
    assert r.status in statuses, (r.status, r.reason)
    assert r.status == "ok" or r.reason
    assert SECRET not in repr(r)
    return r


@pytest.mark.parametrize("name", ["setup_loop", "c_loop", "re_backtrack", "sleep", "repr_hangs"])
def test_endless_programs_time_out(run, name: str) -> None:
    r = check(run, name, "timeout")
    assert r.time_s < SANDBOX.wall_timeout_s + 1.0


def test_traced_endless_loop_stops_at_max_frames(run) -> None:
    r = check(run, "py_loop", "truncated")
    assert len(r.frames) == TRACE.max_frames


def test_memory_bomb(run) -> None:
    check(run, "memory_bomb", "memory")


def test_memory_of_all_processes_together_is_bounded(run) -> None:
    # 6 processes x 80 MB: each within RLIMIT_AS, together over the sample's 256 MB
    if "memory cgroup" in run["isolation"]:
        check(run, "fork_memory_bomb", "memory")
    else:  # without a cgroup only each process is bounded: it ends at the wall clock
        check(run, "fork_memory_bomb", "timeout", "incomplete")


def test_fork_bomb_is_bounded_and_leaves_nothing(run) -> None:
    check(run, "fork_bomb", "timeout", "incomplete")
    assert run["leftovers"] == []


@pytest.mark.parametrize("name", ["write_file", "truncate_file", "delete_file"])
def test_files_outside_the_temp_dir_are_untouched(run, name: str) -> None:
    if not run["files_safe"]:  # this machine allows no isolation: the line must say so
        assert "NOT isolated" in run["isolation"]
        return
    check(run, name, "raised")
    assert run["victim"] == "original"


def test_secret_file_never_appears_in_the_result(run) -> None:
    if not run["files_safe"]:
        assert "NOT isolated" in run["isolation"]
        return
    r = check(run, "read_secret", "raised")
    assert not any(SECRET in (f.locals or "") + (f.value or "") for f in r.frames)


def test_socket_to_localhost_reaches_nobody(run) -> None:
    if not run["net_safe"]:
        assert "NO namespaces" in run["isolation"] or "NOT isolated" in run["isolation"]
        return
    check(run, "socket", "raised")
    assert run["received"] == b""


@pytest.mark.parametrize("name", ["os_exit", "settrace_none", "clear_f_trace", "recursion", "thread"])
def test_tampering_with_the_tracer_is_flagged(run, name: str) -> None:
    check(run, name, "incomplete")


def test_big_and_deep_locals_are_cut(run) -> None:
    for name in ("big_local", "deep_list"):
        r = check(run, name, "ok")
        assert r.time_s < 1.0
        shown = [v for f in r.frames if f.locals for v in f.locals_dict().values() if v != ".."]
        assert any(v.endswith(REPR_CUT) for v in shown)
        assert max(map(len, shown)) <= TRACE.max_repr_chars


def test_raising_repr_is_a_marker_and_does_not_change_the_program(run) -> None:
    r = check(run, "repr_raises", "ok")
    assert r.return_repr == "7" and "<repr error: ValueError>" in render_trace(list(r.frames))


def test_stdout_flood_is_capped(run) -> None:
    r = check(run, "stdout_flood", "ok")
    assert len(r.output) == SANDBOX.max_output_bytes and r.return_repr == "1"


def test_rebinding_builtins_does_not_poison_the_next_sample(run) -> None:
    r = check(run, "rebind_len", "ok")
    assert r.return_repr == "42"
    # the same worker's next samples: one worker, the poisoner first
    with TracerPool(TRACE, SANDBOX, workers=1) as pool:
        bad = Sample("bad", "attack", "bad", "import builtins\ndef f():\n    builtins.len = lambda x: 42\n    return 0\n", "f()")
        good = Sample("good", "synthetic", "good", GOOD[0], GOOD[1], expected=GOOD[2])
        results = list(pool.trace([bad, good, good]))
    assert [(r.status, r.return_repr) for r in results] == [("ok", "0"), ("ok", "4"), ("ok", "4")]


def test_segfault_is_killed(run) -> None:
    r = check(run, "segfault", "killed")
    assert "SIGSEGV" in r.reason
