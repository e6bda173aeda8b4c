"""The data sources: one module each, found by name (docs/ARCHITECTURE.md, "Adding a source").

    from codi.sources import source_names
    source_names()          # ('cruxeval', 'humaneval', 'mbpp', 'pyx', 'synthetic')

A module of this package is a source when it sets `NAME = "<its own module name>"`; codi.sources.registry
imports it by that name. The helpers (base, asserts, registry, synthetic_templates) set no NAME.
"""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

_NAME_LINE = re.compile(r'^NAME = "([a-z_][a-z0-9_]*)"', re.M)


def source_names() -> tuple[str, ...]:
    """Every source of the package, sorted. Read from the files, not imported: the params schemas check
    source names with it and do not depend on the sources' code."""
    names = []
    for info in pkgutil.iter_modules(__path__):
        path = Path(getattr(info.module_finder, "path", "")) / f"{info.name}.py"
        if not info.ispkg and path.is_file():
            m = _NAME_LINE.search(path.read_text(encoding="utf-8"))
            if m and m.group(1) == info.name:
                names.append(info.name)
    return tuple(sorted(names))
