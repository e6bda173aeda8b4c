"""The synthetic generator: deterministic, valid, small, varied."""

import ast
import hashlib
import re
import statistics
import subprocess
import sys
import time
from collections import Counter

import pytest

from codi.infra.config import ConfigError, params_from_dict
from codi.schemas.extract import SyntheticConfig
from codi.sources import synthetic
from codi.sources.synthetic import MAX_LINES, generate, generate_programs
from codi.sources.synthetic_templates import TEMPLATES, Draft, Template

N = 300
ALL_OPERATORS = ["+", "-", "*", "//", "%", "max", "min", "abs"]


def _cfg(difficulty=2, n=N, calls=2, seed=0, **knobs):
    """The generator over its whole space: every operator, inputs up to 20, free names (unless `knobs` say)."""
    fields = dict(n_programs=n, calls_per_program=calls, difficulty=difficulty, max_int=20, canonical_names=False,
                  operators=ALL_OPERATORS, templates=[], chain_steps=[2, 4], value_range=[-999, 999], add_max=9, seed=seed)
    return SyntheticConfig(**{**fields, **knobs})


@pytest.fixture(scope="module", params=[1, 2, 3])
def programs(request):
    return request.param, generate_programs(_cfg(request.param))


def _digest(cfg):
    text = "\x00".join(f"{s.sample_id}\x01{s.program}\x01{s.call}\x01{s.expected}" for s in generate(cfg))
    return hashlib.sha256(text.encode()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_programs():
    assert _digest(_cfg(3, n=100)) == _digest(_cfg(3, n=100))
    a, b = generate_programs(_cfg(3, n=100)), generate_programs(_cfg(3, n=100, seed=1))
    assert len({p.program for p in a} & {p.program for p in b}) < 5


def test_the_first_programs_do_not_depend_on_n_programs():
    assert generate_programs(_cfg(3, n=40)) == generate_programs(_cfg(3, n=100))[:40]


def test_determinism_across_processes_and_hash_seeds():
    code = ("from codi.schemas.extract import SyntheticConfig; from codi.sources.synthetic import generate; import hashlib;"
            "s = generate(SyntheticConfig(n_programs=60, calls_per_program=2, difficulty=3, max_int=20, "
            f"canonical_names=False, operators={ALL_OPERATORS!r}, templates=[], chain_steps=[2, 4], "
            "value_range=[-999, 999], add_max=9, seed=7));"
            "print(hashlib.sha256(repr(s).encode()).hexdigest())")
    outs = {subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed}, capture_output=True,
                           text=True, check=True).stdout for seed in ("1", "2")}
    assert len(outs) == 1


def test_samples_and_ids():
    samples = generate(_cfg(2, n=50, calls=3))
    assert [s.sample_id for s in samples] == [f"synthetic/{i}/{k}" for i in range(50) for k in range(3)]
    assert all(s.problem_id == s.sample_id.rsplit("/", 1)[0] and s.source == "synthetic" for s in samples)
    levels = {p.index: p.level for p in generate_programs(_cfg(2, n=50, calls=3))}  # each sample: its template's level
    assert [s.difficulty for s in samples] == [levels[i] for i in range(50) for _ in range(3)]
    assert {s.difficulty for s in samples} == {1, 2}
    for i in range(50):  # fresh inputs for every call of a program
        assert len({s.call for s in samples[3 * i:3 * i + 3]}) == 3


def test_every_program_compiles_and_runs_plainly(programs):
    difficulty, progs = programs
    start = time.perf_counter()
    for p in progs:
        namespace: dict = {}
        exec(compile(p.program, "<test>", "exec"), namespace)  # noqa: S102 - our own generated code
        for call, expected in p.calls:
            assert repr(eval(call, namespace)) == expected, (p.program, call)  # noqa: S307
    assert time.perf_counter() - start < 2.0  # 600 calls: each well under a few milliseconds


def _frames(program, call):
    """call + line + return events of the program's own frames, as the tracer records them."""
    namespace: dict = {}
    exec(compile(program, "<count>", "exec"), namespace)  # noqa: S102
    n = 0

    def local(frame, event, arg):
        nonlocal n
        n += 1
        return local

    sys.settrace(lambda frame, event, arg: local(frame, event, arg) if frame.f_code.co_filename == "<count>" else None)
    try:
        eval(call, namespace)  # noqa: S307
    finally:
        sys.settrace(None)
    return n


