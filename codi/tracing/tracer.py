"""The CWM-style `sys.settrace` tracer: runs one sample inside the sandboxed child, streams events.

    (in the child, once the sandbox is set up by codi.tracing.worker)
    run_sample(job, fd, flush_output)   # never returns: streams the events to fd, then os._exit

Only code compiled from the program ("<program>") is traced: call, line (locals before the line runs),
exception (raised, propagated, or thrown in: caught or not) and return events, up to the entry call's exit. Every way the trace could silently lose
events (sys.settrace, f_trace cleared, a RecursionError, a thread or process, os._exit) makes it
`incomplete` with a reason. Events, guards, stream format: docs/design/sandbox.md, "The guarded tracer".
"""

from __future__ import annotations

import _thread
import ast
import builtins
import json.encoder
import opcode
import os
import sys
import types
from typing import NoReturn

from codi.tracing.saferepr import saferepr

# A program that rebinds builtins (`builtins.len = ...`) or module functions (`os.write = ...`,
# `sys.settrace = ...`) must not change what the tracer does: builtins are a private snapshot
# and every outside callable is bound here, at import, before any program runs.
__builtins__ = dict(builtins.__dict__)
_settrace, _gettrace, _addaudithook = sys.settrace, sys.gettrace, sys.addaudithook
_write, _exit, _getpid, _listdir = os.write, os._exit, os.getpid, os.listdir
_start_new_thread = _thread.start_new_thread
_FunctionType = types.FunctionType
# JSON string literal of a str, pure ASCII (C, immune to a poisoned builtins)
_enc = json.encoder.encode_basestring_ascii

PROGRAM_FILE = "<program>"
MODULE_NAME = "program"
RETURN_OPS = frozenset(opcode.opmap[n] for n in ("RETURN_VALUE", "RETURN_CONST", "YIELD_VALUE") if n in opcode.opmap)
CO_NEWLOCALS = 0x0002
CO_NOT_PLAIN = 0x0020 | 0x0080 | 0x0100 | 0x0200  # generator, coroutine, iterable coroutine, async gen
BATCH_CHARS = 1 << 15
# audit event -> flag; the flags make the result `incomplete` (docs/design/sandbox.md, "The guarded tracer")
_WATCHED = {
    "sys.settrace": "settrace", "_thread.start_new_thread": "thread",
    "os.fork": "process", "os.forkpty": "process", "os.posix_spawn": "process", "os.spawn": "process",
    "os.exec": "process", "os.system": "process", "subprocess.Popen": "process",
}
FLAG_REASONS = {
    "settrace": "the program called sys.settrace (events may be missing)",
    "thread": "the program started a thread (only the main thread is traced)",
    "process": "the program started a process (its execution is not traced)",
}


class Job:
    """What the child runs: the sample and the trace limits."""

    __slots__ = ("program", "setup", "call", "expected", "max_frames", "max_repr_chars")

    def __init__(self, program: str, setup: str, call: str, expected: str | None,
                 max_frames: int, max_repr_chars: int) -> None:
        self.program, self.setup, self.call, self.expected = program, setup, call, expected
        self.max_frames, self.max_repr_chars = max_frames, max_repr_chars


class _Watch:
    """What the audit hook and the thread wrapper saw."""

    own_settrace = 0  # our own sys.settrace calls still to be seen by the hook
    flags: set[str] = set()
    threads_active: dict = {}  # threading._active, when threading is imported


def _audit(event: str, args: tuple) -> None:
    flag = _WATCHED.get(event)
    if flag is None:
        return
    if flag == "settrace" and _Watch.own_settrace:
        _Watch.own_settrace -= 1
        return
    _Watch.flags.add(flag)


def _flagged_start_new_thread(*args, **kwargs):
    _Watch.flags.add("thread")
    return _start_new_thread(*args, **kwargs)


def _set_trace(fn) -> None:
    _Watch.own_settrace += 1
    _settrace(fn)


