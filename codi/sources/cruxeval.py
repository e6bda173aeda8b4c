"""CRUXEval-style records (Gu et al. 2024, hf `cruxeval-org/cruxeval`): one call of `f` each.

    from codi.sources.registry import load_samples
    load = load_samples("cruxeval", cfg, path="data/raw/cruxeval.jsonl")   # or "hf:cruxeval-org/cruxeval:test"

A record is `{"code", "input", "output", "id"}`: `code` defines `f`, `input` is the text of its
arguments, `output` the repr of its result. Call = `f(<input>)`, expected = `output`; the
sample is `cruxeval/<id>/0` (one call per program).
"""

from __future__ import annotations

import ast
from typing import Any

from codi.sources.asserts import Harvest, defined_functions
from codi.sources.base import Sample, normalize_program

NAME = "cruxeval"
ENTRY = "f"
FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "code": ((str,), True),
    "input": ((str,), True),
    "output": ((str,), True),
    "id": ((str, int), True),
}


def harvest(rec: dict[str, Any]) -> Harvest:
    """The sample of one validated CRUXEval record."""
    out = Harvest()
    program = normalize_program(rec["code"])
    call = f"{ENTRY}({rec['input'].strip()})"
    try:
        node = ast.parse(call, mode="eval").body
    except (SyntaxError, ValueError) as e:
        out.skipped.append(f"input: {rec['input']!r} is not an argument list ({_msg(e)})")
        return out
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        out.skipped.append(f"input: {rec['input']!r} is not an argument list")
        return out
    if ENTRY not in defined_functions(program):
        out.skipped.append(f"code: defines no function `{ENTRY}`")
        return out
    expected: str | None = rec["output"].strip()
    why = ""
    try:
        ast.parse(expected, mode="eval")
    except (SyntaxError, ValueError) as e:
        expected, why = None, f"output does not parse as an expression ({_msg(e)})"
    problem = f"{NAME}/{rec['id']}"
    sample = Sample(sample_id=f"{problem}/0", source=NAME, problem_id=problem, program=program,
                    call=ast.unparse(node), expected=expected)
    out.samples.append(sample)
    if why:
        out.unchecked[sample.sample_id] = why
    return out


def _msg(e: Exception) -> str:
    return e.msg if isinstance(e, SyntaxError) else str(e)
