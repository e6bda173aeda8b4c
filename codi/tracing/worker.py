"""The sandbox worker: a persistent process that forks one isolated child per sample.

    python -m codi.tracing.worker [--once]   # started by codi.tracing.sandbox, never by hand

Protocol on stdin/stdout: 8-digit hex length + UTF-8 JSON messages; `init` -> `ready`, then one `run` per
sample answered by its result; EOF ends the worker, `--once` ends it after one sample. Per sample it forks
a child that sets up its sandbox and runs codi.tracing.tracer.run_sample, reads its pipes under the wall
timeout, kills what the sample left, parses the stream, applies the ".." diff and classifies the run.
Design: docs/design/sandbox.md, "The sandbox".
"""

from __future__ import annotations

import gc
import io
import json
import os
import select
import shutil
import signal
import sys
import time
from types import SimpleNamespace

from codi.infra.linux import set_parent_death_signal
from codi.tracing import limits
from codi.tracing.format import UNCHANGED, encode_locals, encode_value
from codi.tracing.tokens import contains_special
from codi.tracing.tracer import Job

EVENT_FD = 3
CHILD_SETUP_FAILED = 70  # exit status of a child whose sandbox setup raised (EX_SOFTWARE)
READ_CHUNK = 1 << 16


# ------------------------------------------------------------------------------------ protocol
def encode_msg(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


def write_msg(fd: int, obj: dict | bytes) -> None:
    data = obj if isinstance(obj, bytes) else encode_msg(obj)
    view = memoryview(f"{len(data):08x}".encode() + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_msg(fd: int) -> dict | None:
    """The next message, or None at EOF."""
    head = _read_exact(fd, 8)
    if head is None:
        return None
    data = _read_exact(fd, int(head, 16))
    if data is None:
        return None
    return json.loads(data.decode("utf-8", "surrogatepass"))


# ------------------------------------------------------------------------------ event stream
class StreamError(ValueError):
    """An event stream that does not follow the tracer's format."""


def parse_stream(data: bytes, pid: int) -> tuple[list[tuple], dict | None, str | None, str]:
    """Decode the tracer's stream (see codi.tracing.tracer).

    Returns (events, end, match, problem): events are (kind, sid, lineno, payload) with payload a
    list of (name, repr) for c/l and the repr for r/x; `end` the end record's fields, `match` the
    comparison record's text, `problem` "" or why the stream cannot be trusted (the events parsed
    before the problem are kept)."""
    events: list[tuple] = []
    end = match = None
    pos = 0
    try:
        while pos < len(data):
            semi = data.find(b";", pos, pos + 40)
            head = data[pos:semi].decode("ascii", "replace") if semi > 0 else ""
            if not head.startswith("B") or head.count(",") != 1:
                raise StreamError(f"bad batch header at byte {pos}")
            wpid, size = head[1:].split(",")
            if not (wpid.isdigit() and size.isdigit()):
                raise StreamError(f"bad batch header at byte {pos}")
            if int(wpid) != pid:
                raise StreamError("another process wrote to the trace stream")
            body_end = semi + 1 + int(size)
            if body_end > len(data):
                raise StreamError("the stream ends inside a batch")
            try:
                records = json.loads(b"[" + data[semi + 1:body_end] + b"]")
            except (ValueError, RecursionError):
                raise StreamError("a batch is not JSON") from None
            pos = body_end
            end, match = _records(records, events, end, match)
    except StreamError as e:
        return events, end, match, str(e)
    return events, end, match, ""


def _records(records: list, events: list[tuple], end, match):
    for rec in records:
        if not (type(rec) is list and rec and type(rec[0]) is str):
            raise StreamError("a record is not a list")
        kind, n = rec[0], len(rec)
        if end is not None and kind != "M":
            raise StreamError("records after the end record")
        if kind in ("c", "l", "r", "x"):
            if n < 3 or type(rec[1]) is not int or type(rec[2]) is not int:
                raise StreamError(f"bad {kind!r} record")
            rest = rec[3:]
            if not all(type(x) is str for x in rest):
                raise StreamError(f"bad {kind!r} record")
            if kind in ("c", "l"):
                if len(rest) % 2:
                    raise StreamError(f"bad {kind!r} record")
                events.append((kind, rec[1], rec[2], list(zip(rest[::2], rest[1::2]))))
            elif len(rest) == 1:
                events.append((kind, rec[1], rec[2], rest[0]))
            else:
                raise StreamError(f"bad {kind!r} record")
        elif kind == "E" and n == 3 and type(rec[1]) is str and type(rec[2]) is str:
            end = {"status": rec[1], "reason": rec[2]}
        elif kind == "M" and n == 2 and type(rec[1]) is str and end is not None and match is None:
            match = rec[1]
        else:
            raise StreamError(f"unknown record {kind[:10]!r}")
    return end, match


# what the child's end record may say (the rest is the worker's to decide)
CHILD_STATUSES = frozenset({"ok", "raised", "truncated", "incomplete", "error", "syntax_error", "memory"})
KIND_NAMES = {"c": "call", "l": "line", "r": "return", "x": "exception"}


def build_frames(events: list[tuple], lines: list[str], diff: bool, check_special: bool = True
                 ) -> tuple[list[list], str]:
    """Frames as [kind, source_line, locals_json, value_json] (".." applied per scope), and the
    first special token met in a name or repr ("" if none, or not `check_special`)."""
    prev: dict[int, dict[str, str]] = {}
    frames, special = [], ""
    for kind, sid, lineno, payload in events:
        if not 1 <= lineno <= len(lines):
            raise StreamError(f"line {lineno} is not a line of the program")
        source = lines[lineno - 1] + "\n"
        if kind in "cl":
            reps = dict(payload)
            before = prev.get(sid) if kind == "l" and diff else None
            if check_special and not special:
                special = next((t for t in map(contains_special, reps.values()) if t), "")
            shown = reps if before is None else {
                k: (UNCHANGED if before.get(k) == v else v) for k, v in reps.items()}
            prev[sid] = reps
            frames.append([KIND_NAMES[kind], source, encode_locals(shown), None])
        else:
            if kind == "r":  # the scope ends (an exception event does not end it)
                prev.pop(sid, None)
            if check_special and not special:
                special = contains_special(payload) or ""
            frames.append([KIND_NAMES[kind], source, None, encode_value(payload)])
    return frames, special


# ------------------------------------------------------------------------------------ worker
class Worker:
    """State of one worker process: its mode, uid, limits and temp base."""

    def __init__(self, init: dict) -> None:
        self.mode: str = init["mode"]
        self.uid: int | None = init["uid"]
        self.trace: dict = init["trace"]
        self.sandbox = SimpleNamespace(**init["sandbox"])  # a SandboxConfig's fields (no yaml import here)
        self.notes: list[str] = []
        self.recycle = ""
        self.devnull = os.open(os.devnull, os.O_RDWR)
        # samples' temp dirs go here: the private /tmp in a mount namespace, else a directory
        # the parent made (and removes, even if this worker is killed)
        self.tmp_base: str = init.get("tmp_base") or "/tmp"
        self.count = 0
        self.limits: list = []
        self.cgroup: str | None = init.get("cgroup")  # made (and removed) by the parent
        self.oom = False  # the cgroup's OOM killer acted during the last sample

    def setup(self, preload: bool) -> None:
        if preload:
            limits.preload()
        home = os.environ.get("HOME", "")
        # What every sample's environment holds (HOME and TMPDIR are set per sample).
        os.environ.clear()
        os.environ.update({"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"})
        # Nothing the child imports may come from a relative directory (its cwd is the sample's).
        sys.path[:] = [p for p in sys.path if p and os.path.isabs(p)]
        if self.mode in ("namespaces", "userns"):
            hide = (home,) if self.mode == "userns" and home else ()
            tmp_mb = max(64, 4 * self.sandbox.max_file_mb)
            self.notes += limits.private_mounts(tmp_mb, hide)
            if self.mode == "namespaces":
                limits.drop_bounding_set()
        else:
            limits.child_subreaper()
        limits.no_new_privs()
        gc.collect()
        gc.freeze()  # forked children never touch the worker's objects' GC headers (copy-on-write)

    # -- one sample
    def run(self, msg: dict) -> bytes:
        """Trace one sample; the encoded result message, at most max_result_bytes."""
        t0 = time.monotonic()
        job = Job(msg["program"], msg.get("setup", ""), msg["call"], msg.get("expected"),
                  self.trace["max_frames"], self.trace["max_repr_chars"])
        self.count += 1
        tmp = f"{self.tmp_base}/s{self.count}"
        os.mkdir(tmp, 0o700)  # fails if it exists: never a directory the previous sample prepared
        if self.uid is not None:
            os.chown(tmp, self.uid, self.uid)
        ev_r, ev_w = os.pipe()
        out_r, out_w = os.pipe()
        # what the child inherits; RLIMIT_AS adds memory_mb to it
        self.limits = limits.rlimits(self.sandbox, limits.vm_bytes())
        oom_before = limits.oom_kills(self.cgroup) if self.cgroup else 0
        pid = os.fork()
        if pid == 0:
            try:
                os.close(ev_r)
                os.close(out_r)
                self._child(job, ev_w, out_w, tmp)
            finally:
                os._exit(CHILD_SETUP_FAILED)
        os.close(ev_w)
        os.close(out_w)
        try:
            events, output, how = self._watch(pid, ev_r, out_r, t0)
        finally:
            os.close(ev_r)
            os.close(out_r)
        self._cleanup(pid, tmp)
        self.oom = bool(self.cgroup) and limits.oom_kills(self.cgroup) > oom_before
        res = self._classify(job, events, output, how, pid)
        res["id"] = msg["id"]
        if self.recycle:
            res["recycle"] = self.recycle
        res["time_s"] = time.monotonic() - t0
        data = encode_msg(res)
        return data if len(data) <= self.sandbox.max_result_bytes else self._fit(res)

    def _fit(self, res: dict) -> bytes:
        """Cut a result over max_result_bytes to a prefix of its frames (status truncated)."""
        cap = self.sandbox.max_result_bytes
        res["output"] = res["output"].encode()[:cap // 4].decode("utf-8", "ignore")
        res.update(status="truncated", return_repr=None, match=None,
                   reason=f"the result passed max_result_bytes={cap}; the first frames are kept")
        room = cap - len(encode_msg({**res, "frames": []})) - 16
        keep = 0
        for frame in res["frames"]:
            room -= len(encode_msg(frame)) + 2  # (+ ", ")
            if room < 0:
                break
            keep += 1
        res["frames"] = res["frames"][:keep]
        return encode_msg(res)

    def _child(self, job: Job, ev_w: int, out_w: int, tmp: str):
        os.setsid()
        if self.mode == "process":  # (in a PID namespace the kernel ends us with the worker)
            set_parent_death_signal(signal.SIGKILL)
        os.dup2(self.devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        os.dup2(ev_w, EVENT_FD)
        for name in os.listdir("/proc/self/fd"):  # only fds 0-3 stay (cheaper than closerange)
            if int(name) > EVENT_FD:
                try:
                    os.close(int(name))
                except OSError:
                    pass  # the listing's own fd
        os.chdir(tmp)
        os.environ["HOME"] = os.environ["TMPDIR"] = tmp  # (the rest was set once, in setup)
        limits.import_named_modules(job.program, job.setup)
        if "tempfile" in sys.modules:
            sys.modules["tempfile"].tempdir = tmp
        limits.apply_rlimits(self.limits)
        if self.cgroup:
            limits.join_cgroup(self.cgroup)
        if self.uid is not None:
            limits.drop_to_uid(self.uid)
        elif self.mode == "userns":
            limits.drop_capabilities()
        out = io.open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        err = io.open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stdout, sys.stderr = out, err
        sys.stdin = io.open(0, "r", closefd=False)
        sys.argv = ["program"]

        def flush_output() -> None:
            for stream in (out, err):
                try:
                    stream.flush()
                except BaseException:  # noqa: BLE001 - closed by the program, or a full pipe
                    pass

        from codi.tracing.tracer import run_sample
        run_sample(job, EVENT_FD, flush_output)

    def _watch(self, pid: int, ev_r: int, out_r: int, t0: float) -> tuple[bytes, bytes, str]:
        """Read both pipes until the child exits, the wall time is up or the stream is too big.

        Returns (events, output, how) with how in "exited", "timeout", "overflow"."""
        cfg = self.sandbox
        pidfd = os.pidfd_open(pid)
        poll = select.poll()
        for fd in (ev_r, out_r, pidfd):
            poll.register(fd, select.POLLIN)
        ev_parts, out_parts = [], []
        ev_n = out_n = 0
        deadline = t0 + cfg.wall_timeout_s
        how = ""
        try:
            while not how:
                left = deadline - time.monotonic()
                if left <= 0:
                    how = "timeout"
                    break
                for fd, _ in poll.poll(left * 1000):
                    if fd == pidfd:
                        how = "exited"
                        continue
                    data = os.read(fd, READ_CHUNK)
                    if not data:
                        poll.unregister(fd)
                    elif fd == ev_r:
                        ev_parts.append(data)
                        ev_n += len(data)
                        if ev_n > cfg.max_result_bytes:
                            how = "overflow"
                    elif out_n < cfg.max_output_bytes:
                        out_parts.append(data)
                        out_n += len(data)
            if how != "exited":
                self._kill(pid)
            # What the child wrote before it ended is in the pipes; descendants may still hold
            # them open, so read only what is there (and at most a bounded amount).
            room = cfg.max_result_bytes + 1 - ev_n
            ev_n += self._drain(ev_r, ev_parts, keep=room, budget=room)
            self._drain(out_r, out_parts, keep=cfg.max_output_bytes - out_n, budget=1 << 26)
        finally:
            os.close(pidfd)
        output = b"".join(out_parts)[:cfg.max_output_bytes]
        events = b"".join(ev_parts)
        if how != "overflow" and len(events) > cfg.max_result_bytes:
            how = "overflow"
        return events, output, how

    @staticmethod
    def _drain(fd: int, parts: list[bytes], keep: int, budget: int) -> int:
        """Read what is in a pipe now (up to `budget` bytes); keep the first `keep` bytes."""
        os.set_blocking(fd, False)
        got = 0
        while got < budget:
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                break
            if not data:
                break
            if got < keep:
                parts.append(data)
            got += len(data)
        return got

    def _kill(self, pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _cleanup(self, pid: int, tmp: str) -> None:
        """Kill and reap everything the sample left; remove its temp dir."""
        try:
            _, status, rusage = os.wait4(pid, 0)
        except ChildProcessError:
            status, rusage = 0, None
        self.last_status, self.last_rusage = status, rusage
        for _ in range(200):
            if self.mode in ("namespaces", "userns"):
                try:
                    os.kill(-1, signal.SIGKILL)  # PID 1 of the namespace: every other process in it
                except ProcessLookupError:
                    pass
            else:
                if self.uid is not None:
                    limits.kill_uid(self.uid)
                for child in limits.children_of(os.getpid()):
                    try:
                        os.kill(child, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if not self._reap():
                break
            time.sleep(0.001)
        else:
            self.recycle = "the sample left processes that could not be killed"
        try:
            shutil.rmtree(tmp)
        except OSError:
            # e.g. a directory the sample made unreadable (chmod 000): what its owner may undo
            for root, dirs, _ in os.walk(tmp):
                for d in dirs:
                    try:
                        os.chmod(os.path.join(root, d), 0o700, follow_symlinks=False)
                    except OSError:
                        pass
            try:
                shutil.rmtree(tmp)
            except OSError as e:
                self.recycle = f"cannot remove the sample's temp dir: {e}"

    @staticmethod
    def _reap() -> bool:
        """Reap every exited child; True if some child is still alive."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True

    def _classify(self, job: Job, events_bytes: bytes, output: bytes, how: str, pid: int) -> dict:
        cfg = self.sandbox
        events, end, match, problem = parse_stream(events_bytes, pid)
        lines = job.program.split("\n")
        try:
            # every token starts with "<|" (escaped as itself in the ASCII JSON): most streams skip the check
            frames, special = build_frames(events, lines, self.trace["diff_locals"], b"<|" in events_bytes)
        except StreamError as e:
            frames, special, problem = [], "", problem or str(e)
        status, reason = self._status(how, end, problem)
        if special and status in ("ok", "raised", "truncated"):
            status, reason = "unrepresentable", f"a repr in the trace contains the special token {special}"
        ok = status == "ok"
        return {
            "status": status, "reason": reason, "frames": frames,
            "return_repr": json.loads(frames[-1][3]) if ok and frames and frames[-1][3] else None,
            "match": {"1": True, "0": False}.get(match) if ok else None,
            "output": output.decode("utf-8", "replace"),
        }

    def _status(self, how: str, end: dict | None, problem: str) -> tuple[str, str]:
        cfg = self.sandbox
        status, rusage = self.last_status, self.last_rusage
        cpu = (rusage.ru_utime + rusage.ru_stime) if rusage is not None else 0.0
        if how == "overflow":
            return "truncated", f"the trace passed max_result_bytes={cfg.max_result_bytes}"
        if end is not None and not problem:
            if end["status"] not in CHILD_STATUSES:
                return "incomplete", f"the end record has an unknown status {end['status'][:40]!r}"
            return end["status"], end["reason"]
        if self.oom:  # the cgroup killed one of its processes (the child, or one it started)
            # Before the stream's verdict: a sample that forks and then fills memory has its children
            # write to the stream too, and whether one of them writes before the OOM killer acts is a
            # race. The limit is the cause, and checking it first gives the same row on every run.
            also = f"; the event stream is not trustworthy either: {problem}" if problem else ""
            return "memory", f"memory limit ({cfg.memory_mb} MB for the sample's processes together){also}"
        if problem:
            return "incomplete", f"the event stream is not trustworthy: {problem}"
        if how == "timeout":
            return "timeout", f"wall time limit ({cfg.wall_timeout_s:g} s)"
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= cfg.cpu_time_s):
                return "timeout", f"CPU time limit ({cfg.cpu_time_s} s)"
            if sig == signal.SIGXFSZ:
                return "killed", f"file size limit ({cfg.max_file_mb} MB)"
            return "killed", f"killed by signal {signal.Signals(sig).name}"
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
        if code == CHILD_SETUP_FAILED:
            return "error", f"the sandbox could not set up the child (exit {code}; see the output)"
        return "incomplete", f"the process ended (exit status {code}) before the trace did (os._exit?)"


def main(argv: list[str]) -> int:
    once = "--once" in argv
    # The protocol pipes move off fds 0/1; 0/1 point at /dev/null so that nothing else can
    # write into the protocol by accident.
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    init = read_msg(rfd)
    if init is None:
        return 0
    worker = Worker(init)
    try:
        worker.setup(preload=not once)
    except OSError as e:
        write_msg(wfd, {"op": "failed", "error": f"{type(e).__name__}: {e}"})
        return 1
    write_msg(wfd, {"op": "ready", "notes": worker.notes, "pid": os.getpid()})
    while True:
        msg = read_msg(rfd)
        if msg is None:
            break
        write_msg(wfd, worker.run(msg))
        if once or worker.recycle:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
