"""What a source yields: `Sample`s, one per traced call, and the errors a bad dataset raises."""

from __future__ import annotations

from dataclasses import dataclass

from codi.infra.config import UserError


class DatasetError(UserError):
    """A malformed dataset line or file; the message names the file, the line and the field."""


@dataclass(frozen=True)
class Sample:
    """One call of an entry function defined in a program: the unit that is traced.

    `call` is a plain call expression of a function the program defines (`f(1, [2, 3])`); its
    arguments are evaluated untraced, then the call itself runs under the tracer. `expected` is a
    Python expression of the expected return value when the source gives one (an assert's right
    side, CRUXEval's output), compared by value inside the sandbox."""

    sample_id: str        # unique over all sources, e.g. "mbpp/11/0"
    source: str           # "synthetic", "humaneval", "mbpp", "pyx", "cruxeval"
    problem_id: str       # the split key: every call of one program shares it, e.g. "mbpp/11"
    program: str          # source code, "\n" line endings, ending in exactly one "\n"
    call: str             # e.g. "f(1, 3)"
    expected: str | None = None
    setup: str = ""       # code run after the program and before the call (MBPP test_setup_code)
    difficulty: int = 0   # a graded source's level (synthetic: its template's, 1-3); 0 = ungraded


def normalize_program(code: str) -> str:
    """"\\n" line endings, tabs kept, exactly one trailing newline."""
    return code.replace("\r\n", "\n").replace("\r", "\n").rstrip("\n").rstrip() + "\n"
