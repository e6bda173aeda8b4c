"""Answers: reading a predicted VALUE, comparing it with the truth, and the no-trace (direct) format.

    from codi.data.answers import answers_match, render_direct, parse_direct
    answers_match("{2, 1}", "{1, 2}")     # True: literals compare as values; answers_match("1", "1.0") is False
    render_direct("[1, 2]")               # '<|arg_sep|>"[1, 2]"'  (the direct target, before eos)
    parse_direct('<|arg_sep|>"[1, 2]"')   # DirectParse(answer='[1, 2]', error='')

The rule: two reprs that both parse as Python literals are equal iff their values are, type-strictly;
otherwise they compare as exact text (exception reprs, objects, reprs cut with REPR_CUT).
Details: docs/design/data.md, "Answers".
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from typing import Any

from codi.tracing.format import REPR_CUT, encode_value
from codi.tracing.tokens import ARG_SEP

# What `literal_value` returns for text that is not a literal (None is a literal, so not None).
NOT_LITERAL: Any = type("NotLiteral", (), {"__repr__": lambda self: "NOT_LITERAL"})()

_NAMES = {"nan": math.nan, "inf": math.inf}
# Deep nesting makes ast.parse recurse; reprs are short, a model's output may not be.
_MAX_LITERAL_CHARS = 100_000


def literal_value(text: str | None) -> Any:
    """The Python value of a literal repr, or NOT_LITERAL.

    Accepts what `ast.literal_eval` accepts plus the names `nan`/`inf` (as `repr(float)` writes
    them, also signed), `set()`, `frozenset()` and `frozenset(<literal iterable>)`. Never evaluates
    anything else: names, attribute access and other calls make the text a non-literal."""
    if text is None or text.endswith(REPR_CUT) or len(text) > _MAX_LITERAL_CHARS:
        return NOT_LITERAL
    try:
        tree = ast.parse(text.strip(), mode="eval")
        return _eval(tree.body)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError, OverflowError):
        # TypeError: an unhashable set element or dict key ({[1]}); ValueError: an int literal
        # over Python's digit limit; RecursionError: absurd nesting.
        return NOT_LITERAL


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        if isinstance(v, bool) or not isinstance(v, (int, float, complex)):
            raise ValueError("sign on a non-number")
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        # Only complex literals (`1+2j`, `-1-0j`): a real part and an imaginary constant.
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(left, bool) or not isinstance(left, (int, float)) or not isinstance(right, complex):
            raise ValueError("arithmetic is not a literal")
        return left + right if isinstance(node.op, ast.Add) else left - right
    if isinstance(node, ast.Tuple):
        return tuple(_eval(e) for e in node.elts)
    if isinstance(node, ast.List):
        return [_eval(e) for e in node.elts]
    if isinstance(node, ast.Set):
        return {_eval(e) for e in node.elts}
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):  # {**x}
            raise ValueError("dict unpacking is not a literal")
        return {_eval(k): _eval(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("set", "frozenset")
            and not node.keywords and len(node.args) <= 1):
        items = _eval(node.args[0]) if node.args else ()
        if not isinstance(items, (list, tuple, set, frozenset, dict, str)):
            raise ValueError("set() of a non-iterable")
        return set(items) if node.func.id == "set" else frozenset(items)
    raise ValueError(f"not a literal: {type(node).__name__}")


def _canon(v: Any) -> Any:
    """A hashable, type-tagged form of a literal value: equal forms = equal answers (type-strict)."""
    t = type(v).__name__
    if isinstance(v, float):
        return (t, "nan") if math.isnan(v) else (t, v)
    if isinstance(v, complex):
        return (t, _canon(v.real), _canon(v.imag))
    if isinstance(v, (list, tuple)):
        return (t, tuple(_canon(x) for x in v))
    if isinstance(v, (set, frozenset)):
        return (t, frozenset(_canon(x) for x in v))
    if isinstance(v, dict):
        return (t, frozenset((_canon(k), _canon(x)) for k, x in v.items()))
    return (t, v)  # int, bool, str, bytes, None, Ellipsis


@dataclass(frozen=True)
class Comparison:
    """How a prediction compared with the truth: `how` is "literal" or "string"."""

    correct: bool
    how: str


def compare_answers(predicted: str | None, truth: str) -> Comparison:
    """Compare a predicted repr with the true one (module docstring: the rule). None never matches."""
    if predicted is None:
        return Comparison(False, "string")
    p, t = literal_value(predicted), literal_value(truth)
    if p is not NOT_LITERAL and t is not NOT_LITERAL:
        try:
            return Comparison(_canon(p) == _canon(t), "literal")
        except RecursionError:  # a value nested too deep to canonicalise: fall back to the text
            pass
    return Comparison(predicted == truth, "string")


def answers_match(predicted: str | None, truth: str) -> bool:
    return compare_answers(predicted, truth).correct


# ------------------------------------------------------------------------------ direct format
@dataclass(frozen=True)
class DirectParse:
    """A parsed direct generation: the answer repr, or None with the reason in `error`."""

    answer: str | None
    error: str


def render_direct(value_repr: str) -> str:
    """The direct target text for a repr, without eos: `<|arg_sep|>` + JSON string of the repr."""
    return ARG_SEP + encode_value(value_repr)


def direct_target_ids(tokenizer, value_repr: str) -> list[int]:
    """Token ids of the direct target: the rendered text (no special tokens added) + the tokenizer's eos.

    Append to the prompt's ids (`render_prompt(...)` tokenized with `add_special_tokens=False`)."""
    if tokenizer.eos_token_id is None:
        raise KeyError("tokenizer has no eos token: call codi.tracing.tokens.add_trace_tokens first")
    return list(tokenizer(render_direct(value_repr), add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


def parse_direct(text: str) -> DirectParse:
    """Parse a direct generation's text (eos removed): exactly `<|arg_sep|>` + one JSON string."""
    if not text.startswith(ARG_SEP):
        return DirectParse(None, f"direct answer does not start with {ARG_SEP}: {text[:60]!r}")
    body = text[len(ARG_SEP):]
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return DirectParse(None, f"direct answer is not JSON ({e.msg}): {body[:60]!r}")
    except RecursionError:
        return DirectParse(None, f"direct answer is nested too deep: {body[:60]!r}")
    if not isinstance(value, str):
        return DirectParse(None, f"direct answer is not a JSON string: {body[:60]!r}")
    return DirectParse(value, "")
