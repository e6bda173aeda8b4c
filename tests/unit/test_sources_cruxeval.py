"""CRUXEval-style records: call f(<input>), expected <output>; bad inputs are skipped."""

import dataclasses
from pathlib import Path

import pytest

from codi.sources.base import DatasetError
from codi.sources.registry import load_samples
from tests.tiny import shipped

FIX = Path(__file__).parents[1] / "fixtures" / "sources"
CFG = shipped("extract")


def test_samples():
    path = str(FIX / "cruxeval.jsonl")
    load = load_samples("cruxeval", CFG, path)
    got = {s.sample_id: (s.problem_id, s.call, s.expected) for s in load.samples}
    assert got == {
        "cruxeval/sample_0/0": ("cruxeval/sample_0", "f([1, 1, 3])", "[(2, 1), (2, 1), (1, 3)]"),
        "cruxeval/sample_1/0": ("cruxeval/sample_1", "f('banana', 'a')", "6"),
        "cruxeval/sample_2/0": ("cruxeval/sample_2", "f({'a': 1})", "{'a': 1, 'k': 1}"),
        "cruxeval/sample_3/0": ("cruxeval/sample_3", "f(1)", "2"),       # program does not parse: still a sample
        "cruxeval/sample_7/0": ("cruxeval/sample_7", "f(1)", None),      # output is no Python expression
    }
    assert load.unchecked == {"cruxeval/sample_7/0": "output does not parse as an expression (invalid syntax)"}
    assert [(s.where, s.why.split(":")[0]) for s in load.skipped] == [
        (f"{path}:5", "code"), (f"{path}:6", "input"), (f"{path}:7", "input")]
    assert load.skipped[1].why == "input: '1), print(2' is not an argument list"  # no smuggled second call
    for s in load.samples[:3]:
        namespace: dict = {}
        exec(s.program, namespace)  # noqa: S102 - our own fixture
        assert eval(s.call, namespace) == eval(s.expected)  # noqa: S307


def test_malformed_records():
    path = str(FIX / "cruxeval_bad.jsonl")
    with pytest.raises(DatasetError, match=rf"^{path}:2: missing field 'output'$"):
        load_samples("cruxeval", CFG, path)
    load = load_samples("cruxeval", dataclasses.replace(CFG, skip_bad_lines=True), path)
    assert [s.sample_id for s in load.samples] == ["cruxeval/sample_1/0"]
    assert [(s.where.rsplit(":", 1)[1], s.bad_line) for s in load.skipped] == [("2", True), ("3", True), ("4", True)]
    assert load.skipped[1].why == "field 'input': expected a string, got int 1"
    assert load.skipped[2].why.startswith("sample id cruxeval/sample_1/0 was already made by")


def test_f_bound_at_module_level_is_a_sample(tmp_path):
    """The contract is that `f(input)` can be called: `f = solve` (or a lambda, or a wrapper) binds it."""
    import json
    records = [
        {"id": 0, "code": "def solve(x):\n    return x + 1\nf = solve\n", "input": "1", "output": "2"},
        {"id": 1, "code": "f = lambda x: x * 2\n", "input": "3", "output": "6"},
        {"id": 2, "code": "import functools\ndef g(n):\n    return n\nf = functools.lru_cache(None)(g)\n",
         "input": "4", "output": "4"},
        {"id": 3, "code": "def solve(x):\n    return x\nf = 3\n", "input": "1", "output": "1"},
    ]
    path = tmp_path / "bound.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    load = load_samples("cruxeval", CFG, str(path))
    assert [s.sample_id for s in load.samples] == ["cruxeval/0/0", "cruxeval/1/0", "cruxeval/2/0"]
    assert [(s.where, s.why) for s in load.skipped] == [(f"{path}:4", "code: defines no function `f`")]
