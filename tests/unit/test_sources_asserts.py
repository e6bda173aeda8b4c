"""Assert parsing: which call an assert makes and when its expected value is exact."""

import ast

import pytest

from codi.sources.asserts import NoCall, defined_functions, parse_assert, parse_assert_text

F = {"f": "f"}


@pytest.mark.parametrize("text, call, expected", [
    ("assert f(1, 2) == 3", "f(1, 2)", "3"),
    ("assert 3 == f(1,2)", "f(1, 2)", "3"),                        # reversed, and canonical spacing
    ("assert (f([1,2])) == [2,1], 'message'", "f([1, 2])", "[2, 1]"),
    ("assert f(\"a\") == 'A'", "f('a')", "'A'"),
    ("assert f(0) is True", "f(0)", "True"),
    ("assert f(0) is None", "f(0)", "None"),
    ("assert f(g(1)) == g(2)", "f(g(1))", "g(2)"),                # other functions are fine on either side
    ("assert f(1) == True", "f(1)", "True"),
])
def test_exact_expectations(text, call, expected):
    got = parse_assert_text(text, F)
    assert (got.call, got.expected, got.why) == (call, expected, "")


@pytest.mark.parametrize("text, call, why", [
    ("assert set(f(1)) == set([1])", "f(1)", "result compared through set(...)"),
    ("assert sorted(f(1)) == [1]", "f(1)", "result compared through sorted(...)"),
    ("assert math.isclose(f(1), 0.5, rel_tol=1e-3)", "f(1)", "approximate comparison (isclose)"),
    ("assert abs(f(1) - 0.5) < 1e-6", "f(1)", "approximate comparison (abs(result - y) < eps)"),
    ("assert f(1)", "f(1)", "truthy assert: no expected value"),
    ("assert not f(1)", "f(1)", "falsy assert (`not`): no expected value"),
    ("assert f(1) != 2", "f(1)", "comparison with `!=`"),
    ("assert f(1) in [1, 2]", "f(1)", "comparison with `in`"),
    ("assert f(1) == 1 == 1", "f(1)", "chained comparison"),
    ("assert f(1) == f(2)", "f(1)", "2 calls of the program in one assert"),
    ("assert f(1)[0] == 2", "f(1)", "result used inside a Subscript expression"),
    ("assert f(1) is not None", "f(1)", "comparison with `is not`"),
])
def test_unexact_asserts_keep_the_call_and_say_why(text, call, why):
    got = parse_assert_text(text, F)
    assert (got.call, got.expected, got.why) == (call, None, why)


@pytest.mark.parametrize("text, why", [
    ("assert g(1) == 2", "calls no function of the program (`f`)"),
    ("assert True", "constant assert (`assert True`) calls nothing"),
    ("f(1)", "not a single assert statement"),
    ("assert f(1) == 1\nassert f(2) == 2", "not a single assert statement"),
    ("assert f(1 ==", "does not parse"),
])
def test_asserts_without_a_call_raise_nocall(text, why):
    with pytest.raises(NoCall, match=why.replace("(", r"\(").replace(")", r"\)")):
        parse_assert_text(text, F)


def test_callee_is_renamed_everywhere_and_the_tree_is_untouched():
    node = ast.parse("assert candidate(candidate(1)) == 3").body[0]
    assert isinstance(node, ast.Assert)
    got = parse_assert(node, {"candidate": "inc"})
    assert (got.call, got.expected) == ("inc(inc(1))", "3")
    assert "candidate" in ast.unparse(node)  # the caller's tree is not renamed in place


def test_defined_functions_parses_or_falls_back_to_a_regex():
    assert defined_functions("def a():\n    def inner(): pass\nclass B: pass\nasync def c(): pass\n") == {"a", "c"}
    assert defined_functions("def broken(x)\n    return x\ndef ok(y):\n    return y\n") == {"broken", "ok"}


def test_defined_functions_include_module_level_bindings_of_a_function():
    program = ("def solve(x):\n    return x\nf = solve\ng = f\nh: object = lambda y: y\n"
               "w = wrap(solve)\nn = 3\nm = n\nclass C:\n    k = solve\n")
    assert defined_functions(program) == {"solve", "f", "g", "h", "w"}
