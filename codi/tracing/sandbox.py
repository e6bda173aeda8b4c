"""Trace untrusted programs in a sandbox: a pool of persistent workers that fork per sample.

    from codi.tracing.sandbox import TracerPool
    with TracerPool(params.extract.trace, params.extract.sandbox, workers=0) as pool:
        print(pool.isolation)                      # one line: the isolation actually in use
        for result in pool.trace(samples):         # input order, run in parallel
            text = render_trace(list(result.frames))

Isolation: `namespaces` (root), `userns` (unprivileged user namespaces) or `process`, the first that works;
STATUSES says what each result status means. Modes, limits, faults: docs/design/sandbox.md, "The sandbox".
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Literal

import codi
from codi.schemas.extract import SandboxConfig, TraceConfig
from codi.sources.base import Sample
from codi.tracing import limits
from codi.tracing.format import Frame
from codi.tracing.tokens import contains_special
from codi.tracing.worker import write_msg

STATUSES: dict[str, str] = {
    "ok": "traced to the end; the entry returned (its return frame is the last)",
    "raised": "traced to the end; the entry raised (the trace ends in its exception and return frames)",
    "timeout": "wall-clock or CPU time limit reached; the sample was killed",
    "memory": "MemoryError under the memory limit",
    "killed": "the process died of a signal (segfault, abort, file size limit ...)",
    "error": "the sample cannot be run: bad call, missing entry, the program or setup raised, sandbox failure",
    "syntax_error": "the program or setup does not compile",
    "truncated": "more than max_frames frames (or max_result_bytes of trace); the frames so far are kept",
    "incomplete": "the trace may be missing events (tracer removed, f_trace cleared, os._exit, thread, "
                  "process, RecursionError, an untrustworthy stream); never use it as a clean trace",
    "unrepresentable": "the program, call or a repr spells a special token literally",
}
Mode = Literal["auto", "namespaces", "userns", "process"]
_MODES = ("auto", "namespaces", "userns", "process")
_NS_FLAGS = ["--pid", "--net", "--ipc", "--uts", "--mount", "--fork", "--kill-child"]
_UID_LO, _UID_SPAN = 60001, 4000  # per-worker uids, from the "globally allocated" range below 65000
_START_TIMEOUT_S = 60.0
_uid_blocks = itertools.count()  # pools (and fresh interpreters) of one process get distinct uids
_cgroup_ids = itertools.count()
_CGROUP_SLACK_MB = 64  # pages a forked child copies from the worker count against its cgroup too


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (no worker starts): the stage must stop, not trace unsafely."""


@dataclass(frozen=True)
class TraceResult:
    """The outcome of one sample; `frames` are partial for failures."""

    sample_id: str
    status: str
    reason: str                 # "" when ok
    frames: tuple[Frame, ...]
    return_repr: str | None     # the entry exit frame's value_repr() when ok
    match: bool | None          # return value == eval(expected) in the sandbox; None if not decidable
    time_s: float               # wall time of the sample (fork to classification)
    output: str                 # captured stdout+stderr, capped at max_output_bytes


