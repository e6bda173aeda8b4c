"""The trace text format: frames <-> text, both ways (grammar: docs/design/trace-format.md, "The trace format").

    prompt = render_prompt(program, "f(1, 3)")   # <|trace_context_start|>, program, "# call: f(1, 3)", <|frame_sep|>
    text = render_trace(frames)                  # frames -> text (no EOS)
    assert render_trace(parse_trace(text)) == text

A `Frame` keeps LOCALS (a JSON object of reprs; ".." = unchanged since the scope's previous frame) and
VALUE (a JSON string holding a repr) as the exact JSON text written, which is what makes
text -> frames -> text the identity. LINE is the raw source line, its newline included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from codi.tracing.tokens import (
    ACTION_SEP,
    ARG_SEP,
    CALL_SEP,
    EXCEPTION_SEP,
    FRAME_SEP,
    LINE_SEP,
    RETURN_SEP,
    TRACE_CONTEXT_START,
)

FrameKind = Literal["call", "line", "return", "exception"]
UNCHANGED = ".."  # diff encoding of a value equal to the scope's previous frame
# Ends a repr cut at TraceConfig.max_repr_chars: visible to people and models, and no valid
# Python literal contains it, so a cut value never compares equal to a whole one by accident.
REPR_CUT = "<cut>"
CALL_PREFIX = "# call: "

_MARKER = {"call": CALL_SEP, "line": LINE_SEP, "return": RETURN_SEP, "exception": EXCEPTION_SEP}
_KIND = {v: k for k, v in _MARKER.items()}


class TraceParseError(ValueError):
    """Trace text that does not follow the grammar; says which frame and why."""


@dataclass(frozen=True)
class Frame:
    """One trace event. `locals` (call/line) and `value` (return/exception) are exact JSON text."""

    kind: FrameKind
    source_line: str
    locals: str | None = None
    value: str | None = None

    def locals_dict(self) -> dict[str, str]:
        """The frame's locals as {name: repr} ('..' kept as written)."""
        return json.loads(self.locals) if self.locals is not None else {}

    def value_repr(self) -> str | None:
        """The repr held by VALUE (return value or exception), decoded from its JSON string."""
        return json.loads(self.value) if self.value is not None else None


def encode_locals(values: dict[str, str]) -> str:
    """LOCALS text for a {name: repr} mapping, in the mapping's order (Python's, never sorted)."""
    return json.dumps(values, ensure_ascii=False)


def encode_value(text: str) -> str:
    """VALUE text for a repr."""
    return json.dumps(text, ensure_ascii=False)


def render_prompt(program: str, call: str) -> str:
    """The trace context: the program and the call being traced."""
    return f"{TRACE_CONTEXT_START}{program}\n{CALL_PREFIX}{call}\n{FRAME_SEP}"


def render_frame(frame: Frame) -> str:
    marker = _MARKER[frame.kind]
    if frame.kind in ("call", "line"):
        return f"{marker}{frame.locals}{ACTION_SEP}{frame.source_line}{FRAME_SEP}"
    return f"{marker}{ACTION_SEP}{frame.source_line}{ARG_SEP}{frame.value}{FRAME_SEP}"


def render_trace(frames: list[Frame]) -> str:
    return "".join(render_frame(f) for f in frames)


def locals_offsets(frames: list[Frame]) -> list[tuple[int, int]]:
    """Character span [start, end) of each LINE frame's LOCALS inside `render_trace(frames)`."""
    spans, pos = [], 0
    for f in frames:
        if f.kind == "line":
            start = pos + len(LINE_SEP)
            spans.append((start, start + len(f.locals or "")))
        pos += len(render_frame(f))
    return spans


def computed_values(frames: list[Frame]) -> int:
    """How many values a trace computes rather than copies: every local of a LINE frame that is new or differs
    from the frame before it (the previous CALL or LINE frame), and every return/exception VALUE. A task's
    work per call (the ladder's "computed values"); codi.data.batching.computed_mask is the same split per token."""
    count, prev = 0, None
    for f in frames:
        if f.kind in ("return", "exception"):
            count += 1
        elif f.kind == "line" and prev is not None:
            count += sum(v != UNCHANGED and prev.get(k) != v for k, v in f.locals_dict().items())
        if f.kind in ("call", "line"):
            prev = f.locals_dict()
    return count