class Sink:
    """Batches records into the stream; every batch is one os.write (atomic up to PIPE_BUF)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.parts: list[str] = []
        self.chars = 0

    def add(self, record: str) -> None:
        self.parts.append(record)
        self.chars += len(record)
        if self.chars >= BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        if not self.parts:
            return
        data = ",".join(self.parts).encode("ascii")
        self.parts, self.chars = [], 0
        # The writer's pid in every batch: a forked copy of the program writing here is detected.
        view = memoryview(f"B{_getpid()},{len(data)};".encode() + data)
        while view:
            view = view[_write(self.fd, view):]


def end_record(status: str, reason: str) -> str:
    return f'["E",{_enc(status)},{_enc(reason)}]'


class Tracer:
    """The trace functions and their state; the events: docs/design/sandbox.md, "The guarded tracer"."""

    def __init__(self, sink: Sink, max_frames: int, limit: int, def_lines: dict[int, int],
                 on_truncate) -> None:
        self.sink, self.max_frames, self.limit, self.def_lines = sink, max_frames, limit, def_lines
        self.on_truncate = on_truncate  # called (and never returns) when the frame budget is spent
        self.n = 0                    # frames written
        # [frame, sid, last exception, pending] of the running traced frames; pending: an exception event
        # with no line event since (a return event then is the frame unwinding, even at a `yield`)
        self.stack: list[list] = []
        self.next_sid = 0
        self.done = False             # the entry call has exited: record nothing more
        self.exit: tuple[str, object] | None = None  # ("return"|"exception", value) of the entry
        self.broken = ""              # first reason the trace is not faithful
        self.seen: set[str] = set()   # names of notable exceptions met (RecursionError, MemoryError)
        # Bound once: sys.gettrace() must return this very object at the end if nobody replaced it.
        self.gtrace = self.global_trace
        self.ltrace = self.local_trace

    # -- trace functions (called by CPython; they never raise into the program)
    def global_trace(self, frame, event, arg):
        if self.done or frame.f_code.co_filename != PROGRAM_FILE:
            return None
        try:
            self._call(frame)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        return self.ltrace

    def local_trace(self, frame, event, arg):
        if self.done:
            return None
        try:
            if event == "line":
                self._line(frame)
            elif event == "return":
                self._return(frame, arg)
            elif event == "exception":
                self._exception(frame, arg)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        return self.ltrace

    # -- events
    def _call(self, frame) -> None:
        self._budget()
        sid = self.next_sid
        self.next_sid += 1
        line = frame.f_lineno
        if line == frame.f_code.co_firstlineno:
            line = self.def_lines.get(line, line)
        self.stack.append([frame, sid, None, False])
        self._locals_record("c", sid, line, frame)

    def _line(self, frame) -> None:
        top = self._top(frame, "line")
        if top is not None:
            top[3] = False
            self._budget()
            self._locals_record("l", top[1], frame.f_lineno, frame)

    def _exception(self, frame, arg) -> None:
        exc = arg[1]
        name = type(exc).__name__
        if name in ("RecursionError", "MemoryError"):
            self.seen.add(name)
        top = self._top(frame, "exception")
        if top is None:
            return
        # Every exception event is a frame, as CPython reports it: raised here, propagated from a callee
        # (at the call's line), or thrown in (GeneratorExit at a closed generator's `yield`), caught or not.
        # The last exception met is the one the frame exits with if it unwinds: a `finally` or `with`
        # re-raises it (RERAISE) without a new event.
        top[2], top[3] = exc, True
        self._budget()
        self.sink.add(f'["x",{top[1]},{frame.f_lineno},{_enc(saferepr(exc, self.limit))}]')
        self.n += 1

    def _return(self, frame, arg) -> None:
        top = self._top(frame, "return")
        if top is None:
            return
        self._budget()
        if not frame.f_trace_lines:
            self._lose("the program turned off line events (frame.f_trace_lines)")
        # Unwinding: no return opcode ran (a `finally` re-raised, or the exception passed through), or an
        # exception event came with no line event since (a GeneratorExit thrown in at a `yield`, whose
        # opcode looks like a normal yield). CPython's event then carries None; the frame carries the
        # exception it exits by, so its VALUE is that exception (never a made-up `None` result).
        unwinding = top[3] or frame.f_code.co_code[frame.f_lasti] not in RETURN_OPS
        value = top[2] if unwinding else arg
        if unwinding and value is None:
            self._lose("a frame exited by an exception the tracer did not see")
        rep = saferepr(value, self.limit)
        self.sink.add(f'["r",{top[1]},{frame.f_lineno},{_enc(rep)}]')
        self.n += 1
        self.stack.pop()
        if not self.stack:
            self.done = True
            self.exit = ("exception" if unwinding else "return", value)

    # -- helpers
    def _top(self, frame, event: str) -> list | None:
        if self.stack and self.stack[-1][0] is frame:
            return self.stack[-1]
        self._lose(f"a '{event}' event came from a frame the tracer did not see start "
                   "(frame.f_trace or the trace function was tampered with)")
        return None

    def _locals_record(self, kind: str, sid: int, line: int, frame) -> None:
        limit = self.limit
        body = []
        class_body = not frame.f_code.co_flags & CO_NEWLOCALS
        for name, value in frame.f_locals.items():
            if type(name) is not str or not name.isidentifier():
                continue  # `.0` of a comprehension, odd keys of a class namespace
            if class_body and name in ("__module__", "__qualname__"):
                continue
            body.append(f',"{name}",{_enc(saferepr(value, limit))}')  # an identifier needs no escaping
        self.sink.add(f'["{kind}",{sid},{line}' + "".join(body) + "]")
        self.n += 1

    def _budget(self) -> None:
        if self.n >= self.max_frames:
            self.on_truncate()

    def _lose(self, why: str) -> None:
        if not self.broken:
            self.broken = why

    def _fail(self, e: BaseException) -> None:
        name = type(e).__name__
        if name in ("RecursionError", "MemoryError"):
            self.seen.add(name)
        self._lose(f"the tracer failed with {name} (events are missing)")


def _def_lines(tree: ast.AST) -> dict[int, int]:
    """First decorator line -> `def`/`class` line: a decorated code object starts on its decorator."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.decorator_list:
            out[min(d.lineno for d in node.decorator_list)] = node.lineno
    return out


