"""An independent reference tracer for the differential tests (tests/unit/test_tracer_differential.py).

Built only on `sys.settrace`, `dis` and `ast`; it imports nothing from `codi`, so a bug in codi/tracing
cannot hide here too. It runs each program natively, in its own process (no sandbox), and reports
what CPython's tracing events say, one record per event, with every local written out:

    ["call" | "line", source line, [[name, repr], ...], None]
    ["exception", source line, None, repr(exception)]
    ["return", source line, None, repr(value)]   # value: the exception when the frame unwinds

Run (the hash seed makes a set of strings print in one order, as in codi's workers):

    PYTHONHASHSEED=0 python tests/reference_tracer.py < programs.json > traces.json

programs.json is a list of {"program", "call"}; traces.json a list of {"status", "value", "frames"},
status "ok" or "raised".
"""

from __future__ import annotations

import ast
import dis
import json
import re
import sys
import types

FILENAME = "<reference>"
MODULE = "program"  # the module name a default repr shows: <program.Box object at 0x?>
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
NEW_LOCALS = 0x0002  # CO_NEWLOCALS: unset for a class body
# The instructions a frame leaves by normally; a return event at any other one is the frame unwinding.
LEAVING = {"RETURN_VALUE", "RETURN_CONST", "YIELD_VALUE"}


def shown(value: object) -> str:
    """repr with addresses masked; a repr that raises (a half-built object in `__init__`) is marked."""
    try:
        text = repr(value)
    except Exception as e:  # noqa: BLE001
        return f"<repr error: {type(e).__name__}>"
    return ADDRESS.sub(" at 0x?", text)


class Reference:
    def __init__(self, lines: list[str], decorated: dict[int, int]) -> None:
        self.lines, self.decorated = lines, decorated
        self.frames: list[list] = []
        self.pending: dict[int, BaseException | None] = {}  # id(frame) -> exception with no line since
        self.last: dict[int, BaseException | None] = {}     # id(frame) -> last exception met
        self.entry: types.FrameType | None = None
        self.finished = False

    def text(self, lineno: int) -> str:
        return self.lines[lineno - 1] + "\n"

    def local_values(self, frame: types.FrameType) -> list[list[str]]:
        class_body = not frame.f_code.co_flags & NEW_LOCALS
        return [[name, shown(value)] for name, value in frame.f_locals.items()
                if isinstance(name, str) and name.isidentifier()
                and not (class_body and name in ("__module__", "__qualname__"))]

    def on_call(self, frame, event, arg):
        if self.finished or frame.f_code.co_filename != FILENAME:
            return None
        if self.entry is None:
            self.entry = frame
        line = frame.f_lineno
        if line == frame.f_code.co_firstlineno:
            line = self.decorated.get(line, line)
        self.pending[id(frame)] = None
        self.last[id(frame)] = None
        self.frames.append(["call", self.text(line), self.local_values(frame), None])
        return self.on_event

    def on_event(self, frame, event, arg):
        if self.finished:
            return None
        key = id(frame)
        if event == "line":
            self.pending[key] = None
            self.frames.append(["line", self.text(frame.f_lineno), self.local_values(frame), None])
        elif event == "exception":
            exc = arg[1]
            self.pending[key] = self.last[key] = exc
            self.frames.append(["exception", self.text(frame.f_lineno), None, shown(exc)])
        elif event == "return":
            at = next((i.opname for i in dis.get_instructions(frame.f_code) if i.offset == frame.f_lasti), "")
            unwinding = self.pending[key] is not None or at not in LEAVING
            value = self.last[key] if unwinding else arg
            self.frames.append(["return", self.text(frame.f_lineno), None, shown(value)])
            if frame is self.entry:
                self.finished = True
        return self.on_event


def trace(program: str, call: str) -> dict:
    tree = ast.parse(program)
    decorated = {min(d.lineno for d in node.decorator_list): node.lineno for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and node.decorator_list}
    module = types.ModuleType(MODULE)
    sys.modules[MODULE] = module
    exec(compile(program, FILENAME, "exec"), module.__dict__)  # noqa: S102 - the test's own fixtures
    call_node = ast.parse(call, mode="eval").body
    function = module.__dict__[call_node.func.id]
    args = [eval(compile(ast.Expression(a), "<call>", "eval"), module.__dict__) for a in call_node.args]  # noqa: S307
    reference = Reference(program.split("\n"), decorated)
    sys.settrace(reference.on_call)
    try:
        status, value = "ok", shown(function(*args))
    except Exception as e:  # noqa: BLE001 - the entry's exception is its result
        status, value = "raised", shown(e)
    finally:
        sys.settrace(None)
    return {"status": status, "value": value, "frames": reference.frames}


def main() -> None:
    jobs = json.load(sys.stdin)
    json.dump([trace(job["program"], job["call"]) for job in jobs], sys.stdout)


if __name__ == "__main__":
    main()
