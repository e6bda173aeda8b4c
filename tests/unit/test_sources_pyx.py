"""PyX: forward records give (call, output), backward records (answer's input, task's output).

`pyx.jsonl` follows the record layout of SemCoder's own code (src/dataset.py: exactly one of
nl / fwd_mnl / bwd_mnl is non-empty; experiments/cruxeval_prompts.py: the `[PYTHON] ...
assert g(x) == ?? [/PYTHON]` task and the `[ANSWER] ... [/ANSWER]` answer); the records are
crafted, the layout is theirs.
"""

import dataclasses
import hashlib
from pathlib import Path

import pytest

from codi.sources.base import DatasetError
from codi.sources.registry import load_samples
from tests.tiny import shipped

FIX = Path(__file__).parents[1] / "fixtures" / "sources"
CFG = shipped("extract")
SUM_EVEN = ("def sum_even(nums):\n    total = 0\n    for n in nums:\n        if n % 2 == 0:\n"
            "            total += n\n    return total\n")


def _load():
    return load_samples("pyx", CFG, str(FIX / "pyx.jsonl"))


def test_forward_and_backward_records_of_one_program_share_a_problem():
    load = _load()
    problem = "pyx/" + hashlib.sha1(SUM_EVEN.encode()).hexdigest()[:12]
    mine = [s for s in load.samples if s.problem_id == problem]
    assert [(s.sample_id, s.call, s.expected) for s in mine] == [
        (f"{problem}/0", "sum_even([1, 2, 3, 4])", "6"),   # forward: the answer's output
        (f"{problem}/1", "sum_even([5, 8])", "8"),
        (f"{problem}/2", "sum_even([2, 4])", "6"),         # backward: the answer's input, the task's output
        (f"{problem}/3", "sum_even([])", None),            # forward without an answer
        (f"{problem}/4", "sum_even([2])", None),           # the answer is about another call
    ]
    assert all(s.program == SUM_EVEN and s.source == "pyx" and s.setup == "" for s in mine)
    assert load.unchecked[f"{problem}/3"] == "the response has no parsable [ANSWER] assert"
    assert load.unchecked[f"{problem}/4"] == "the [ANSWER] does not give the task call's output"


def test_other_entries_helpers_and_syntax_errors():
    by_call = {s.call: s for s in _load().samples}
    assert by_call["shout('hi')"].expected == "'HI!'"
    assert by_call["shout('hi')"].program.startswith("def shout(s)\n")  # does not parse: still a sample
    helper = by_call["join_words([' A', 'Bc '])"]
    assert helper.expected == "'a-bc'" and helper.program.startswith("from typing import List\n\ndef clean(")
    namespace: dict = {}
    exec(helper.program, namespace)  # noqa: S102 - our own fixture
    assert eval(helper.call, namespace) == eval(helper.expected)  # noqa: S307


def test_records_without_a_call_are_skipped_with_the_reason():
    path = str(FIX / "pyx.jsonl")
    assert [(s.where, s.why) for s in _load().skipped] == [
        (f"{path}:1", "nl: a code-generation record has no call to trace"),
        (f"{path}:7", "bwd_mnl: backward record: the response has no [ANSWER] assert with an input"),
        (f"{path}:10", "fwd_mnl: no [PYTHON]...[/PYTHON] block"),
    ]


def test_malformed_records():
    path = str(FIX / "pyx_bad.jsonl")
    with pytest.raises(DatasetError, match=rf"^{path}:2: fields nl, fwd_mnl, bwd_mnl: expected exactly one non-empty, got 2"):
        load_samples("pyx", CFG, path)
    load = load_samples("pyx", dataclasses.replace(CFG, skip_bad_lines=True), path)
    assert len(load.samples) == 1 and load.n_bad_lines == 5
    assert [s.why.split(":")[0] for s in load.skipped] == [
        "fields nl, fwd_mnl, bwd_mnl", "fields nl, fwd_mnl, bwd_mnl", "missing field 'response'",
        "field 'response'", "bad JSON"]
    assert load.skipped[3].why == "field 'response': expected a string, got list ['r']"
