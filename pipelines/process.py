"""Run a command in a process group of its own, stream its output line by line, and leave no process of
that group behind, whatever happens to the caller. Standard library only: this file is also the guard
script (`python -I process.py --guard PARENT_PID GRACE_S -- CMD...`).

    from pipelines.process import run_streaming
    result = run_streaming(["python", "-c", "print(1)"], cwd=".", on_line=print, timeout_s=60)
    result.returncode, result.tail                   # negative returncode: killed by that signal

The command runs under the guard, which is started in a new session, so the guard, the command and
everything it spawns share one process group:
- on every exit path of `run_streaming` (normal end, a timeout, KeyboardInterrupt, Prefect's SIGTERM bridge
  on cancellation, any exception from the line callback) the whole group gets SIGTERM, then SIGKILL after a
  grace period; killing only the direct child (e.g. `dvc`) would leave the command it runs (the stage) alive;
- if the caller dies without running any Python (SIGKILL, OOM), the guard gets SIGTERM through
  PR_SET_PDEATHSIG (Linux) and kills the group itself.
A process that leaves the group on purpose (its own `setsid`) escapes both; stage commands do not do that.
POSIX only (process groups, killpg).
"""

from __future__ import annotations

import dataclasses
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from codi.infra.linux import set_parent_death_signal

TAIL_LINES = 40                 # kept for classification; the last few go into the error message
MESSAGE_LINES = 6
GRACE_S = 5.0                   # SIGTERM -> SIGKILL; Prefect's runner waits longer before its own SIGKILL
PROGRESS_INTERVAL_S = 5.0       # a progress bar redrawn with "\r" is logged at most this often
MAX_LINE_BYTES = 64 * 1024      # output without a newline is logged in pieces of this size

LineCallback = Callable[[str], None]


class ProcessTimeout(TimeoutError):
    """A command ran past its time limit; its process group was killed."""

    def __init__(self, what: str, timeout_s: float, tail: Sequence[str] = ()) -> None:
        super().__init__(what, timeout_s, tuple(tail))
        self.what, self.timeout_s, self.tail = what, timeout_s, tuple(tail)

    def __str__(self) -> str:
        return f"{self.what} timed out after {self.timeout_s:g} s and was killed{last_lines(self.tail)}"


