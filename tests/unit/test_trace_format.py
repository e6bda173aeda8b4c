"""Property tests of codi/tracing/format.py: text -> frames -> text is the identity."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codi.tracing.format import (
    UNCHANGED,
    Frame,
    TraceParseError,
    actions,
    encode_locals,
    encode_value,
    entry_exit,
    exit_kind,
    locals_offsets,
    parse_frames_prefix,
    parse_trace,
    render_frame,
    render_prompt,
    render_trace,
)
from codi.tracing.tokens import ACTION_SEP, ARG_SEP, FRAME_SEP, LINE_SEP, TRACE_TOKENS, contains_special

# Text a trace field may hold: anything but a special token (those samples are unrepresentable).
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30).filter(lambda s: not contains_special(s))
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
reprs = st.one_of(text, st.just(UNCHANGED))
source_lines = text.map(lambda s: s.replace("\n", " ") + "\n")


@st.composite
def frames(draw) -> Frame:
    kind = draw(st.sampled_from(["call", "line", "return", "exception"]))
    line = draw(source_lines)
    if kind in ("call", "line"):
        return Frame(kind, line, locals=encode_locals(draw(st.dictionaries(names, reprs, max_size=5))))
    return Frame(kind, line, value=encode_value(draw(text)))


@settings(max_examples=200, deadline=None)
@given(st.lists(frames(), max_size=12))
def test_frames_text_frames_identity(fs: list[Frame]) -> None:
    text_ = render_trace(fs)
    assert parse_trace(text_) == fs
    assert render_trace(parse_trace(text_)) == text_


@settings(max_examples=200, deadline=None)
@given(st.lists(frames(), min_size=1, max_size=8), st.data())
def test_prefix_parse_keeps_the_open_frame(fs: list[Frame], data) -> None:
    text_ = render_trace(fs)
    cut = data.draw(st.integers(0, len(text_)))
    done, rest = parse_frames_prefix(text_[:cut])
    assert render_trace(done) + rest == text_[:cut]
    assert done == fs[:len(done)]


@settings(max_examples=200, deadline=None)
@given(st.lists(frames(), max_size=10))
def test_locals_offsets_point_at_each_line_frames_locals(fs: list[Frame]) -> None:
    text_ = render_trace(fs)
    spans = locals_offsets(fs)
    lines = [f for f in fs if f.kind == "line"]
    assert len(spans) == len(lines)
    for (i, j), f in zip(spans, lines):
        assert text_[i:j] == f.locals
        assert text_[i - len(LINE_SEP):i] == LINE_SEP and text_[j:j + len(ACTION_SEP)] == ACTION_SEP


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(names, text, max_size=6), text)
def test_encoded_fields_decode_to_what_was_encoded(values: dict[str, str], rep: str) -> None:
    f = Frame("line", "x\n", locals=encode_locals(values))
    assert f.locals_dict() == values
    assert list(f.locals_dict()) == list(values)  # Python's order, never sorted
    assert Frame("return", "x\n", value=encode_value(rep)).value_repr() == rep


def test_prompt_holds_program_and_call() -> None:
    p = render_prompt("def f():\n    return 1\n", "f()")
    assert p.endswith("# call: f()\n" + FRAME_SEP) and "def f():\n    return 1\n" in p


def test_entry_exit_balances_nested_calls_and_generators() -> None:
    c, ln = Frame("call", "d\n", locals="{}"), Frame("line", "l\n", locals="{}")
    r = Frame("return", "r\n", value='"1"')
    x = Frame("exception", "x\n", value='"E()"')
    ux = Frame("return", "x\n", value='"E()"')  # a frame unwinding by E: its exception, then its return event
    # a callee raises and unwinds, the caller catches (an exception frame is an event: no depth change)
    frames = [c, ln, c, x, ux, x, ln, r]
    assert entry_exit(frames) is frames[-1] and exit_kind(frames, frames[-1]) == "return"
    assert exit_kind(frames, frames[4]) == "exception"
    assert entry_exit([c, ln, c, r]) is None and entry_exit([c, ln, x]) is None
    unwinding = [c, ln, x, ux]
    assert entry_exit(unwinding) is ux and exit_kind(unwinding, ux) == "exception"
    assert actions([c, r]) == [("call", "d\n"), ("return", "r\n")]


@pytest.mark.parametrize("bad, why", [
    ("<|line_sep|>{}" + FRAME_SEP, "no <|action_sep|>"),
    ("<|return_sep|>x" + FRAME_SEP, "no <|action_sep|> after the marker"),
    ("<|return_sep|><|action_sep|>x\n" + FRAME_SEP, "no <|arg_sep|>"),
    ("<|line_sep|>[1]<|action_sep|>x\n" + FRAME_SEP, "not a JSON object of strings"),
    ("<|line_sep|>{<|action_sep|>x\n" + FRAME_SEP, "locals are not JSON"),
    ("<|return_sep|><|action_sep|>x\n" + ARG_SEP + "1" + FRAME_SEP, "not a JSON string"),
    ("hello" + FRAME_SEP, "does not start with a frame marker"),
    ("<|call_sep|>{}<|action_sep|>x\n", "not closed"),
])
def test_bad_text_names_the_frame_and_the_reason(bad: str, why: str) -> None:
    good = render_frame(Frame("call", "def f():\n", locals="{}"))
    with pytest.raises(TraceParseError, match=f"frame 1: .*{why}" if "closed" not in why else "frame 1: not closed"):
        parse_trace(good + bad)


def test_every_special_token_is_caught() -> None:
    for token in TRACE_TOKENS:
        assert contains_special(json.dumps(f"a{token}b")) == token


def test_exit_kind_after_a_finally_and_after_returning_the_caught_exception() -> None:
    def fr(kind: str, line: str, value: str | None = None) -> Frame:
        return Frame(kind, line + "\n", None if value else "{}", None if value is None else encode_value(value))

    err = "ZeroDivisionError('division by zero')"
    # the exception, then the finally's line runs, then the frame unwinds at that line
    finally_ = [fr("call", "def f(n):"), fr("line", "    acc = 1 / n"), fr("exception", "    acc = 1 / n", err),
                fr("line", "    acc = 0"), fr("return", "    acc = 0", err)]
    assert exit_kind(finally_, finally_[-1]) == "exception"
    # `except ZeroDivisionError as e: return e` returns the exception object: a normal return
    returned = [*finally_[:3], fr("line", "    return e"), fr("return", "    return e", err)]
    assert exit_kind(returned, returned[-1]) == "return"
    # an exception caught in a callee (its own scope) does not make the caller's exit an exception
    nested = [fr("call", "def f():"), fr("line", "    g()"), fr("call", "def g():"),
              fr("exception", "    1 / 0", err), fr("line", "    pass"), fr("return", "    pass", "None"),
              fr("line", "    x = 1"), fr("return", "    x = 1", err)]
    assert exit_kind(nested, nested[-1]) == "return"


def test_computed_values_counts_what_a_trace_computes_not_what_it_copies():
    from codi.tracing.format import computed_values
    frames = [Frame("call", "def f(a, b):\n", locals='{"a": "1", "b": "2"}'),
              Frame("line", "    c = a + 1\n", locals='{"a": "1", "b": "2"}'),           # copies only
              Frame("line", "    c = c + b\n", locals='{"a": "1", "b": "2", "c": "2"}'),  # new c: 1
              Frame("line", "    return c\n", locals='{"a": "1", "b": "2", "c": "4"}'),   # changed c: 1
              Frame("return", "    return c\n", value='"4"')]                              # the result: 1
    assert computed_values(frames) == 3
    diff = [frames[0], Frame("line", "    c = a + 1\n", locals='{"a": "..", "b": ".."}'),
            Frame("line", "    c = c + b\n", locals='{"a": "..", "b": "..", "c": "2"}'), frames[4]]
    assert computed_values(diff) == 2  # ".." is a copy in the diff encoding
