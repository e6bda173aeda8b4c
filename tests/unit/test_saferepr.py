"""codi/tracing/saferepr.py: exact (cut) reprs of builtin values, bounded cost, guarded __repr__."""

from __future__ import annotations

import array
import builtins
import collections
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codi.tracing.format import REPR_CUT
from codi.tracing.saferepr import normalise_addresses, saferepr


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - len(REPR_CUT)] + REPR_CUT


scalars = st.one_of(
    st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(), st.text(max_size=20),
    st.binary(max_size=10), st.complex_numbers(allow_nan=False, allow_infinity=False),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.tuples(inner), st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.integers(), st.text(max_size=5)), inner, max_size=4),
        st.frozensets(st.integers(), max_size=4), st.sets(st.text(max_size=4), max_size=4),
        st.lists(inner, max_size=4).map(collections.deque),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=4).map(collections.Counter),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(collections.OrderedDict),
        st.dictionaries(st.integers(), inner, max_size=3).map(lambda d: collections.defaultdict(list, d)),
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(values, st.integers(8, 200))
def test_builtin_values_give_their_repr_cut_to_the_limit(value, limit: int) -> None:
    assert saferepr(value, limit) == cut(repr(value), limit)


P = collections.namedtuple("P", "x y")


class L2(list):
    pass


class S2(set):
    pass


class I2(int):
    pass


def _self_referencing():
    lst: list = [1]
    lst.append(lst)
    d: dict = {}
    d["me"] = d
    dd = collections.defaultdict(list)
    dd["me"] = dd
    od = collections.OrderedDict(a=1)
    od["me"] = od
    t_in = [0]
    t = (t_in,)
    t_in.append(t)
    return [lst, d, dd, od, t]


@pytest.mark.parametrize("value", [
    "it's", 'say "hi"', "both ' and \"", b"it's", bytearray(b"a\x00'\""), "\ud800 lone surrogate",
    2 ** 200, -(2 ** 70), I2(5), L2([1, 2]), S2(), S2({3}), frozenset(), set(), (), (1,),
    collections.deque([1, 2], maxlen=5), collections.OrderedDict(), collections.Counter(),
    collections.Counter("abracadabra"), P(1, "y"), {1: 2}.keys(), {1: 2}.values(), {1: "a"}.items(),
    array.array("i", [1, 2, 3]), array.array("u", "hé'"), array.array("d"), ValueError("bad"),
    KeyError(1, 2), OSError(2, "missing"), Ellipsis, range(3), *_self_referencing(),
], ids=repr)
@pytest.mark.parametrize("limit", [8, 13, 40, 500])
def test_known_types_match_python(value, limit: int) -> None:
    assert saferepr(value, limit) == cut(repr(value), limit)


@pytest.mark.parametrize("make", [
    lambda: "x" * 10_000_000,
    lambda: b"\x00" * 10_000_000,
    lambda: list(range(10_000_000)),
    lambda: set(range(1_000_000)),
    lambda: {i: i for i in range(1_000_000)},
    lambda: collections.Counter(range(1_000_000)),
    lambda: 7 ** 300_000,
], ids=["str", "bytes", "list", "set", "dict", "Counter", "int"])
def test_huge_values_are_fast_and_bounded(make) -> None:
    value = make()
    t0 = time.perf_counter()
    text = saferepr(value, 120)
    assert time.perf_counter() - t0 < 0.5
    assert len(text) <= 120
    assert text.endswith(REPR_CUT) or text.startswith("<int of")


def test_deep_nesting_is_walked_without_recursion() -> None:
    deep: list = []
    for _ in range(200_000):
        deep = [deep]
    t0 = time.perf_counter()
    assert saferepr(deep, 50) == "[" * 45 + REPR_CUT
    # a budget far past the recursion limit still never recurses: the walk keeps its own stack
    assert saferepr(deep, 20_000) == "[" * (20_000 - len(REPR_CUT)) + REPR_CUT
    assert time.perf_counter() - t0 < 2.0


class Raises:
    def __repr__(self):
        raise ValueError("no")


class NotStr:
    def __repr__(self):
        return 42


class Exits:
    def __repr__(self):
        raise SystemExit(3)


class Plain:
    pass


def test_user_repr_is_guarded() -> None:
    assert saferepr(Raises(), 100) == "<repr error: ValueError>"
    assert saferepr(NotStr(), 100) == "<repr error: TypeError>"
    assert saferepr(Exits(), 100) == "<repr error: SystemExit>"
    assert saferepr([1, Raises()], 100) == "[1, <repr error: ValueError>]"


def test_addresses_are_normalised() -> None:
    assert saferepr(Plain(), 200) == f"<{__name__}.Plain object at 0x?>"
    assert saferepr([len, test_user_repr_is_guarded], 300) == (
        "[<built-in function len>, <function test_user_repr_is_guarded at 0x?>]")
    assert normalise_addresses("<a at 0x7f3a12 at 0x at 0xZZ>") == "<a at 0x? at 0x at 0xZZ>"
    # a string's content is never rewritten
    assert saferepr("at 0x1234", 100) == "'at 0x1234'"


def test_user_repr_with_a_lone_surrogate_becomes_valid_utf8() -> None:
    class Sur:
        def __repr__(self):
            return "a\ud800b"

    text = saferepr(Sur(), 100)
    text.encode("utf-8")
    assert text == "a\\ud800b"


def test_rebinding_builtins_does_not_reach_saferepr() -> None:
    saved = builtins.len, builtins.repr
    try:
        builtins.len = lambda x: 0
        builtins.repr = lambda x: "lie"
        got = saferepr(["ab", 1], 100)
    finally:
        builtins.len, builtins.repr = saved
    assert got == "['ab', 1]"
