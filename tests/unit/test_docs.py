"""The README and docs/ name only things that exist: every repository path (a file of the repository, or an
output dvc.yaml declares), every `python -m` command and every `make` target they mention; and the README
stays short."""

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
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = {"codi", "pipelines", "tests", "docs", "benchmarks", "tools", "configs", "data", "models", "metrics", "plots",
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
    assert exists("codi/modeling/options.py", files, outputs) and exists("models/codi/codi_config.json", files, outputs)
    assert exists("checkpoints/<stage>/run.json", files, outputs) and exists("data/cache/{train,val}.arrow", files, outputs)
    for wrong in ("codi/nope.py", "metrics/nope.json", "docs/NOPE.md", "models/nope", "metrics/{eval,nope}.json", "plots/nope.png"):
        assert not exists(wrong, files, outputs), wrong
    assert path_candidates("see `codi/config.py` and dvc.yaml, not codi or the/path") == ["codi/config.py", "dvc.yaml"]