class SampleError(Exception):
    """A sample that cannot be run: (status, reason)."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def _describe(e: BaseException) -> str:
    return saferepr(e, 300)


def _compile(text: str, filename: str, what: str):
    try:
        return compile(text, filename, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise SampleError("syntax_error", f"{what} line {e.lineno}: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
        raise SampleError("syntax_error", f"{what}: {_describe(e)}") from None


class _Call:
    """The parsed call: the entry's name and the compiled code of each argument.

    Everything that needs `ast` happens here, before the program runs (a program could
    monkeypatch the module); only `eval` of ready code objects happens afterwards."""

    def __init__(self, call: str) -> None:
        try:
            node = ast.parse(call.strip(), "<call>", mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            raise SampleError("error", f"the call is not a Python expression: {_describe(e)}") from None
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise SampleError("error", "the call must be a plain call `name(args...)` of a program function")
        self.name = node.func.id

        def code(expr: ast.expr):
            return compile(ast.fix_missing_locations(ast.Expression(expr)), "<call>", "eval", dont_inherit=True)

        # ("*" | "**" | "" | keyword, code)
        self.args = [("*", code(a.value)) if isinstance(a, ast.Starred) else ("", code(a)) for a in node.args]
        self.args += [("**" if kw.arg is None else "=" + kw.arg, code(kw.value)) for kw in node.keywords]

    def resolve(self, ns: dict):
        """The entry function and its evaluated arguments (untraced)."""
        name = self.name
        if name not in ns:
            raise SampleError("error", f"the program defines no `{name}`")
        fn = target = ns[name]
        for _ in range(8):  # follow functools.wraps / lru_cache wrappers to the program's function
            if type(target) is _FunctionType:
                break
            target = getattr(target, "__wrapped__", None)
        if type(target) is not _FunctionType or target.__code__.co_filename != PROGRAM_FILE:
            raise SampleError("error", f"`{name}` is not a function defined by the program")
        if target.__code__.co_flags & CO_NOT_PLAIN:
            raise SampleError("error", f"`{name}` is a generator or coroutine function: calling it runs no code")
        args, kwargs = [], {}
        try:
            for how, code in self.args:
                value = eval(code, ns)  # noqa: S307 - inside the sandbox, on purpose
                if how == "*":
                    args.extend(value)
                elif how == "**":
                    kwargs.update(value)
                elif how:
                    kwargs[how[1:]] = value
                else:
                    args.append(value)
        except BaseException as e:  # noqa: BLE001
            raise SampleError("error", f"evaluating the call's arguments raised {_describe(e)}") from None
        return fn, args, kwargs


def _run_program(code, setup, ns: dict) -> None:
    for what, c in (("the program", code), ("the setup", setup)):
        if c is None:
            continue
        try:
            exec(c, ns)  # noqa: S102 - inside the sandbox, on purpose
        except BaseException as e:  # noqa: BLE001
            raise SampleError("error", f"running {what} raised {_describe(e)}") from None


def _verdict(tracer: Tracer, current, result, raised) -> tuple[str, str]:
    problems = []
    if tracer.broken:
        problems.append(tracer.broken)
    if current is not tracer.gtrace:
        problems.append("the trace function was removed or replaced (sys.settrace, or an error such as "
                        "RecursionError raised inside it)")
    problems += [FLAG_REASONS[f] for f in sorted(_Watch.flags)]
    try:
        threads = len(_listdir("/proc/self/task"))  # also threads started from C
    except OSError:
        threads = 1
    # (threading.active_count() would use the program's builtins.len)
    if "thread" not in _Watch.flags and max(threads, len(_Watch.threads_active)) > 1:
        problems.append(FLAG_REASONS["thread"])
    if tracer.stack:
        problems.append(f"{len(tracer.stack)} traced frame(s) never reported their exit (frame.f_trace cleared?)")
    if "RecursionError" in tracer.seen:
        problems.append("a RecursionError occurred (the tracer's own frames count against the limit)")
    if tracer.exit is None:
        problems.append("the entry call's exit was not traced")
    else:
        kind, value = tracer.exit
        consistent = (raised is value) if kind == "exception" else (raised is None and result is value)
        if not consistent:
            problems.append("the entry call's result is not the value its traced exit reported")
    if "MemoryError" in tracer.seen or isinstance(raised, MemoryError):
        return "memory", "MemoryError (memory limit)" + (f"; {problems[0]}" if problems else "")
    if problems:
        return "incomplete", "; ".join(problems)
    if raised is not None:
        return "raised", f"the entry call raised {_describe(raised)}"
    return "ok", ""


def run_sample(job: Job, fd: int, flush_output) -> NoReturn:
    """Run and trace one sample, stream it to `fd`, flush the program's output, end the process.

    `flush_output()` flushes the program's stdout/stderr (our own wrappers, whatever the program
    did to sys.stdout)."""
    sink = Sink(fd)

    def finish(status: str, reason: str) -> NoReturn:
        flush_output()
        sink.add(end_record(status, reason))
        sink.flush()
        _exit(0)

    def truncate() -> NoReturn:
        # Exit from inside the trace function: an exception would reach (and could be swallowed
        # by) the program, and nothing after the last kept frame matters.
        _settrace(None)
        finish("truncated", f"stopped at max_frames={job.max_frames} frames")

    _addaudithook(_audit)
    _thread.start_new_thread = _flagged_start_new_thread  # threading copies it when imported later
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._start_new_thread = _flagged_start_new_thread
        _Watch.threads_active = threading._active
    random = sys.modules.get("random")  # imported by now if the program names it (worker.py)
    if random is not None:
        random.seed(0)  # an unseeded program draws the same numbers every run (determinism)
    result = ns = None
    try:
        call = _Call(job.call)
        code = _compile(job.program, PROGRAM_FILE, "program")
        setup = _compile(job.setup, "<setup>", "setup") if job.setup.strip() else None
        def_lines = _def_lines(ast.parse(job.program)) if "@" in job.program else {}
        module = types.ModuleType(MODULE_NAME)
        sys.modules[MODULE_NAME] = module
        ns = module.__dict__
        ns["__builtins__"] = builtins
        _run_program(code, setup, ns)
        fn, args, kwargs = call.resolve(ns)
        tracer = Tracer(sink, job.max_frames, job.max_repr_chars, def_lines, truncate)
        raised = None
        _set_trace(tracer.gtrace)
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the entry's own exception is a result
            raised = e
        current = _gettrace()
        _set_trace(None)
        if tracer.n == 0:
            raise SampleError("error", "the entry call ran no code of the program")
        status, reason = _verdict(tracer, current, result, raised)
    except SampleError as e:
        status, reason = e.status, e.reason
    except BaseException as e:  # noqa: BLE001 - e.g. MemoryError while preparing
        status = "memory" if isinstance(e, MemoryError) else "error"
        reason = f"the tracer failed: {_describe(e)}"
    if status != "ok" or job.expected is None:
        finish(status, reason)
    flush_output()
    sink.add(end_record(status, reason))
    sink.flush()  # the trace is safe with the worker before any user __eq__ runs
    sink.add(f'["M","{_match(job.expected, ns, result)}"]')
    sink.flush()
    flush_output()
    _exit(0)


def _match(expected: str, ns: dict, result) -> str:
    """"1"/"0" when `result == eval(expected)` is True/False (like the assert), "" when undecidable."""
    try:
        want = eval(compile(expected, "<expected>", "eval", dont_inherit=True), ns)  # noqa: S307
        return "1" if bool(result == want) else "0"
    except BaseException:  # noqa: BLE001
        return ""
