"""Which source files a stage runs: the static import closure of its module inside the codi package.

    files = stage_code_files("codi.stages.sft")   # codi/__main__.py, codi/__init__.py, ..., codi/stages/sft.py
    digest = code_digest(files)                   # {"codi/stages/sft.py": sha256, ...}

The closure follows every import statement of a file, function-local ones included (a superset of
what one run executes, never less), except those under `if TYPE_CHECKING:`. A module that imports plug-ins
by name at run time says so with `PLUGIN_PACKAGE = "<package>"`: every module of that package is then in its
closure (codi.sources.registry). dvc.yaml's code deps must cover it (tests/unit/test_dvc_deps.py) and a
training run's checkpoint fingerprint holds its digest, so an edit reruns and retrains.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from codi.infra.files import file_sha256

PACKAGE = "codi"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # codi/
REPO_ROOT = PACKAGE_DIR.parent


def module_file(name: str) -> Path | None:
    """The source file of module `name` of the package (a package's __init__.py), or None."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = PACKAGE_DIR.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported_modules(name: str, path: Path) -> set[str]:
    """Every module of the package that a statement of `path` (module `name`) imports, with its parents."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    found.update(_plugin_modules(tree))
    for node in _executed_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = _package_of(name, path).split(".")
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    closed = set()
    for mod in found:
        parts = mod.split(".")
        closed.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))  # a parent package runs first
    return {m for m in closed if module_file(m) is not None}


def _plugin_modules(tree: ast.Module) -> set[str]:
    """Every module of the package a top-level `PLUGIN_PACKAGE = "<package>"` names (none without one)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PLUGIN_PACKAGE"
                                                for t in node.targets):
            package = ast.literal_eval(node.value)
            init = module_file(package)
            if init is None or init.name != "__init__.py":
                raise ValueError(f"PLUGIN_PACKAGE = {package!r}: not a package of {PACKAGE}")
            return {package} | {f"{package}.{p.stem}" for p in init.parent.glob("*.py") if p.name != "__init__.py"}
    return set()


def _executed_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:` (imports for type checkers only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_closure(modules: Iterable[str]) -> list[Path]:
    """Source files of `modules` and of every package module they import, transitively; sorted."""
    todo = list(modules)
    seen: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = module_file(name)
        if path is None:
            raise ValueError(f"{name}: not a module of the {PACKAGE} package (looked in {PACKAGE_DIR})")
        seen[name] = path
        todo.extend(imported_modules(name, path) - set(seen))
    return sorted(set(seen.values()))


def stage_code_files(stage_module: str) -> list[Path]:
    """The files a `python -m codi <stage>` run imports: the entry point's closure and the stage module's."""
    return import_closure([f"{PACKAGE}.__main__", stage_module])


def code_digest(files: Iterable[Path]) -> dict[str, str]:
    """{path relative to the repository: sha256} of `files`."""
    return {p.relative_to(REPO_ROOT).as_posix(): file_sha256(p) for p in sorted(files)}