def test_shape_statistics(programs):
    difficulty, progs = programs
    lines = [p.n_lines for p in progs]
    assert len({p.program for p in progs}) == N
    assert all(3 <= n <= MAX_LINES for n in lines) and 4 <= statistics.mean(lines) <= 9
    frames = [_frames(p.program, c) for p in progs for c, _ in p.calls]
    assert max(frames) <= 50 and sum(f <= 40 for f in frames) / len(frames) >= 0.95
    levels = {t.name for t in TEMPLATES if t.by_level and t.level <= difficulty}
    counts = Counter(p.template for p in progs)
    assert set(counts) == levels  # every template of the difficulty is used
    assert max(counts.values()) < 3 * N / len(levels)  # and none dominates
    assert all(p.level <= difficulty for p in progs)


def test_difficulty_features():
    easy = generate_programs(_cfg(1))
    assert not any(re.search(r"\b(for|while)\b", p.program) for p in easy)
    assert all(p.program.count("def ") == 1 for p in easy)
    assert sum(" if " in p.program or "if " in p.program for p in easy) > N / 2
    mid = " ".join(p.program for p in generate_programs(_cfg(2)))
    for feature in ("for ", "while ", ".append(", "[::", "sum(", "len(", ".upper()", ".get(", "[-1]", '""'):
        assert feature in mid, feature
    hard = generate_programs(_cfg(3))
    recursive = [p for p in hard if any(p.program.count(f"{name}(") >= 2 for name in _defs(p.program))]
    nested = [p for p in hard if re.search(r"\n {8}for ", p.program)]
    assert len(recursive) > N / 20 and len(nested) > N / 20


def _defs(program):
    return re.findall(r"^def (\w+)\(", program, re.M)


def test_variety_beyond_the_templates():
    progs = generate_programs(_cfg(3, n=1000))
    # the skeleton of a program: its text with names and numbers abstracted away
    skeletons = {re.sub(r"\b[a-z_]\w*\b", "N", re.sub(r"\d+", "0", p.program)) for p in progs}
    assert len(skeletons) > 300
    assert len({p.entry for p in progs}) >= 15
    assert Counter(p.entry for p in progs)["f"] < 300  # most programs are not named f
    results = [r for p in progs for _, r in p.calls]
    kinds = Counter(type(eval(r)).__name__ for r in results)  # noqa: S307 - reprs of small values
    assert {"int", "str", "list", "dict"} <= set(kinds) and kinds["int"] < 0.8 * len(results)


def _only(monkeypatch, lines, draw):
    template = Template("tiny", 1, lambda rng: Draft(lines, "f", [draw]))
    monkeypatch.setattr(synthetic, "TEMPLATES", (template,))


def test_a_template_with_too_few_inputs_is_a_clear_error(monkeypatch):
    _only(monkeypatch, ["def f(x):", "    y = x + 1", "    return y"], lambda rng: rng.randint(0, 2))
    assert len(generate(_cfg(1, n=1, calls=3))) == 3
    with pytest.raises(RuntimeError, match="calls_per_program = 4 may exceed the input variety"):
        generate(_cfg(1, n=1, calls=4))


def test_programs_that_fail_grow_or_never_vary_are_refused(monkeypatch):
    bodies = {
        "raises": ["def f(x):", "    y = [x]", "    return y[3]"],
        "constant": ["def f(x):", "    y = x * 0", "    return y"],
        "too long": ["def f(x):", "    while x < 10 ** 6:", "        x = x + 1", "    return x"],
        "too big": ["def f(x):", "    y = x + 5000", "    return y - 5000"],
    }
    for why, lines in bodies.items():
        _only(monkeypatch, lines, lambda rng: rng.randint(0, 20))
        with pytest.raises(RuntimeError, match="no valid program"):
            generate(_cfg(1, n=1))