def last_lines(tail: Sequence[str]) -> str:
    """' (last lines: a | b | c)' for an error message; "" if there are none."""
    shown = [line for line in tail if line.strip()][-MESSAGE_LINES:]
    return (" (last lines: " + " | ".join(s.strip() for s in shown) + ")") if shown else ""


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How a command ended: its exit code (negative: killed by that signal), its last lines, its duration."""

    returncode: int
    tail: tuple[str, ...]
    seconds: float


class LineSplitter:
    """Bytes in, log lines out: splits on "\\n", "\\r\\n" and bare "\\r"; a segment ended by a bare "\\r" is a
    progress-bar redraw and is kept only if PROGRESS_INTERVAL_S passed since the last one kept (tqdm's
    final state ends in "\\n" and is always kept). Lines are decoded as UTF-8 with replacement."""

    def __init__(self, progress_interval_s: float = PROGRESS_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self._buf = b""
        self._interval = progress_interval_s
        self._clock = clock
        self._last_progress = -float("inf")

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        out: list[str] = []
        while True:
            m = re.search(rb"\r\n|\n|\r", self._buf)
            if m is None or (m.group() == b"\r" and m.end() == len(self._buf)):
                break   # no end yet, or a "\r" that may be the first half of "\r\n"
            seg, self._buf = self._buf[:m.start()], self._buf[m.end():]
            if m.group() == b"\r":
                now = self._clock()
                if now - self._last_progress < self._interval or not seg.strip():
                    continue
                self._last_progress = now
            out.append(seg.decode("utf-8", "replace"))
        while len(self._buf) > MAX_LINE_BYTES:
            out.append(self._buf[:MAX_LINE_BYTES].decode("utf-8", "replace"))
            self._buf = self._buf[MAX_LINE_BYTES:]
        return out

    def flush(self) -> list[str]:
        rest, self._buf = self._buf.rstrip(b"\r"), b""
        return [rest.decode("utf-8", "replace")] if rest else []


def run_streaming(cmd: Sequence[str], cwd: str | Path, on_line: LineCallback, timeout_s: float | None = None,
                  env: Mapping[str, str] | None = None, grace_s: float = GRACE_S, what: str | None = None) -> RunResult:
    """Run `cmd` in its own process group under the guard, calling `on_line` with every output line (stdout and
    stderr merged, in order) as it comes. Returns how it ended; raises ProcessTimeout past `timeout_s`.
    Whatever happens, no process of the group outlives this call."""
    start = time.monotonic()
    guard = [sys.executable, "-I", str(Path(__file__).resolve()), "--guard", str(os.getpid()), str(grace_s), "--", *cmd]
    proc = subprocess.Popen(guard, cwd=str(cwd), env=dict(env) if env is not None else None,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    splitter = LineSplitter()

    def emit(lines: Iterable[str]) -> None:
        for line in lines:
            line = line.rstrip()
            if not line:    # blank lines (DVC spaces its hints with them) carry nothing for a log
                continue
            tail.append(line)
            on_line(line)

    try:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            swept_at: float | None = None
            while True:
                now = time.monotonic()
                if timeout_s is not None and now - start > timeout_s:
                    raise ProcessTimeout(what or " ".join(cmd), timeout_s, tuple(tail))
                wait = 0.5 if timeout_s is None else max(0.0, min(0.5, start + timeout_s - now))
                if sel.select(wait):
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break
                    emit(splitter.feed(chunk))
                elif proc.poll() is not None:
                    # The guard is gone but the pipe is still open: a straggler of the stage holds it. Kill the
                    # group (stragglers included); one outside the group gets 2 s, then we stop reading.
                    if swept_at is None:
                        _signal_group(proc.pid, signal.SIGKILL)
                        swept_at = now
                    elif now - swept_at > 2.0:
                        break
        emit(splitter.flush())
        return RunResult(proc.wait(), tuple(tail), time.monotonic() - start)
    finally:
        _stop_group(proc, grace_s)
        if proc.stdout is not None:
            proc.stdout.close()


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False if it no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:     # a member changed uid; the rest of the group still got the signal
        return True
    return True


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the group of a still-running guard, SIGKILL it after `grace_s`, and always sweep the group
    (a stage's background child must not survive the stage)."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:   # pragma: no cover - SIGKILL was sent; the kernel owes us the exit
        pass



# ------------------------------------------------------------------------------------ the guard
def _guard(parent_pid: int, grace_s: float, cmd: list[str]) -> int:
    """Session leader between the caller and the command: runs `cmd` in its own process group and, when the
    caller dies or it is told to stop (SIGTERM/SIGINT/SIGHUP), takes the whole group down."""
    child: subprocess.Popen[bytes] | None = None

    def stop(signum: int, frame: Any) -> None:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        # Raw waitpid: the interrupted child.wait() below holds Popen's wait lock.
        deadline = time.monotonic() + grace_s
        while child is not None and time.monotonic() < deadline:
            try:
                if os.waitpid(child.pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            time.sleep(0.05)
        os.killpg(0, signal.SIGKILL)    # the stage command, anything it spawned, and this guard

    # Handlers first: a stop request between the fork and the handlers would otherwise orphan the child.
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, stop)
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:     # the caller died before prctl took effect
        return 1
    try:
        child = subprocess.Popen(cmd)
    except OSError as e:
        print(f"cannot run {cmd[0]}: {e}", file=sys.stderr, flush=True)
        return 127
    rc = child.wait()
    if rc < 0:      # pass a death by signal on as one, so the caller sees the same exit status
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
        return 128 - rc     # a signal whose default action is not to terminate
    return rc


if __name__ == "__main__" and len(sys.argv) > 4 and sys.argv[1] == "--guard" and sys.argv[4] == "--":
    sys.exit(_guard(int(sys.argv[2]), float(sys.argv[3]), sys.argv[5:]))

