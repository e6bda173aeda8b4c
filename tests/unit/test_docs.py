"""The README, docs/ and docs/design/ name only things that exist: every repository path (a file of the repository,
or an output dvc.yaml declares), every dotted module name, every `python -m` command and every `make` target they
mention; the README stays short; and docs/ARCHITECTURE.md is a short map with a row for every module."""

from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib.util
import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "design").glob("*.md"))]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("codi", "experiments", "pipelines")
TOP = {"codi", "pipelines", "experiments", "tests", "docs", "benchmarks", "tools", "configs", "data", "models", "metrics", "plots",
       "dvclive", "checkpoints", ".dvc"}
ROOT_FILES = {"dvc.yaml", "dvc.lock", "params.yaml", "Makefile", "pyproject.toml", "constraints.txt", "README.md"}
CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)")
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def text(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


def mentions(doc: Path) -> list[str]:
    """Inline code spans, lines of code blocks and link targets (relative to the repository root)."""
    body = text(doc)
    found = [m.group(1) for m in CODE.finditer(FENCE.sub("", body))]
    found += [line for block in FENCE.findall(body) for line in block.splitlines()]
    found += [str((doc.parent / m.group(1)).resolve().relative_to(ROOT)) for m in LINK.finditer(body)
              if not m.group(1).startswith(("http://", "https://", "mailto:"))]
    return found


def path_candidates(mention: str) -> list[str]:
    out = []
    for word in re.split(r"[\s=()\[\]'\"]+", mention):
        word = word.strip(".,;:`").split("::")[0]
        head = word.split("/")[0]
        if (head in TOP and "/" in word) or word in ROOT_FILES:
            out.append(word)
    return out


def tracked_files() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def declared_outputs() -> list[str]:
    """What a fresh clone lacks but the docs may name: every out, metric and plot of dvc.yaml and every default
    path of `python -m codi` (checkpoints/<stage>, ...), made by `dvc repro`; and data/raw/, where a user puts
    dataset files."""
    from codi.__main__ import COMMANDS

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    found = [path for cmd in COMMANDS.values() for path in cmd.paths.values() if "/" in path] + ["data/raw/*"]
    for stage in stages.values():
        for key in ("outs", "metrics", "plots"):
            for item in stage.get(key, []):
                found.append(next(iter(item)) if isinstance(item, dict) else item)
    return found


def expand(pattern: str) -> list[str]:
    """`a/{b,c}.txt` -> a/b.txt, a/c.txt; `<source>`, `<stage>`, `...`, `*` become wildcards."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m:
        return [p for alt in m.group(1).split(",") for p in expand(pattern[:m.start()] + alt + pattern[m.end():])]
    return [re.sub(r"<[^<>]*>|\.\.\.", "*", pattern)]


def _under(pattern: str, output: str) -> bool:
    """`pattern` names `output` or something inside it (either may hold wildcards)."""
    p, o = pattern.rstrip("/").split("/"), output.rstrip("/").split("/")
    return len(p) >= len(o) and all(fnmatch.fnmatch(a, b) or fnmatch.fnmatch(b, a) for a, b in zip(p, o))


def exists(pattern: str, files: list[str], outputs: list[str]) -> bool:
    for p in expand(pattern):
        p = p.rstrip("/")
        if not (any(fnmatch.fnmatch(f, p) or fnmatch.fnmatch(f, p + "/*") for f in files)
                or any(_under(p, o) or _under(o, p) for o in outputs)):
            return False
    return True


def test_every_named_repository_path_exists():
    files, outputs = tracked_files(), declared_outputs()
    files += [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts
              and p.is_file() and "__pycache__" not in p.parts]  # files of this checkout not yet committed
    missing = sorted({f"{doc.name}: {p}" for doc in DOCS for m in mentions(doc) for p in path_candidates(m)
                      if not exists(p, files, outputs)})
    assert missing == []


def test_named_test_functions_exist():
    missing = []
    for doc in DOCS:
        for file, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", text(doc)):
            path = ROOT / file
            names = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)} \
                if path.is_file() else set()
            if name not in names:
                missing.append(f"{doc.name}: {file}::{name}")
    assert missing == []


def _subcommands(parser: argparse.ArgumentParser) -> set[str]:
    return {name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}


def test_every_python_m_command_exists():
    from codi.__main__ import _parser as codi_parser
    from pipelines.__main__ import _parser as pipelines_parser

    commands = {"codi": _subcommands(codi_parser()), "pipelines": _subcommands(pipelines_parser())}
    missing = []
    for doc in DOCS:
        for module, rest in re.findall(r"python -m ([\w.]+)((?: [\w-]+)?)", text(doc)):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{doc.name}: python -m {module}")
            word = rest.strip()
            if module in commands and word and not word.startswith("-") and word not in commands[module]:
                missing.append(f"{doc.name}: python -m {module} {word}")
    assert missing == []


def test_every_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = {(doc.name, t) for doc in DOCS for m in mentions(doc) for t in re.findall(r"\bmake ([a-z][\w-]*)", m)}
    assert sorted(f"{d}: make {t}" for d, t in named if t not in targets) == []


def test_the_readme_is_short_and_says_how_long_make_run_takes():
    readme = text(ROOT / "README.md")
    assert len(readme.splitlines()) <= 150
    for needed in ("make run", "make test", "dvc repro", "python -m pipelines serve", "dvc exp run -S gamma=2.0",
                   "## Results", "Python 3.11", "Linux", "minutes"):
        assert needed in readme, needed


def test_the_differential_suite_is_described_with_its_size():
    from tests.fixtures.differential_programs import PROGRAMS

    said = {int(n) for doc in DOCS for n in re.findall(r"the (\d+)\s+programs of `tests/fixtures/differential_programs",
                                                        text(doc))}
    assert said == {len(PROGRAMS)}


def test_the_checker_finds_what_is_missing():
    """Guard against a checker that passes everything (a broken pattern would pass every doc)."""
    files, outputs = tracked_files(), declared_outputs()
    assert exists("codi/schemas/options.py", files, outputs) and exists("models/codi/codi_config.json", files, outputs)
    assert exists("checkpoints/<stage>/run.json", files, outputs) and exists("data/cache/{train,val}.arrow", files, outputs)
    for wrong in ("codi/nope.py", "metrics/nope.json", "docs/NOPE.md", "models/nope", "metrics/{eval,nope}.json", "plots/nope.png"):
        assert not exists(wrong, files, outputs), wrong
    assert path_candidates("see `codi/infra/config.py` and dvc.yaml, not codi or the/path") == ["codi/infra/config.py", "dvc.yaml"]
    for stale in ("codi.config", "codi.data.CacheDataset", "codi.modeling.options.CodiOptions", "codi.nope.f"):
        assert dotted_name_problem(stale, {}) is not None, stale
    for fine in ("codi.data.cache.CacheDataset", "codi.modeling.CodiModel", "codi.tracing.worker",
                 "pipelines.dvc.is_transient", "metrics/codi.json"):
        assert dotted_name_problem(fine, {}) is None, fine


DOTTED = re.compile(r"(?<![\w/.-])((?:codi|experiments|pipelines)(?:\.\w+)+)")
FILE_SUFFIXES = (".json", ".py", ".md", ".yaml", ".png", ".arrow", ".parquet", ".pth", ".safetensors", ".csv", ".tsv")


def _module_file(parts: list[str]) -> Path | None:
    p = ROOT.joinpath(*parts)
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    return p / "__init__.py" if (p / "__init__.py").is_file() else None


def _top_level_names(file: Path) -> set[str]:
    """What `module.<name>` can name: top-level defs, classes, assignments and imports; for a lazy package (a
    module `__getattr__`), also the names it holds as strings."""
    source = file.read_text(encoding="utf-8")
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    if "__getattr__" in names:
        names.update(re.findall(r"[\"'](\w+)[\"']", source))
    return names


def dotted_name_problem(name: str, params: dict) -> str | None:
    """Why `codi.x.y` (or experiments..., pipelines...) names nothing, or None: the longest prefix that is a module
    must exist, and the next name must be defined in it. `codi.<key>` of params.yaml's codi section is a params
    key, and a file name (`metrics/codi.json`) is a path: neither is a module name."""
    if name.endswith(FILE_SUFFIXES) or not DOTTED.fullmatch(name):
        return None
    parts = name.split(".")
    if parts[0] == "codi" and parts[1] in (params.get("codi") or {}):
        return None
    n = next((k for k in range(len(parts), 0, -1) if _module_file(parts[:k]) is not None), 0)
    if n == 0:
        return "no such package"
    if n == len(parts):
        return None
    attr = parts[n]
    if n + 1 < len(parts) and attr.islower():
        return f"no module {'.'.join(parts[:n + 1])}"
    if attr not in _top_level_names(_module_file(parts[:n])):
        return f"{'.'.join(parts[:n])} defines no {attr}"
    return None


def test_every_named_module_exists():
    """`codi.data.cache.CacheDataset`, `python -m experiments.ladder`: a module name that a move left behind fails."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    stale = sorted({f"{doc.name}: {m.group(1)}: {why}" for doc in DOCS for mention in mentions(doc)
                    for m in DOTTED.finditer(mention) if (why := dotted_name_problem(m.group(1), params))})
    assert stale == []


