"""Program templates of the synthetic source (`codi.sources.synthetic` draws and checks them).

A template is a function `build(g: Gen) -> Draft`: the program's lines, the entry function and one input
drawer per parameter. Each is a family, not a text: names, constants, operators, comparison directions
and optional statements are drawn. Each line does one small thing to the locals, so a trace is a chain of
local, learnable steps. `SyntheticConfig.operators` governs every drawn operation (`Gen.arith`, the parity
tests of `Gen.cond`, `Gen.pick`), not a template's fixed structure (a loop counter's `+ 1`).
Values and levels: docs/design/sources.md, "Sources".
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Input = Callable[[random.Random], Any]

ENTRY_NAMES = ("f", "f", "f", "g", "h", "calc", "compute", "solve", "process", "run", "combine",
               "transform", "score", "walk", "mix", "fold", "scan", "step")
HELPER_NAMES = ("helper", "aux", "inc", "sq", "twice", "clip", "bump", "adjust", "tweak", "norm", "part")
REC_NAMES = ("rec", "go", "dig", "down", "reduce_r", "walk_r", "count_r", "build")
VAR_NAMES = ("a", "b", "c", "d", "e", "k", "m", "n", "p", "q", "r", "s", "t", "u", "v", "w", "x", "y",
             "z", "acc", "tot", "res", "val", "cur", "tmp", "cnt", "out", "num", "best", "prev",
             "left", "right", "base", "mark", "item", "pos", "lo", "hi", "j", "i")
LOOP_NAMES = ("i", "j", "k", "x", "v", "n", "idx", "item", "el", "ch", "c")
LETTERS = "abcdeimnorstxyz"
# What SyntheticConfig.operators may name; "copy" is a line that copies one name's value (`c = b`).
OPERATORS = ("+", "-", "*", "//", "%", "max", "min", "abs", "copy")


@dataclass(frozen=True)
class Draft:
    """A drawn program: source lines, the entry function, an input drawer per parameter."""

    lines: list[str]
    entry: str
    inputs: list[Input]


@dataclass(frozen=True)
class Template:
    name: str
    level: int
    build: Callable[["Gen"], Draft]
    by_level: bool = True  # drawn by `difficulty` alone; False: only when SyntheticConfig.templates names it


def small_int(lo: int = 0, hi: int = 20) -> Input:
    return lambda rng: rng.randint(lo, hi)


def int_list(lo: int = 0, hi: int = 9, min_len: int = 2, max_len: int = 5) -> Input:
    return lambda rng: [rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))]


def word(min_len: int = 1, max_len: int = 5) -> Input:
    return lambda rng: "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))


class Gen:
    """Drawing helpers bound to one program: fresh names and one-operation expressions."""

    def __init__(self, rng: random.Random, max_int: int = 20, canonical_names: bool = False,
                 operators: tuple[str, ...] = OPERATORS, chain_steps: tuple[int, int] = (2, 4),
                 add_max: int = 9) -> None:
        self.rng = rng
        self.operators = operators
        self.max_int = max_int
        self.canonical_names = canonical_names
        self.chain_steps = chain_steps
        self.add_max = add_max
        self.used: set[str] = set()

    def fresh(self, pool: tuple[str, ...] = VAR_NAMES) -> str:
        """A name from `pool` not used yet in this program (from VAR_NAMES once `pool` is used up):
        random, or with `canonical_names` the first free one in pool order (a, b, c, ...; entry f)."""
        free = [n for n in pool if n not in self.used] or [n for n in VAR_NAMES if n not in self.used]
        name = free[0] if self.canonical_names else self.rng.choice(free)
        self.used.add(name)
        return name

    def small_int(self) -> Input:
        """A free integer argument: 0..max_int (SyntheticConfig.max_int)."""
        return small_int(0, self.max_int)

    def steps(self) -> int:
        """How many assignment lines a straight-line template writes (SyntheticConfig.chain_steps)."""
        return self.rng.randint(*self.chain_steps)

    def names(self, n: int, pool: tuple[str, ...] = VAR_NAMES) -> list[str]:
        return [self.fresh(pool) for _ in range(n)]

    def c(self, lo: int = 1, hi: int = 9) -> int:
        return self.rng.randint(lo, hi)

    def arith(self, a: str, b: str | None = None, both: bool = False) -> str:
        """One integer operation on `a` (and `b`; with `both`, certainly on both), among `operators`.

        Every operator but `copy` has a form with a constant and a form with two names (`abs` of a
        difference), so any non-empty `operators` fits every call; `copy` (the value of `a` or `b`, no
        operation) reads one name, so with only `copy` allowed `both` cannot hold and is dropped."""
        if both and b is not None and set(self.operators) == {"copy"}:
            both = False
        forms = [] if both and b is not None else [("copy", a)] + [
            ("+", f"{a} + {self.c(1, self.add_max)}"), ("-", f"{a} - {self.c(1, self.add_max)}"), ("*", f"{a} * {self.c(2, 3)}"),
            ("//", f"{a} // {self.c(2, 3)}"), ("%", f"{a} % {self.c(2, 7)}"), ("max", f"max({a}, {self.c()})"),
            ("min", f"min({a}, {self.c()})"), ("abs", f"abs({a} - {self.c()})")]
        if b is not None:
            forms += [] if both else [("copy", b)]
            forms += [("+", f"{a} + {b}"), ("-", f"{a} - {b}"), ("-", f"{b} - {a}"), ("*", f"{a} * {b}"),
                      ("//", f"{a} // {b}"), ("max", f"max({a}, {b})"), ("min", f"min({a}, {b})"),
                      ("abs", f"abs({a} - {b})"), ("%", f"{a} % {b}")]  # / 0: that call is drawn again
        return self.rng.choice([text for op, text in forms if op in self.operators])

    def pick(self, forms: list[tuple[str, str]]) -> str:
        """One of a template's own (operator, text) forms whose operator is allowed; "" = no operator.
        The template lists at least one form for every operator, or an operator-free one."""
        allowed = [text for op, text in forms if op == "" or op in self.operators]
        if not allowed:
            raise AssertionError(f"template forms {forms} have none among operators {self.operators}")
        return self.rng.choice(allowed)

    def cond(self, a: str, b: str | None = None, hi: int = 9) -> str:
        """One comparison of `a` (with `b`, or a constant up to `hi`: the range `a` lives in); the
        parity tests only when `%` is among `operators`."""
        forms = [("", f"{a} > {self.c(0, hi - 1)}"), ("", f"{a} < {self.c(1, hi)}"), ("%", f"{a} % 2 == 0"),
                 ("%", f"{a} % 2 == 1"), ("%", f"{a} % 3 == 0"), ("", f"{a} >= {self.c(1, hi)}"),
                 ("", f"{a} != {self.c(0, hi)}")]
        if b is not None:
            forms += [("", f"{a} > {b}"), ("", f"{a} < {b}"), ("", f"{a} >= {b}"), ("", f"{a} == {b}"),
                      ("", f"{a} != {b}")]
        return self.pick(forms)

    def maybe(self, p: float = 0.5) -> bool:
        return self.rng.random() < p


def func(name: str, params: list[str], body: list[str]) -> list[str]:
    """A def with `body` (lines already indented relative to the body) indented under it."""
    return [f"def {name}({', '.join(params)}):"] + ["    " + line for line in body]


# ------------------------------------------------------------------ level 1: straight line + branch
def arith_chain(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    params = g.names(rng.randint(1, 3))
    known, body = list(params), []
    for _ in range(g.steps()):
        a, b = rng.choice(known), rng.choice(known)
        v = g.fresh()
        body.append(f"{v} = {g.arith(a, b if b != a else None)}")
        known.append(v)
    body.append(f"return {g.arith(known[-1], known[-2], both=True)}" if g.maybe() else f"return {known[-1]}")
    return Draft(func(name, params, body), name, [g.small_int()] * len(params))


def chain(g: Gen) -> Draft:
    """Dependent steps on one accumulator: every line reads the value the line before it wrote, so a call
    of k lines is k steps in sequence (the ladder's steps axis), and the locals stay three names wide."""
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    a, b, acc = g.names(3)
    body = [f"{acc} = {g.arith(a, b)}"]
    for _ in range(g.steps() - 1):
        body.append(f"{acc} = {g.arith(acc, rng.choice([a, b]))}")
    body.append(f"return {acc}")
    return Draft(func(name, [a, b], body), name, [g.small_int(), g.small_int()])


def chain_const(g: Gen) -> Draft:
    """Dependent steps on one argument with constants only (`b = a + 3`, `b = max(b, 6)`): each line reads
    the one value the line before it wrote and a constant of its own text, so a step looks up one value
    and the locals are two names wide."""
    name = g.fresh(ENTRY_NAMES)
    a, acc = g.names(2)
    body = [f"{acc} = {g.arith(a)}"] + [f"{acc} = {g.arith(acc)}" for _ in range(g.steps() - 1)]
    body.append(f"return {acc}")
    return Draft(func(name, [a], body), name, [g.small_int()])


def chain_fresh(g: Gen) -> Draft:
    """chain_const with a fresh name per step (`b = a + 3`, `c = max(b, 6)`, `d = c - 1`): each line reads the
    value the line before it wrote and a constant, and starts with a name no other line writes, so which line
    runs next is never in doubt; the locals grow by one name a step."""
    name = g.fresh(ENTRY_NAMES)
    names = g.names(g.steps() + 1)
    body = [f"{v} = {g.arith(u)}" for u, v in zip(names, names[1:])]
    body.append(f"return {names[-1]}")
    return Draft(func(name, names[:1], body), name, [g.small_int()])


def chain_branch(g: Gen) -> Draft:
    """chain_const with a branch on the carried value at each step (`if b > 4:` / `    b = b - 2`): which line
    runs next depends on the value the line before computed, so a model that does not carry the value cannot
    write the next action line (research IV, lever e: control flow puts the value into the trace's own CE)."""
    name = g.fresh(ENTRY_NAMES)
    a, acc = g.names(2)
    body = [f"{acc} = {g.arith(a)}"]
    for _ in range(g.steps() - 1):
        body += [f"if {g.cond(acc)}:", f"    {acc} = {g.arith(acc)}"]
    body.append(f"return {acc}")
    return Draft(func(name, [a], body), name, [g.small_int()])


def branch(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    a, b, v = g.names(3)
    body = [f"{v} = {g.arith(a, b)}", f"if {g.cond(v, rng.choice([a, b, None]))}:",
            f"    {v} = {g.arith(v, rng.choice([a, b]))}"]
    if g.maybe(0.4):
        body += [f"elif {g.cond(v, rng.choice([a, b]))}:", f"    {v} = {g.arith(v)}"]
    if g.maybe(0.7):
        body += ["else:", f"    {v} = {g.arith(v, rng.choice([a, b]))}"]
    body.append(f"return {g.arith(v, rng.choice([a, b]))}" if g.maybe() else f"return {v}")
    return Draft(func(name, [a, b], body), name, [g.small_int(), g.small_int()])


def early_return(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    params = g.names(rng.randint(2, 3))
    t = g.fresh()
    body = [f"{t} = {g.arith(params[0], params[1])}", f"if {g.cond(t, rng.choice(params))}:",
            f"    return {g.arith(t, rng.choice(params))}"]
    if g.maybe(0.5):
        body += [f"if {g.cond(rng.choice(params), t)}:", f"    return {g.arith(rng.choice(params), t)}"]
    body.append(f"return {g.arith(t, rng.choice(params))}")
    return Draft(func(name, params, body), name, [g.small_int()] * len(params))


def ternary(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    a, b, m, w = g.names(4)
    body = [f"{m} = {a} if {g.cond(a, b)} else {b}", f"{w} = {g.arith(m, rng.choice([a, b]))}",
            f"return {g.arith(w, m, both=True)}"]
    if g.maybe(0.5):
        body.insert(1, f"{m} = {g.arith(m)}")
    return Draft(func(name, [a, b], body), name, [g.small_int(), g.small_int()])


# ------------------------------------------------ level 2: loops, lists, strings, dicts, helpers
def for_range(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    n, a, acc = g.names(3)
    i = g.fresh(LOOP_NAMES)
    header = rng.choice([f"for {i} in range({n}):", f"for {i} in range(1, {n} + 1):",
                         f"for {i} in range({n}, 0, -1):"])
    body = [f"{acc} = {rng.choice([a, str(g.c(0, 3))])}", header]
    update = f"{acc} = {g.arith(acc, i, both=True)}"  # each iteration uses its index
    if g.maybe(0.5):
        body += [f"    if {g.cond(i, rng.choice([a, None]), hi=5)}:", f"        {update}"]
    else:
        body.append(f"    {update}")
    body.append(f"return {g.arith(acc, a)}" if g.maybe(0.4) else f"return {acc}")
    return Draft(func(name, [n, a], body), name, [small_int(2, 6), small_int(0, 9)])


def while_loop(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    x, k, cnt = g.names(3)
    if g.maybe():
        body = [f"{cnt} = 0", f"while {x} > {g.c(0, 4)}:", f"    {x} = {x} - {k}", f"    {cnt} = {cnt} + 1"]
        inputs = [small_int(6, 20), small_int(3, 6)]
    else:
        body = [f"{cnt} = {g.c(0, 2)}", f"while {cnt} < {x}:", f"    {cnt} = {g.pick([('*', f'{cnt} * 2 + {k}'), ('', f'{cnt} + {k} + 1')])}"]
        inputs = [small_int(4, 20), small_int(0, 3)]
    if g.maybe(0.5):
        body.insert(3, f"    {k} = {k} + {g.c(1, 2)}")  # inside the loop, in both forms
    body.append(f"return {g.arith(cnt, x)}")
    return Draft(func(name, [x, k], body), name, inputs)


def list_accumulate(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    xs, acc = g.names(2)
    v = g.fresh(LOOP_NAMES)
    body = [f"{acc} = {g.c(0, 2)}", f"for {v} in {xs}:", f"    if {g.cond(v, rng.choice([acc, None]))}:",
            f"        {acc} = {g.arith(acc, v, both=True)}"]
    if g.maybe(0.6):
        body += ["    else:", f"        {acc} = {g.arith(acc)}"]
    body.append(f"return {acc}")
    return Draft(func(name, [xs], body), name, [int_list()])


def list_build(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    xs, k, out = g.names(3)
    v = g.fresh(LOOP_NAMES)
    body = [f"{out} = []", f"for {v} in {xs}:"]
    if g.maybe(0.6):
        body += [f"    if {g.cond(v, k)}:", f"        {out}.append({g.arith(v, k)})"]
    else:
        body.append(f"    {out}.append({g.arith(v, k)})")
    body.append(rng.choice([f"return {out}", f"return {out} + [len({out})]", f"return {out}[::-1]",
                            f"return {out}[1:]"]))
    return Draft(func(name, [xs, k], body), name, [int_list(), small_int(0, 9)])


def list_ops(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    xs, k, a, ys, s = g.names(5)
    body = [f"{a} = {g.arith(f'{xs}[0]', f'{xs}[-1]', both=True)}",
            f"{ys} = {rng.choice([f'{xs}[1:]', f'{xs}[:{k}]', f'{xs}[::2]', f'{xs}[{k}:]', f'{xs}[:-1]'])}",
            f"{s} = {rng.choice([f'sum({ys})', f'len({ys})', f'sum({ys}) + len({xs})'])}"]
    if g.maybe(0.5):
        body.append(f"{ys}.append({g.arith(a, s)})")
    body.append(rng.choice([f"return {g.arith(s, a)}", f"return [{a}, {s}]", f"return {ys}",
                            f"return {ys}[{k} % len({ys})] if {ys} else {a}"]))
    return Draft(func(name, [xs, k], body), name, [int_list(0, 9, 2, 5), small_int(0, 3)])


def string_loop(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    s, out = g.names(2)
    ch = g.fresh(("ch", "c", "x", "letter", "el"))
    test = rng.choice([f'{ch} in "{"".join(sorted(rng.sample(LETTERS, 4)))}"', f'{ch} < "{rng.choice("fgmnr")}"',
                       f"{ch} == {s}[0]", f'{ch} != "{rng.choice(LETTERS)}"'])
    then = rng.choice([f"{out} = {out} + {ch}.upper()", f"{out} = {ch} + {out}", f"{out} = {out} + {ch} + {ch}"])
    other = rng.choice([f"{out} = {out} + {ch}", f'{out} = {out} + "{rng.choice("-_.")}"', f"{out} = {ch} + {out}"])
    body = [f'{out} = ""', f"for {ch} in {s}:", f"    if {test}:", f"        {then}", "    else:",
            f"        {other}", rng.choice([f"return {out}", f"return {out} + str(len({out}))"])]
    return Draft(func(name, [s], body), name, [word(2, 4)])


def string_ops(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    s, n, t, u = g.names(4)
    body = [f"{t} = {rng.choice([f'{s} + {s}[0]', f'{s}[::-1]', f'{s} + {s}[-1]', f'{s}[1:] + {s}[0]'])}",
            f"{u} = {rng.choice([f'{t}.upper()', f'{t}[:{n}]', f'{t}[{n}:]', f'{t} + {t}[{n} % len({t})]'])}"]
    if g.maybe(0.5):
        body.append(f"{u} = {rng.choice([f'{u}.lower()', f'{u} + {s}', f'{u}[::-1]'])}")
    body.append(rng.choice([f"return {u} + str(len({t}))", f"return {u}", f"return len({u}) + {n}",
                            f"return {u}[0] + {t}[-1] if {u} else {t}"]))
    return Draft(func(name, [s, n], body), name, [word(1, 4), small_int(0, 3)])


def dict_count(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    xs, d = g.names(2)
    v = g.fresh(LOOP_NAMES)
    weighted = g.maybe(0.25)  # add the item itself: needs int items
    inc = v if weighted else rng.choice(["1", "1", str(g.c(2, 3))])
    body = [f"{d} = {{}}", f"for {v} in {xs}:", f"    {d}[{v}] = {d}.get({v}, 0) + {inc}",
            rng.choice([f"return {d}", f"return len({d})", f"return {d}.get({xs}[0], 0) + len({d})"])]
    items = int_list(0, 3, 3, 5) if weighted or g.maybe() else word(3, 5)
    return Draft(func(name, [xs], body), name, [items])


def dict_map(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    s, d = g.names(2)
    i = g.fresh(("i", "j", "k", "idx", "pos"))
    value = g.pick([("", i), ("*", f"{i} * 2"), ("+", f"{i} + 1"), ("", f"{s}[{i}].upper()")])
    body = [f"{d} = {{}}", f"for {i} in range(len({s})):", f"    {d}[{s}[{i}]] = {value}",
            rng.choice([f"return {d}", f'return {d}.get("{rng.choice(LETTERS)}", -1)', f"return len({d}) + len({s})"])]
    return Draft(func(name, [s], body), name, [word(2, 5)])


def helper_call(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    helper = g.fresh(HELPER_NAMES)
    hv = g.fresh()
    if g.maybe():
        hbody = [f"return {g.arith(hv)}"]
    else:
        hbody = [f"if {g.cond(hv)}:", f"    return {g.arith(hv)}", f"return {g.arith(hv)}"]
    if g.maybe():
        xs, acc = g.names(2)
        v = g.fresh(LOOP_NAMES)
        body = [f"{acc} = 0", f"for {v} in {xs}:", f"    {acc} = {acc} + {helper}({v})", f"return {acc}"]
        params, inputs = [xs], [int_list(0, 9, 2, 4)]
    else:
        x, y, a, b = g.names(4)
        body = [f"{a} = {helper}({x})", f"{b} = {helper}({g.arith(a, y, both=True)})",
                f"return {g.arith(a, b, both=True)}"]
        params, inputs = [x, y], [g.small_int(), small_int(0, 9)]
    lines = func(helper, [hv], hbody) + [""] + func(name, params, body)
    return Draft(lines, name, inputs)


def scan_best(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    xs, best, pos = g.names(3)
    i = g.fresh(("i", "j", "k", "idx"))
    op = rng.choice([">", "<", ">=", "<="])
    body = [f"{best} = {xs}[0]", f"{pos} = 0", f"for {i} in range(1, len({xs})):",
            f"    if {xs}[{i}] {op} {best}:", f"        {best} = {xs}[{i}]", f"        {pos} = {i}",
            g.pick([("", f"return [{best}, {pos}]"), ("*", f"return {best} * 10 + {pos}"), ("", f"return {pos}")])]
    return Draft(func(name, [xs], body), name, [int_list(0, 9, 3, 5)])


# ------------------------------------------------------------- level 3: recursion, nested loops
def recursion_int(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    rec = g.fresh(REC_NAMES)
    n = g.fresh(("n", "k", "m", "x", "depth"))
    base = g.c(0, 1)
    # "" = no drawn operator: the recursion's own accumulation
    step = g.pick([("+", f"{n} + {rec}({n} - 1)"), ("*", f"{n} * {rec}({n} - 1)"),
                   ("", f"{rec}({n} - 1) + {g.c(1, 4)}"), ("-", f"{n} - {rec}({n} - 1)"),
                   ("%", f"{rec}({n} - 1) + {n} % {g.c(2, 3)}")])
    # a product needs a base case >= 1, or every call returns 0
    bottom = str(g.c(1, 2)) if "*" in step else rng.choice([str(g.c(0, 2)), n])
    rbody = [f"if {n} <= {base}:", f"    return {bottom}", f"return {step}"]
    a, v = g.names(2)
    body = [f"{v} = {rec}({a})", f"return {g.arith(v, a, both=True)}"]
    lines = func(rec, [n], rbody) + [""] + func(name, [a], body)
    return Draft(lines, name, [small_int(1, 5)])


def recursion_list(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(REC_NAMES + ENTRY_NAMES[:3])
    xs = g.fresh(("xs", "items", "vals", "nums", "lst"))
    v = f"{xs}[0]"
    rest = f"{name}({xs}[1:])"
    kind = rng.choice([0, 1, 2] if {"max", "min"} & set(g.operators) else [0, 2])
    if kind == 0:
        rbody = [f"if not {xs}:", "    return 0", f"return {g.arith(v)} + {rest}"]
    elif kind == 1:
        rbody = [f"if len({xs}) == 1:", f"    return {v}", f"return {g.pick([('max', f'max({v}, {rest})'), ('min', f'min({v}, {rest})')])}"]
    else:
        rbody = [f"if not {xs}:", "    return 0", f"if {g.cond(v)}:", f"    return 1 + {rest}", f"return {rest}"]
    return Draft(func(name, [xs], rbody), name, [int_list(0, 9, 1, 4)])


def recursion_str(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(REC_NAMES + ENTRY_NAMES[:3])
    s = g.fresh(("s", "w", "text", "word"))
    step = rng.choice([f"{name}({s}[1:]) + {s}[0]", f"{s}[-1] + {name}({s}[:-1])",
                       f"{s}[0].upper() + {name}({s}[1:])", f"{name}({s}[1:]) + {s}[0] + {s}[0]",
                       f"{name}({s}[2:]) + {s}[0]", f'{s}[0] + "{rng.choice("-_.")}" + {name}({s}[1:])',
                       f"{name}({s}[1:]) + {s}[0].upper()"])
    cut = rng.choice([f"len({s}) <= 1", f'{s} == ""', f"len({s}) < 2"])
    rbody = [f"if {cut}:", f"    return {rng.choice([s, f'{s}.upper()', s + ' + ' + s])}", f"return {step}"]
    return Draft(func(name, [s], rbody), name, [word(1, 4)])


def nested_range(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    a, b, acc = g.names(3)
    i, j = g.fresh(("i", "x", "r")), g.fresh(("j", "y", "c"))
    term = g.pick([("*", f"{i} * {j}"), ("+", f"{i} + {j}"), ("-", f"{j} - {i}"), ("", "1"), ("max", f"max({i}, {j})"),
                   ("min", f"min({i}, {j})")])
    update = f"{acc} = {acc} + {term}"
    body = [f"{acc} = 0", f"for {i} in range({a}):", f"    for {j} in range({b}):"]
    if g.maybe(0.5):
        body += [f"        if {g.cond(i, j, hi=2)}:", f"            {update}"]
    else:
        body.append(f"        {update}")
    body.append(f"return {acc}")
    return Draft(func(name, [a, b], body), name, [small_int(1, 3), small_int(1, 3)])


def nested_lists(g: Gen) -> Draft:
    rng = g.rng
    name = g.fresh(ENTRY_NAMES)
    xs, ys, out = g.names(3)
    x, y = g.fresh(("x", "a", "p")), g.fresh(("y", "b", "q"))
    if g.maybe():
        body = [f"{out} = 0", f"for {x} in {xs}:", f"    for {y} in {ys}:", f"        if {g.cond(x, y, hi=5)}:",
                f"            {out} = {out} + {g.pick([('', '1'), ('', x), ('', y), ('*', f'{x} * {y}')])}", f"return {out}"]
    else:
        body = [f"{out} = []", f"for {x} in {xs}:", f"    for {y} in {ys}:", f"        if {x} {rng.choice(['<', '>', '=='])} {y}:",
                f"            {out}.append({g.arith(x, y, both=True)})", f"return {out}"]
    return Draft(func(name, [xs, ys], body), name, [int_list(0, 5, 2, 3), int_list(0, 5, 2, 3)])


TEMPLATES: tuple[Template, ...] = (
    Template("arith_chain", 1, arith_chain), Template("branch", 1, branch),
    Template("early_return", 1, early_return), Template("ternary", 1, ternary),
    Template("for_range", 2, for_range), Template("while_loop", 2, while_loop),
    Template("list_accumulate", 2, list_accumulate), Template("list_build", 2, list_build),
    Template("list_ops", 2, list_ops), Template("string_loop", 2, string_loop),
    Template("string_ops", 2, string_ops), Template("dict_count", 2, dict_count),
    Template("dict_map", 2, dict_map), Template("helper_call", 2, helper_call),
    Template("scan_best", 2, scan_best),
    Template("recursion_int", 3, recursion_int), Template("recursion_list", 3, recursion_list),
    Template("recursion_str", 3, recursion_str), Template("nested_range", 3, nested_range),
    Template("nested_lists", 3, nested_lists),
    # Appended, so that drawing among the templates above stays byte-identical: a level-1 template that
    # `difficulty` alone never draws; `SyntheticConfig.templates` names it (the task ladder's rungs).
    Template("chain", 1, chain, by_level=False), Template("chain_const", 1, chain_const, by_level=False),
    Template("chain_fresh", 1, chain_fresh, by_level=False), Template("chain_branch", 1, chain_branch, by_level=False),
)
TEMPLATE_NAMES = tuple(t.name for t in TEMPLATES)