# ------------------------------------------------------------------------------- the knobs
_OPERATOR_PATTERNS = {"+": r" \+ ", "-": r" - ", "*": r" \* ", "//": r" // ", "%": r" % ", "max": r"\bmax\(",
                      "min": r"\bmin\(", "abs": r"\babs\("}


def _operators_in(program: str) -> set[str]:
    body = program.split("\n", 1)[1]  # past the def line (defaults never hold operators here)
    body = re.sub(r"abs\((\w+) - (\w+)\)", r"abs(\1, \2)", body)  # abs of a difference is one operation
    return {op for op, pat in _OPERATOR_PATTERNS.items() if re.search(pat, body)}


@pytest.mark.parametrize("op", list(_OPERATOR_PATTERNS))
def test_level_1_programs_use_exactly_the_allowed_operator(op):
    """Level 1 draws every operation through Gen.arith / Gen.cond: one allowed operator, only it."""
    progs = generate_programs(_cfg(n=120, difficulty=1, operators=[op], seed=1))
    seen = [_operators_in(p.program) for p in progs]
    assert all(s <= {op} for s in seen), [p.program for p, s in zip(progs, seen) if not s <= {op}][:2]
    assert sum(op in s for s in seen) >= 0.8 * len(progs)


def test_level_3_programs_draw_only_allowed_operators():
    """Loops, lists, recursion: the drawn operations follow the knob; only the templates' fixed structure
    (counters, accumulators, recursion steps: + and -; an index taken `% len(...)`) is outside it."""
    progs = generate_programs(_cfg(n=400, difficulty=3, operators=["+", "-"], seed=2))
    for p in progs:
        text = re.sub(r" % len\(", " mod_len(", p.program)
        assert _operators_in(text) <= {"+", "-"}, p.program
    assert {p.template for p in progs} == {t.name for t in TEMPLATES if t.by_level}


def test_max_int_bounds_the_free_integer_arguments():
    import ast
    progs = generate_programs(_cfg(n=200, difficulty=1, max_int=3, seed=3))
    args = [a for p in progs for call, _ in p.calls for a in ast.literal_eval(call[call.index("("):].replace("(", "[", 1)[:-1] + "]")]
    assert args and all(isinstance(a, int) and 0 <= a <= 3 for a in args)
    assert set(args) == {0, 1, 2, 3}


def test_canonical_names_are_a_b_c_in_order_and_the_entry_is_f():
    progs = generate_programs(_cfg(n=100, difficulty=1, canonical_names=True, seed=4))
    for p in progs:
        header = p.program.splitlines()[0]
        assert header.startswith("def f("), header
        params = header[len("def f("):header.index(")")].split(", ")
        assert params == list("abcd")[:len(params)], header
    free = generate_programs(_cfg(n=100, difficulty=1, canonical_names=False, seed=4))
    assert len({p.program.splitlines()[0] for p in free}) > 10


# ------------------------------------------------------------------ the task ladder's knobs (docs/RESULTS.md, "Research III")
def test_the_ladder_knobs_at_their_neutral_values_draw_the_programs_of_before():
    """templates [], chain_steps [2, 4], value_range [-999, 999] are the generator before the knobs existed:
    these digests were taken from that code (commit 844e0f3), so every earlier experiment's task is still drawn."""
    for difficulty, ops, digest in ((1, ["+", "-", "max", "min"], "b48c4d837cc3ef3e"),
                                    (3, ALL_OPERATORS, "4e39ac35bd71a5d0"), (2, ["max", "min"], "59781c4d910b4e7f")):
        cfg = _cfg(difficulty, n=400, max_int=9, canonical_names=True, operators=ops)
        assert hashlib.sha256(repr(generate(cfg)).encode()).hexdigest()[:16] == digest, difficulty


def test_template_names_in_the_schema_are_the_templates():
    from codi.schemas.extract import SYNTHETIC_TEMPLATES
    from codi.sources.synthetic_templates import TEMPLATE_NAMES
    assert SYNTHETIC_TEMPLATES == TEMPLATE_NAMES


