"""MBPP: one sample per assert, setup after code, malformed lines named by file, line and field.

Fixtures: `mbpp.jsonl` holds 10 real records of the original MBPP jsonl (tasks 1, 2, 3, 11, 17, 20,
25, 367, 600, 912); `mbpp_shapes.jsonl` crafted assert shapes; `mbpp_bad.jsonl` malformed lines.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from codi.sources.base import DatasetError
from codi.sources.registry import load_samples
from tests.tiny import shipped

FIX = Path(__file__).parents[1] / "fixtures" / "sources"
CFG = shipped("extract")
SKIP = dataclasses.replace(CFG, skip_bad_lines=True)


def _real():
    return load_samples("mbpp", CFG, str(FIX / "mbpp.jsonl"))


def test_every_assert_of_the_real_records_becomes_a_sample():
    records = [json.loads(line) for line in (FIX / "mbpp.jsonl").read_text().splitlines()]
    load = _real()
    n_asserts = sum(len(r["test_list"]) + len(r["challenge_test_list"]) for r in records)
    assert len(load.samples) == n_asserts and not load.skipped
    assert {s.problem_id for s in load.samples} == {f"mbpp/{r['task_id']}" for r in records}
    assert len({s.sample_id for s in load.samples}) == n_asserts
    # only task 912's `int(lobb_num(...)) == y` has no exact expected value
    assert load.unchecked == {f"mbpp/912/{k}": "result compared through int(...)" for k in range(3)}


def test_sample_fields_follow_the_record():
    by_id = {s.sample_id: s for s in _real().samples}
    s = by_id["mbpp/17/1"]
    assert (s.source, s.problem_id, s.call, s.expected, s.setup) == ("mbpp", "mbpp/17", "square_perimeter(5)", "20", "")
    assert s.program == "def square_perimeter(a):\n  perimeter=4*a\n  return perimeter\n"  # \r\n normalised
    # challenge asserts follow test_list: task 20 has 3 + 3
    assert [k for k in by_id if k.startswith("mbpp/20/")] == [f"mbpp/20/{k}" for k in range(6)]
    assert by_id["mbpp/20/3"].call == "is_woodall(32212254719)"
    # test_setup_code becomes setup; it uses the program's class, so it must run after it
    tree = by_id["mbpp/367/0"]
    assert tree.setup.startswith("root = Node(1)") and "class Node" in tree.program
    assert tree.call == "is_tree_balanced(root)" and tree.expected == "False"


def test_samples_are_faithful_when_run():
    # the fixture holds MBPP's own reference solutions: trusted code, run plainly here
    for s in _real().samples:
        namespace: dict = {}
        exec(s.program, namespace)  # noqa: S102
        exec(s.setup, namespace)    # noqa: S102
        result = eval(s.call, namespace)  # noqa: S307
        if s.expected is not None:
            assert result == eval(s.expected, namespace), s.sample_id  # noqa: S307


def test_assert_shapes():
    load = load_samples("mbpp", CFG, str(FIX / "mbpp_shapes.jsonl"))
    by_id = {s.sample_id: s for s in load.samples}
    assert by_id["mbpp/9001/1"].expected == "[6]" and by_id["mbpp/9001/2"].expected == "[6]"
    assert load.unchecked["mbpp/9001/0"] == "result compared through set(...)"
    assert load.unchecked["mbpp/9002/0"] == "approximate comparison (isclose)"
    assert load.unchecked["mbpp/9003/0"] == "truthy assert: no expected value"
    assert by_id["mbpp/9003/2"].expected == "True"
    assert by_id["mbpp/9005/0"].program == "def broken(x)\n    return x\n"  # a syntax error is the tracer's to report
    assert by_id["mbpp/9006/1"].setup == "box = Box(4)\n"
    assert by_id["mbpp/9007/0"].setup == "import math\n"  # sanitized MBPP's test_imports
    skipped = {(s.where.rsplit(":", 1)[1], s.why) for s in load.skipped}
    assert skipped == {
        ("4", "test_list[0]: the assert calls no function of the program (`twice`)"),
        ("4", "test_list[3]: not a single assert statement"),
        ("4", "test_list[4]: the assert does not parse ('(' was never closed, line 1)"),
        ("6", "test_list[0]: the assert calls no function of the program (`unbox`)"),  # Box(3).v: a class, not a function
    }
    assert not any(s.bad_line for s in load.skipped)


def test_a_bad_line_fails_with_file_line_and_reason():
    path = str(FIX / "mbpp_bad.jsonl")
    with pytest.raises(DatasetError, match=rf"^{path}:2: bad JSON: "):
        load_samples("mbpp", CFG, path)


BAD_LINES = {
    2: "bad JSON: Expecting ',' delimiter",
    3: "missing field 'code'",
    4: "field 'code': expected a string, got int 42",
    5: "field 'test_list': expected a list of strings, got a list holding int 7",
    6: "expected a JSON object per line, got list",
    8: "sample id mbpp/17/0 was already made by",
}


def test_bad_lines_are_counted_skips_under_skip_bad_lines():
    path = str(FIX / "mbpp_bad.jsonl")
    load = load_samples("mbpp", SKIP, path)
    assert load.n_bad_lines == len(BAD_LINES) == len(load.skipped)
    for skip in load.skipped:
        line = int(skip.where.rsplit(":", 1)[1])
        assert skip.where == f"{path}:{line}" and skip.why.startswith(BAD_LINES[line]), skip
    assert sorted({s.problem_id for s in load.samples}) == ["mbpp/17", "mbpp/8005"]


@pytest.mark.parametrize("line, message", [(l, m) for l, m in BAD_LINES.items() if l != 2])
def test_each_bad_line_alone_raises(tmp_path, line, message):
    lines = (FIX / "mbpp_bad.jsonl").read_text().splitlines()
    keep = [lines[0], lines[line - 1]] if line == 8 else [lines[line - 1]]
    path = tmp_path / "one.jsonl"
    path.write_text("\n".join(keep) + "\n")
    with pytest.raises(DatasetError, match=rf"^{path}:{len(keep)}: " + message.replace("(", r"\(")):
        load_samples("mbpp", CFG, str(path))
