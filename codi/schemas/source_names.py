"""The names of the data sources, read from codi/sources/ without importing it (a leaf: the params schemas
check `extract.sources` and `precompute.holdout_sources` against it and depend on no source's code).

    from codi.schemas.source_names import source_names
    source_names()          # ('cruxeval', 'humaneval', 'mbpp', 'pyx', 'synthetic')

A module of codi/sources/ is a source when it sets `NAME = "<its own module name>"`; codi.sources.registry
imports it by that name (docs/design/sources.md, "Adding a source"). The helpers (base, asserts, registry,
synthetic_templates) set no NAME.
"""

from __future__ import annotations

import re
from pathlib import Path

# The folders of the codi.sources package (a test adds one, as it adds it to the package's __path__).
SOURCE_DIRS: list[Path] = [Path(__file__).resolve().parent.parent / "sources"]
_NAME_LINE = re.compile(r'^NAME = "([a-z_][a-z0-9_]*)"', re.M)


def source_names() -> tuple[str, ...]:
    """Every source module of codi/sources/, sorted."""
    names = []
    for path in (p for folder in SOURCE_DIRS for p in sorted(Path(folder).glob("*.py"))):
        m = _NAME_LINE.search(path.read_text(encoding="utf-8"))
        if m and m.group(1) == path.stem:
            names.append(path.stem)
    return tuple(sorted(names))
