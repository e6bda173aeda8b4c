"""Turn a test assertion into the call it makes and the value it expects.

    from codi.sources.asserts import parse_assert_text, NoCall
    parse_assert_text("assert add(2, 3) == 5", {"add": "add"})   # AssertCall(call='add(2, 3)', expected='5', why='')
    parse_assert_text("assert candidate(1) == 2", {"candidate": "inc"})   # HumanEval: call='inc(1)'

`callees` maps the names an assert may call to the program's function; an assert that calls none of them
raises `NoCall`. `expected` is set only where value equality with the return is exactly what the assert
checks (`f(x) == y`, `y == f(x)`, `f(x) is True/False/None`); other shapes keep the call with
`expected=None` and say why. Also here: `Harvest` and `defined_functions`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from codi.sources.base import Sample


@dataclass
class Harvest:
    """What one dataset record yields: samples, why parts of it gave none, why some lack `expected`."""

    samples: list[Sample] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)          # "test_list[2]: <why>"
    unchecked: dict[str, str] = field(default_factory=dict)   # sample_id -> why expected is None


@dataclass(frozen=True)
class AssertCall:
    """The call an assert makes (callee renamed) and the expression its result must equal."""

    call: str
    expected: str | None
    why: str = ""  # why `expected` is None; "" when it is set


class NoCall(ValueError):
    """The assertion calls no function of the program: it yields no sample (message = why)."""


_DEF_RE = re.compile(r"^def\s+([A-Za-z_]\w*)\s*\(", re.M)


def defined_functions(program: str) -> set[str]:
    """Names of the program's top-level functions and module-level bindings of them (a regex fallback when
    it does not parse)."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError):
        # The tracer reports the syntax error; the sample must still name its callee.
        return set(_DEF_RE.findall(program))
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    # A module-level binding of a function is callable by that name too (`f = solve`, `f = lambda x: ...`,
    # `f = lru_cache(None)(solve)`): the tracer follows it to the program's function and names that one in
    # its frames; a binding that turns out not to be a function is the tracer's status row.
    changed = True
    while changed:
        changed = False
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound = {t.id for t in targets if isinstance(t, ast.Name)} - names
            if bound and _binds_a_function(node.value, names):
                names |= bound
                changed = True
    return names


def _binds_a_function(value: ast.expr, functions: set[str]) -> bool:
    """`value` is a defined function, a lambda, or a call that wraps one of them."""
    if isinstance(value, ast.Lambda):
        return True
    if isinstance(value, ast.Name):
        return value.id in functions
    if isinstance(value, ast.Call):
        return any(_binds_a_function(a, functions) for a in (value.func, *value.args))
    return False


def parse_assert_text(text: str, callees: Mapping[str, str]) -> AssertCall:
    """Parse one assert statement given as source text (MBPP's test_list items)."""
    try:
        tree = ast.parse(text.strip())
    except (SyntaxError, ValueError) as e:
        raise NoCall(f"the assert does not parse ({_syntax_msg(e)})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise NoCall("not a single assert statement")
    return parse_assert(tree.body[0], callees)


def parse_assert(node: ast.Assert, callees: Mapping[str, str]) -> AssertCall:
    """The call and expected value of an `assert` node (see the module docstring)."""
    test = node.test
    calls = _outer_calls(test, callees)
    if not calls:
        if isinstance(test, ast.Constant):
            raise NoCall(f"constant assert (`assert {test.value!r}`) calls nothing")
        names = ", ".join(f"`{n}`" for n in sorted(set(callees.values())))
        raise NoCall(f"the assert calls no function of the program ({names})")
    call = calls[0]
    call_text = _render(call, callees)
    if len(calls) > 1:
        return AssertCall(call_text, None, f"{len(calls)} calls of the program in one assert")
    if test is call:
        return AssertCall(call_text, None, "truthy assert: no expected value")
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, left, right = test.ops[0], test.left, test.comparators[0]
        if isinstance(op, ast.Eq) and (left is call or right is call):
            other = right if left is call else left
            return AssertCall(call_text, _render(other, callees))
        if isinstance(op, ast.Is) and left is call and isinstance(right, ast.Constant) \
                and right.value in (True, False, None):
            return AssertCall(call_text, repr(right.value))
    return AssertCall(call_text, None, _why_unchecked(test, call))


def _outer_calls(node: ast.AST, callees: Mapping[str, str]) -> list[ast.Call]:
    """Calls of a callee not nested inside another such call, in source order."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in callees:
        return [node]
    found: list[ast.Call] = []
    for child in ast.iter_child_nodes(node):
        found.extend(_outer_calls(child, callees))
    return found


class _Rename(ast.NodeTransformer):
    def __init__(self, callees: Mapping[str, str]) -> None:
        self.callees = callees

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id in self.callees:
            return ast.copy_location(ast.Name(id=self.callees[node.id], ctx=node.ctx), node)
        return node


def _render(node: ast.expr, callees: Mapping[str, str]) -> str:
    copy = ast.parse(ast.unparse(node), mode="eval").body  # renaming must not touch the caller's tree
    return ast.unparse(_Rename(callees).visit(copy))


_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
        ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}


def _why_unchecked(test: ast.expr, call: ast.Call) -> str:
    """A short, countable reason why `test` gives no exact expected value for `call`."""
    names = {ast.unparse(n.func).split(".")[-1] for n in ast.walk(test) if isinstance(n, ast.Call)}
    if "isclose" in names:
        return "approximate comparison (isclose)"
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and test.operand is call:
        return "falsy assert (`not`): no expected value"
    if isinstance(test, ast.Compare):
        ops = [_OPS.get(type(o), type(o).__name__) for o in test.ops]
        if "abs" in names and ops[0] in ("<", "<="):
            return "approximate comparison (abs(result - y) < eps)"
        if len(ops) > 1:
            return "chained comparison"
        if ops[0] != "==" and _parent_of(test, call) is test:
            return f"comparison with `{ops[0]}`"
    parent = _parent_of(test, call)
    if isinstance(parent, ast.Call):
        return f"result compared through {ast.unparse(parent.func)}(...)"
    return f"result used inside a {type(parent).__name__} expression"


def _parent_of(root: ast.AST, target: ast.AST) -> ast.AST:
    for node in ast.walk(root):
        if any(child is target for child in ast.iter_child_nodes(node)):
            return node
    return root


def _syntax_msg(e: Exception) -> str:
    return f"{e.msg}, line {e.lineno}" if isinstance(e, SyntaxError) else str(e)