def _parse_one(chunk: str, index: int, strict: bool) -> Frame:
    def fail(why: str) -> TraceParseError:
        return TraceParseError(f"frame {index}: {why}: {chunk[:80]!r}")

    marker = next((m for m in _KIND if chunk.startswith(m)), None)
    if marker is None:
        raise fail("does not start with a frame marker")
    kind = _KIND[marker]
    body = chunk[len(marker):]
    if kind in ("call", "line"):
        locals_text, sep, line = body.partition(ACTION_SEP)
        if not sep:
            raise fail("no <|action_sep|>")
        if ARG_SEP in line or ACTION_SEP in line:
            raise fail("unexpected separator in the source line")
        if strict:
            try:
                obj = json.loads(locals_text)
            except json.JSONDecodeError as e:
                raise fail(f"locals are not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not all(isinstance(v, str) for v in obj.values()):
                raise fail("locals are not a JSON object of strings")
        return Frame(kind, line, locals=locals_text)
    if not body.startswith(ACTION_SEP):
        raise fail("no <|action_sep|> after the marker")
    line, sep, value = body[len(ACTION_SEP):].partition(ARG_SEP)
    if not sep:
        raise fail("no <|arg_sep|>")
    if ARG_SEP in value or ACTION_SEP in value:
        raise fail("unexpected separator in the value")
    if strict:
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError as e:
            raise fail(f"value is not JSON ({e.msg})") from None
        if not isinstance(decoded, str):
            raise fail("value is not a JSON string")
    return Frame(kind, line, value=value)


def parse_frames_prefix(text: str, strict: bool = True) -> tuple[list[Frame], str]:
    """Parse every complete frame of `text`; return them and the unparsed rest (an open frame)."""
    chunks = text.split(FRAME_SEP)
    rest = chunks.pop()  # text after the last <|frame_sep|> (empty for a complete trace)
    return [_parse_one(c, i, strict) for i, c in enumerate(chunks)], rest


def parse_trace(text: str, strict: bool = True) -> list[Frame]:
    """Parse a complete trace (no EOS). Raises TraceParseError naming the bad frame."""
    frames, rest = parse_frames_prefix(text, strict)
    if rest:
        raise TraceParseError(f"frame {len(frames)}: not closed by <|frame_sep|>: {rest[:80]!r}")
    return frames


def entry_exit(frames: list[Frame]) -> Frame | None:
    """The return frame that ends the entry call (call depth back to 0), or None.

    Depth counts call frames (+1) against return frames (-1): a frame's every exit is a return event,
    also when it unwinds by an exception; a generator's resume and yield are a call and a return, so they
    balance too. Exception frames (an exception raised, propagated or thrown in) change no depth."""
    depth = 0
    for f in frames:
        if f.kind == "call":
            depth += 1
        elif f.kind == "return":
            depth -= 1
            if depth == 0:
                return f
    return None


def exit_kind(frames: list[Frame], exit_frame: Frame) -> str:
    """"exception" when `exit_frame` (a return frame of `frames`) unwinds by an exception, else "return".

    CPython reports an unwinding frame as its last exception event, any `finally`/`with` lines that run
    after it, then a return event (no new event for the re-raise); the tracer gives that return frame
    the exception as VALUE. So a frame unwinds when either
    - the frame right before it is an exception frame (nothing ran between: a return statement or a
      handler would be a line frame of its own), or
    - its scope's last exception frame holds the same VALUE and the exit is not at a `return` statement
      (a `finally: return` or `except E as e: return e` returns normally)."""
    k = next((i for i, f in enumerate(frames) if f is exit_frame), None)
    if k is None:
        raise ValueError("exit_kind: the exit frame is not one of the frames")
    if k > 0 and frames[k - 1].kind == "exception":
        return "exception"
    nested = 0  # scopes entered between a frame and the exit frame, walking back
    for f in reversed(frames[:k]):
        if f.kind == "return":
            nested += 1
        elif f.kind == "call":
            if nested == 0:
                return "return"  # the exit frame's scope began with no exception in it
            nested -= 1
        elif f.kind == "exception" and nested == 0:
            statement = exit_frame.source_line.strip()
            at_return = statement == "return" or statement.startswith(("return ", "return(", "return["))
            return "exception" if f.value == exit_frame.value and not at_return else "return"
    return "return"


def actions(frames: list[Frame]) -> list[tuple[str, str]]:
    """The executed event sequence: (kind, source line) of every frame."""
    return [(f.kind, f.source_line) for f in frames]
