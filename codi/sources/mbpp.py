"""MBPP (Austin et al. 2021): one sample per test assert of a task.

    from codi.sources.registry import load_samples
    load = load_samples("mbpp", cfg, path="data/raw/mbpp.jsonl")   # or "hf:google-research-datasets/mbpp"

A record is `{"task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list"}` (the
"sanitized" variant's `prompt` and `test_imports` are read too). The program is `code`; `test_imports` and
`test_setup_code` become `setup`, run after the program; `test_list` then `challenge_test_list` asserts
become samples `mbpp/<task_id>/<k>` (assert shapes: codi.sources.asserts).
"""

from __future__ import annotations

from typing import Any

from codi.sources.asserts import Harvest, NoCall, defined_functions, parse_assert_text
from codi.sources.base import Sample, normalize_program

NAME = "mbpp"
# field -> (accepted types, required), checked by the registry before `harvest` runs (a list: of strings)
FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "task_id": ((int, str), True),
    "code": ((str,), True),
    "test_list": ((list,), True),
    "test_setup_code": ((str,), False),
    "challenge_test_list": ((list,), False),
    "test_imports": ((list,), False),
}


def harvest(rec: dict[str, Any]) -> Harvest:
    """The samples of one validated MBPP record."""
    out = Harvest()
    problem = f"{NAME}/{rec['task_id']}"
    program = normalize_program(rec["code"])
    setup_parts = [*rec.get("test_imports", []), rec.get("test_setup_code", "")]
    setup_text = "\n".join(p for p in setup_parts if p.strip())
    setup = normalize_program(setup_text) if setup_text else ""
    callees = {name: name for name in defined_functions(program)}
    tests = [("test_list", i, t) for i, t in enumerate(rec["test_list"])]
    tests += [("challenge_test_list", i, t) for i, t in enumerate(rec.get("challenge_test_list", []))]
    for k, (key, i, text) in enumerate(tests):
        try:
            parsed = parse_assert_text(text, callees)
        except NoCall as e:
            out.skipped.append(f"{key}[{i}]: {e}")
            continue
        sample_id = f"{problem}/{k}"
        out.samples.append(Sample(sample_id=sample_id, source=NAME, problem_id=problem, program=program,
                                  call=parsed.call, expected=parsed.expected, setup=setup))
        if parsed.expected is None:
            out.unchecked[sample_id] = parsed.why
    return out