# --------------------------------------------------------------------------------- isolation
@functools.lru_cache(maxsize=None)
def _probe(args: tuple[str, ...]) -> bool:
    try:
        return subprocess.run([*args, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _prefix(mode: str) -> list[str]:
    if mode == "namespaces":
        return ["unshare", *_NS_FLAGS, "--"]
    if mode == "userns":
        return ["unshare", "--user", "--map-root-user", *_NS_FLAGS, "--"]
    return []


def candidate_modes(mode: Mode) -> list[str]:
    """The modes to try, best first."""
    if mode != "auto":
        return [mode]
    out = []
    if shutil.which("unshare"):
        if os.geteuid() == 0 and _probe(tuple(_prefix("namespaces")[:-1])):
            out.append("namespaces")
        if os.geteuid() != 0 and _probe(tuple(_prefix("userns")[:-1])):
            out.append("userns")
    return out + ["process"]


def describe(mode: str, uids: tuple[int, int] | None, sandbox: SandboxConfig, cgroup: bool = False) -> str:
    """One line: the isolation in use (printed by the extract stage)."""
    lim = (f"rlimits (CPU {sandbox.cpu_time_s} s, +{sandbox.memory_mb} MB address space, files "
           f"{sandbox.max_file_mb} MB, {sandbox.max_processes} processes, no core), "
           + (f"memory cgroup ({sandbox.memory_mb} MB for all of a sample's processes), " if cgroup else "")
           + f"wall timeout {sandbox.wall_timeout_s:g} s, private temp cwd")
    who = (f"unprivileged uid {uids[0]}-{uids[1]} (one per worker), no capabilities, no_new_privs"
           if uids else "")
    if mode == "namespaces":
        return (f"{who}; PID+net+IPC+UTS+mount namespaces (read-only /, private /tmp and /dev/shm, "
                f"own /proc, leftovers killed); {lim}")
    if mode == "userns":
        return ("unprivileged user namespace, no capabilities, no_new_privs; PID+net+IPC+UTS+mount "
                "namespaces (read-only /, private /tmp and /dev/shm, $HOME hidden, own /proc, leftovers "
                f"killed); runs as your uid, so files outside $HOME readable by you are readable; {lim}")
    if uids:
        return (f"{who}; NO namespaces (the network and world-readable files are reachable); own "
                f"session, leftovers killed by uid; {lim}")
    return (f"NOT isolated from the host: runs as your uid with your files and network (no namespaces "
            f"available); own session, descendants killed; {lim}")


def _uids(n: int) -> list[int]:
    """n consecutive uids of the per-worker range, different for each process and each call."""
    start = (os.getpid() * 61 + next(_uid_blocks) * 16) % _UID_SPAN
    return [_UID_LO + (start + i) % _UID_SPAN for i in range(n)]


# ----------------------------------------------------------------------------------- workers
class _Worker:
    """One worker process and the parent's end of its protocol."""

    def __init__(self, mode: str, uid: int | None, trace: TraceConfig, sandbox: SandboxConfig,
                 once: bool = False) -> None:
        self.mode, self.uid, self.once = mode, uid, once
        self.trace, self.sandbox = trace, sandbox
        self.stderr = tempfile.TemporaryFile()
        # Without a private /tmp, the samples' temp dirs live in one we make and always remove.
        self.tmp_base = tempfile.mkdtemp(prefix="codi-sandbox-") if mode == "process" else ""
        if self.tmp_base:
            os.chmod(self.tmp_base, 0o711)  # a sample's uid may enter its own 0700 dir inside
        # As root: one memory cgroup per worker bounds all of a sample's processes together.
        self.cgroup = limits.memory_cgroup(f"codi-sandbox-{os.getpid()}-{next(_cgroup_ids)}",
                                           (sandbox.memory_mb + _CGROUP_SLACK_MB) << 20) if uid is not None else None
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
            "PYTHONHASHSEED": "0",  # set order, str hashes: the same trace on every run
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUTF8": "1",
            "PYTHONPATH": str(Path(codi.__file__).resolve().parents[1]),
        }
        # -S: no site-packages. The worker needs only the stdlib and codi (PYTHONPATH), and programs
        # get the same modules in every mode (a dropped uid could not import from the venv anyway).
        cmd = [*_prefix(mode), sys.executable, "-S", "-m", "codi.tracing.worker", *(["--once"] if once else [])]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     env=env, cwd="/", start_new_session=True)
        self.rfd = self.proc.stdout.fileno()
        self.wfd = self.proc.stdin.fileno()
        self.buf = bytearray()
        try:
            write_msg(self.wfd, {"op": "init", "mode": mode, "uid": uid, "trace": asdict(trace),
                                 "sandbox": asdict(sandbox), "tmp_base": self.tmp_base, "cgroup": self.cgroup})
        except BrokenPipeError:
            pass  # it died at once: handshake() reports why

    def handshake(self) -> dict:
        msg = self.receive(_START_TIMEOUT_S)
        if msg is None or msg.get("op") != "ready":
            why = msg.get("error") if msg else f"exited ({self.proc.poll()}): {self.stderr_tail()}"
            self.kill()
            raise SandboxError(f"sandbox worker ({self.mode}) did not start: {why}")
        return msg

    def send(self, msg: dict) -> None:
        write_msg(self.wfd, msg)

    def receive(self, timeout: float | None) -> dict | None:
        """The next message, waiting up to `timeout` seconds; None on EOF or timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self.pop()
            if msg is not None:
                return msg
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if not select.select([self.rfd], [], [], left)[0]:
                return None
            if not self.feed():
                return None

    def feed(self) -> bool:
        """Read what the worker sent; False at EOF."""
        data = os.read(self.rfd, 1 << 20)
        self.buf += data
        return bool(data)

    def pop(self) -> dict | None:
        """A complete message from the buffer, if there is one."""
        if len(self.buf) < 8:
            return None
        n = int(self.buf[:8], 16)
        if len(self.buf) < 8 + n:
            return None
        msg = json.loads(bytes(self.buf[8:8 + n]).decode("utf-8", "surrogatepass"))
        del self.buf[:8 + n]
        return msg

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-2000:].decode("utf-8", "replace").strip()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # unshare and the worker (its namespace dies with it)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.close_files()

    def close(self) -> None:
        """EOF on stdin ends the worker; kill it if it does not end promptly."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self.close_files()

    def close_files(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                f.close()
            except OSError:
                pass
        if self.tmp_base:
            shutil.rmtree(self.tmp_base, ignore_errors=True)
        if self.cgroup:
            limits.remove_cgroup(self.cgroup)
            self.cgroup = None


def _result(sample_id: str, msg: dict) -> TraceResult:
    frames = tuple(Frame(kind, line, locals=loc, value=val) for kind, line, loc, val in msg["frames"])
    return TraceResult(sample_id, msg["status"], msg["reason"], frames, msg["return_repr"], msg["match"],
                       float(msg["time_s"]), msg["output"])


def _failed(sample_id: str, status: str, reason: str) -> TraceResult:
    return TraceResult(sample_id, status, reason, (), None, None, 0.0, "")


def _precheck(sample: Sample) -> TraceResult | None:
    """Samples whose text alone decides the result (no worker needed)."""
    for what, text in (("program", sample.program), ("call", sample.call), ("setup", sample.setup),
                       ("expected", sample.expected or "")):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate (a JSON "\ud800"): no valid text holds it
            return _failed(sample.sample_id, "error", f"the {what} is not valid Unicode: {e.reason} at {e.start}")
    for what, text in (("program", sample.program), ("call", sample.call)):
        token = contains_special(text)
        if token:
            return _failed(sample.sample_id, "unrepresentable", f"the {what} contains the special token {token}")
    return None


def _run_msg(idx: int, sample: Sample) -> dict:
    return {"op": "run", "id": idx, "program": sample.program, "setup": sample.setup,
            "call": sample.call, "expected": sample.expected}


class TracerPool:
    """A pool of sandboxed tracing workers; a context manager. One `trace()` at a time, one thread."""

    def __init__(self, trace: TraceConfig, sandbox: SandboxConfig, workers: int = 0, *,
                 mode: Mode = "auto") -> None:
        if workers < 0:
            raise ValueError(f"workers = {workers}: expected >= 0 (0 = one per CPU core)")
        if mode not in _MODES:
            raise ValueError(f"mode = {mode!r}: expected one of {', '.join(_MODES)}")
        self.trace_cfg, self.sandbox_cfg = trace, sandbox
        self.n_workers = workers or os.cpu_count() or 1
        self.requested_mode = mode
        self.mode = ""
        self._isolation = ""
        self._workers: list[_Worker] = []
        self._uids = _uids(self.n_workers)
        # A sample whose worker dies is run again on a fresh one this many times in all (a dying
        # worker is our fault, not the sample's; a sample that kills workers ends as `error`).
        self.attempts = 2

    # -- lifecycle
    def __enter__(self) -> TracerPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def isolation(self) -> str:
        """One line describing the isolation in use (starts the workers if needed)."""
        self.start()
        return self._isolation

    def start(self) -> None:
        if self._workers:
            return
        errors = []
        for mode in candidate_modes(self.requested_mode):
            try:
                self._workers = self._spawn_all(mode)
            except SandboxError as e:
                errors.append(str(e))
                continue
            self.mode = mode
            if errors:  # a weaker mode than this machine should give: say so loudly, once
                warnings.warn(f"sandbox: using mode {mode!r} ({' | '.join(errors)})", RuntimeWarning, stacklevel=2)
            uids = self._uid_for(mode, 0) is not None
            self._isolation = describe(mode, (self._uids[0], self._uids[-1]) if uids else None,
                                       self.sandbox_cfg, all(w.cgroup for w in self._workers))
            return
        raise SandboxError("no sandbox mode works: " + " | ".join(errors))

    def _uid_for(self, mode: str, i: int) -> int | None:
        return self._uids[i] if os.geteuid() == 0 and mode in ("namespaces", "process") else None

    def _spawn(self, mode: str, i: int) -> _Worker:
        return _Worker(mode, self._uid_for(mode, i), self.trace_cfg, self.sandbox_cfg)

    def _spawn_all(self, mode: str) -> list[_Worker]:
        workers = [self._spawn(mode, i) for i in range(self.n_workers)]
        try:
            for w in workers:
                w.handshake()
        except SandboxError:
            for w in workers:
                w.kill()
            raise
        return workers

    def close(self) -> None:
        for w in self._workers:
            w.close()
        self._workers = []

    # -- tracing
    def trace(self, samples: Iterable[Sample]) -> Iterator[TraceResult]:
        """Trace every sample; results come in input order while the workers run in parallel."""
        self.start()
        source = iter(enumerate(samples))
        idle = list(range(len(self._workers)))
        inflight: dict[int, tuple[int, Sample, float, int]] = {}  # worker -> (index, sample, sent, attempt)
        ready: dict[int, TraceResult] = {}
        next_out, exhausted = 0, False
        ahead = 256 + 64 * len(self._workers)  # results held for in-order output, at most
        grace = 2 * self.sandbox_cfg.wall_timeout_s + 20
        try:
            while True:
                while idle and not exhausted and len(ready) + len(inflight) < ahead:
                    try:
                        idx, sample = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    pre = _precheck(sample)
                    if pre is not None:
                        ready[idx] = pre
                        continue
                    self._dispatch(idle.pop(), idx, sample, 1, inflight)
                while next_out in ready:
                    yield ready.pop(next_out)
                    next_out += 1
                if exhausted and not inflight:
                    return
                if not inflight:
                    continue
                self._collect(inflight, idle, ready, grace)
        finally:
            # A consumer that stops early: let the samples in flight finish, so workers stay in step.
            while inflight:
                self._collect(inflight, idle, {}, grace)

    def _dispatch(self, wi: int, idx: int, sample: Sample, attempt: int, inflight: dict) -> None:
        try:
            self._workers[wi].send(_run_msg(idx, sample))
        except OSError:  # it died while idle: a fresh one takes the sample
            self._replace(wi)
            self._workers[wi].send(_run_msg(idx, sample))
        inflight[wi] = (idx, sample, time.monotonic(), attempt)

    def _collect(self, inflight: dict, idle: list[int], ready: dict, grace: float) -> None:
        """Wait for at least one in-flight result (or a dead/hung worker) and file it."""
        fds = {self._workers[wi].rfd: wi for wi in inflight}
        oldest = min(sent for _, _, sent, _ in inflight.values())
        timeout = max(0.0, oldest + grace - time.monotonic())
        readable = select.select(list(fds), [], [], timeout)[0]
        for fd in readable:
            wi = fds[fd]
            worker = self._workers[wi]
            alive = worker.feed()
            msg = worker.pop()
            if msg is None and alive:
                continue  # part of a message: wait for the rest
            idx, sample, _, attempt = inflight.pop(wi)
            if msg is None:
                why = worker.stderr_tail()
                self._replace(wi)
                if attempt < self.attempts:
                    self._dispatch(wi, idx, sample, attempt + 1, inflight)
                    continue
                ready[idx] = _failed(sample.sample_id, "error", f"sandbox worker died ({attempt} times): {why}")
            elif msg.get("id") != idx:  # never expected: the worker is out of step, so replace it
                ready[idx] = _failed(sample.sample_id, "error", f"sandbox worker answered for {msg.get('id')!r}")
                self._replace(wi)
            else:
                ready[idx] = _result(sample.sample_id, msg)
                if msg.get("recycle"):
                    self._replace(wi)
            idle.append(wi)
        now = time.monotonic()
        for wi, (idx, sample, sent, _) in list(inflight.items()):
            if now - sent > grace:
                inflight.pop(wi)
                ready[idx] = _failed(sample.sample_id, "error", f"sandbox worker did not answer in {grace:g} s")
                self._replace(wi)
                idle.append(wi)

    def _replace(self, wi: int) -> None:
        """Recycle a worker after a fault: a fresh one takes its place (and its uid)."""
        self._workers[wi].kill()
        self._workers[wi] = self._spawn(self.mode, wi)
        self._workers[wi].handshake()


def trace_in_fresh_interpreter(sample: Sample, trace: TraceConfig, sandbox: SandboxConfig, *,
                               mode: Mode = "auto") -> TraceResult:
    """Trace one sample in a new interpreter (same isolation and limits; nothing pre-imported
    beyond what the program names). The baseline of benchmarks/bench_sandbox.py."""
    pre = _precheck(sample)
    if pre is not None:
        return pre
    chosen = candidate_modes(mode)[0]
    uid = _uids(1)[0] if os.geteuid() == 0 and chosen in ("namespaces", "process") else None
    worker = _Worker(chosen, uid, trace, sandbox, once=True)
    try:
        worker.handshake()
        worker.send(_run_msg(0, sample))
        msg = worker.receive(2 * sandbox.wall_timeout_s + 20)
    finally:
        worker.close()
    if msg is None:
        return _failed(sample.sample_id, "error", "the sandbox worker died or did not answer")
    return _result(sample.sample_id, msg)