def test_templates_pick_the_families_and_chain_is_drawn_only_by_name():
    assert "chain" not in {p.template for p in generate_programs(_cfg(3, n=300))}
    progs = generate_programs(_cfg(1, n=60, templates=["chain", "ternary"]))
    assert {p.template for p in progs} == {"chain", "ternary"}
    with pytest.raises(ConfigError, match="templates names 'for_range', a level-2 template, above .*difficulty = 1"):
        generate_programs(_cfg(1, n=5, templates=["for_range"]))


def _assignments(program):
    return [line.strip() for line in program.splitlines()[1:] if " = " in line]


@pytest.mark.parametrize("steps", [[2, 2], [3, 3], [6, 8]])
def test_chain_is_that_many_dependent_steps_on_one_accumulator(steps):
    progs = generate_programs(_cfg(1, n=80, templates=["chain"], chain_steps=steps, canonical_names=True,
                                   operators=["+", "-", "max", "min"], max_int=9, value_range=[0, 9]))
    for p in progs:
        lines = _assignments(p.program)
        assert steps[0] <= len(lines) <= steps[1], p.program
        assert p.program.startswith("def f(a, b):") and all(line.startswith("c = ") for line in lines)
        assert all(re.search(r"\bc\b", line.split(" = ", 1)[1]) for line in lines[1:]), p.program  # reads c
        assert p.program.rstrip().endswith("return c")
    assert {len(_assignments(p.program)) for p in progs} == set(range(steps[0], steps[1] + 1))


def test_arith_chain_lines_follow_chain_steps():
    progs = generate_programs(_cfg(1, n=60, templates=["arith_chain"], chain_steps=[5, 5]))
    assert all(len(_assignments(p.program)) == 5 for p in progs)


def _ints_seen(program, call):
    """Every int any local holds at any event of the program's frames, and the result."""
    namespace: dict = {}
    exec(compile(program, "<ints>", "exec"), namespace)  # noqa: S102
    seen = []

    def local(frame, event, arg):
        seen.extend(v for v in frame.f_locals.values() if isinstance(v, int) and not isinstance(v, bool))
        return local

    sys.settrace(lambda frame, event, arg: local(frame, event, arg) if frame.f_code.co_filename == "<ints>" else None)
    try:
        result = eval(call, namespace)  # noqa: S307
    finally:
        sys.settrace(None)
    return seen + [result]


def test_value_range_bounds_every_integer_of_every_call():
    cfg = _cfg(1, n=100, operators=["+", "-", "max", "min"], max_int=9, value_range=[0, 9])
    progs = generate_programs(cfg)
    values = [v for p in progs for call, _ in p.calls for v in _ints_seen(p.program, call)]
    assert values and all(0 <= v <= 9 for v in values)
    assert set(values) == set(range(10))
    wide = [v for p in generate_programs(_cfg(1, n=100, operators=["+", "-", "max", "min"], max_int=9))
            for call, _ in p.calls for v in _ints_seen(p.program, call)]
    assert min(wide) < 0 and max(wide) > 9  # without the bound, the same task leaves 0..9


def test_copy_lines_copy_and_compute_nothing():
    progs = generate_programs(_cfg(1, n=60, templates=["arith_chain"], operators=["copy"], canonical_names=True,
                                   max_int=9))
    for p in progs:
        assert all(re.fullmatch(r"\w+ = \w+", line) for line in _assignments(p.program)), p.program
        assert re.search(r"return \w+\n?$", p.program)
        for call, result in p.calls:  # the result is one of the arguments
            assert int(result) in ast.literal_eval(call[call.index("("):].replace("(", "[", 1)[:-1] + "]")


@pytest.mark.parametrize("key,value,msg", [("chain_steps", [3], r"chain_steps = \[3\]: expected \[lo, hi\]"),
                                           ("chain_steps", [4, 2], "expected"), ("chain_steps", [0, 2], "1 <= lo"),
                                           ("value_range", [0, 1000], "<= 999"),
                                           ("templates", ["loop"], "bad: 'loop'"), ("operators", ["/"], "bad: '/'")])
def test_bad_ladder_knobs_name_their_key(key, value, msg):
    from tests.tiny import tiny_params
    raw = tiny_params(extract={"synthetic": {key: value}})
    with pytest.raises(ConfigError, match=msg):
        params_from_dict(raw)