def modules() -> list[str]:
    """Every .py module of codi/, experiments/ and pipelines/."""
    return sorted(p.relative_to(ROOT).as_posix() for top in PACKAGES for p in (ROOT / top).rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_the_architecture_map_has_a_row_for_every_module():
    named = set(CODE.findall(text(ARCHITECTURE)))
    assert len(modules()) > 60
    assert [m for m in modules() if m not in named] == []


def test_the_architecture_map_is_short():
    assert len(text(ARCHITECTURE).splitlines()) <= 300


FLOORS = ("infra", "schemas", "sources", "tracing", "data", "modeling", "evaluation", "training", "stages")


def _imports(file: Path) -> set[str]:
    """The project modules a file imports, function-local imports included."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def test_the_layers_of_the_map_hold():
    """ARCHITECTURE.md, "Layers": a floor of codi/ imports only its own and lower floors; codi/ imports neither
    experiments/ nor pipelines/; pipelines/ imports only codi.infra, codi.schemas and experiments.dvc_exp;
    experiments/ never imports pipelines/."""
    def floor(module: str) -> int | None:
        parts = module.split(".")
        return FLOORS.index(parts[1]) if parts[0] == "codi" and len(parts) > 1 and parts[1] in FLOORS else None

    wrong = []
    for path in modules():
        module = ".".join(Path(path).with_suffix("").parts)
        for dep in sorted(_imports(ROOT / path)):
            top = module.split(".")[0]
            if top == "codi":  # codi/__init__.py and codi/__main__.py stand on the lowest floor
                ok = dep == "codi" or floor(dep) is not None and floor(dep) <= (floor(module) or 0)
            elif top == "pipelines":
                ok = dep.startswith(("pipelines", "codi.infra", "codi.schemas", "experiments.dvc_exp"))
            else:
                ok = not dep.startswith("pipelines")
            if not ok:
                wrong.append(f"{module} imports {dep}")
    assert wrong == []
