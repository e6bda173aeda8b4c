"""SemCoder's PyX (Ding et al. 2024, hf `semcoder/PyX`): the execution-reasoning records.

    from codi.sources.registry import load_samples
    load = load_samples("pyx", cfg, path="data/raw/pyx.jsonl")      # or "hf:semcoder/PyX"

A record is `{"nl", "fwd_mnl", "bwd_mnl", "response"}` with exactly one of the first three non-empty:
`fwd_mnl` (output prediction) takes the call from the task and the expected value from the answer,
`bwd_mnl` (input deduction) the call from the answer and the expected value from the task; `nl` (code
generation) is skipped. Ids hash the normalised program. Formats: docs/design/sources.md, "Sources".
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Callable
from functools import partial
from typing import Any

from codi.sources.asserts import AssertCall, Harvest, NoCall, defined_functions, parse_assert_text
from codi.sources.base import Sample, normalize_program

NAME = "pyx"
FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "nl": ((str,), True),
    "fwd_mnl": ((str,), True),
    "bwd_mnl": ((str,), True),
    "response": ((str,), True),
}
TASK_FIELDS = ("nl", "fwd_mnl", "bwd_mnl")
_BLOCK = re.compile(r"\[PYTHON\](.*?)\[/PYTHON\]", re.S)
_ANSWER = re.compile(r"\[ANSWER\](.*?)\[/ANSWER\]", re.S)
_ASSERT_LINE = re.compile(r"^assert\b", re.M)
_HOLE = "__pyx_hole__"  # stands for "??" so that the task's assert parses


def check_record(rec: dict[str, Any]) -> str | None:
    """What makes a record malformed beyond field types (None = fine): the one-task rule."""
    filled = [k for k in TASK_FIELDS if rec[k].strip()]
    if len(filled) != 1:
        return (f"fields {', '.join(TASK_FIELDS)}: expected exactly one non-empty, "
                f"got {len(filled)} ({', '.join(filled) or 'none'})")
    return None


def harvester() -> Callable[[dict[str, Any]], Harvest]:
    """The harvest function of one file (the registry calls this when a source defines it): it numbers the
    records of each program across the file."""
    return partial(harvest, counters={})


def harvest(rec: dict[str, Any], counters: dict[str, int]) -> Harvest:
    """The sample of one validated PyX record; `counters` (one dict per file) numbers each problem's samples."""
    out = Harvest()
    task = next(k for k in TASK_FIELDS if rec[k].strip())  # one, by check_record
    if task == "nl":
        out.skipped.append("nl: a code-generation record has no call to trace")
        return out
    try:
        program, hole_assert = _split_block(rec[task])
        callees = {n: n for n in defined_functions(program)}
        sample = _forward(hole_assert, rec["response"], callees) if task == "fwd_mnl" \
            else _backward(hole_assert, rec["response"], callees)
    except NoCall as e:
        out.skipped.append(f"{task}: {e}")
        return out
    digest = hashlib.sha1(program.encode()).hexdigest()[:12]
    problem = f"{NAME}/{digest}"
    k = counters.get(problem, 0)
    counters[problem] = k + 1
    sample_id = f"{problem}/{k}"
    out.samples.append(Sample(sample_id=sample_id, source=NAME, problem_id=problem, program=program,
                              call=sample.call, expected=sample.expected))
    if sample.expected is None:
        out.unchecked[sample_id] = sample.why
    return out


def _split_block(task_text: str) -> tuple[str, str]:
    """(program, the task's final assert with ?? replaced) of a [PYTHON] block."""
    block = _BLOCK.search(task_text)
    if block is None:
        raise NoCall("no [PYTHON]...[/PYTHON] block")
    body = block.group(1)
    starts = [m.start() for m in _ASSERT_LINE.finditer(body)]
    if not starts:
        raise NoCall("the [PYTHON] block ends in no assert")
    program, assert_text = body[:starts[-1]], body[starts[-1]:]
    if not program.strip():
        raise NoCall("the [PYTHON] block holds no program before its assert")
    return normalize_program(program.lstrip("\n")), assert_text.replace("??", _HOLE)


def _answer(response: str, callees: dict[str, str]) -> AssertCall | None:
    found = _ANSWER.findall(response)
    if not found:
        return None
    try:
        return parse_assert_text(found[-1], callees)
    except NoCall:
        return None


def _forward(hole_assert: str, response: str, callees: dict[str, str]) -> AssertCall:
    task = parse_assert_text(hole_assert, callees)
    if task.expected != _HOLE:
        raise NoCall("forward task is not `assert g(x) == ??`")
    answer = _answer(response, callees)
    if answer is None:
        return AssertCall(task.call, None, "the response has no parsable [ANSWER] assert")
    if answer.expected is None or _dump(answer.call) != _dump(task.call):
        return AssertCall(task.call, None, "the [ANSWER] does not give the task call's output")
    return AssertCall(task.call, answer.expected)


def _backward(hole_assert: str, response: str, callees: dict[str, str]) -> AssertCall:
    task = parse_assert_text(hole_assert, callees)
    if _HOLE not in task.call or task.expected is None:
        raise NoCall("backward task is not `assert g(??) == y`")
    answer = _answer(response, callees)
    if answer is None or _HOLE in answer.call:
        raise NoCall("backward record: the response has no [ANSWER] assert with an input")
    if _callee(answer.call) != _callee(task.call):
        raise NoCall("backward record: the [ANSWER] calls another function than the task")
    return AssertCall(answer.call, task.expected)


def _dump(expr: str) -> str:
    return ast.dump(ast.parse(expr, mode="eval"))


def _callee(call: str) -> str:
    node = ast.parse(call, mode="eval").body
    return ast.unparse(node.func) if isinstance(node, ast.Call) else ""
