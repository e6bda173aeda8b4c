"""dvc.yaml's code deps of each stage are exactly the import closure of the module its `cmd` runs.

A dep missing from dvc.yaml means an edit there reruns nothing and `dvc status` says "up to date" over stale
results; a dep too many reruns a stage that an edit cannot affect. The closure comes from codi.infra.provenance
(every import statement of every file, from the entry point and the stage module), the same function that
puts the code's digest into a training run's checkpoint fingerprint.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml

from codi.__main__ import COMMANDS, stage_module
from codi.infra.provenance import REPO_ROOT, stage_code_files

DVC_YAML = REPO_ROOT / "dvc.yaml"


def stage_command(cmd: str) -> str:
    """The codi command a stage's `cmd` runs (`python -m codi sft --cache ...` -> "sft")."""
    words = shlex.split(cmd)
    if words[:3] != ["python", "-m", "codi"]:
        raise ValueError(f"stage cmd {cmd!r}: expected `python -m codi <command> ...`")
    rest = words[3:]
    while rest and rest[0].startswith("--"):  # global options before the command (`--params FILE`)
        rest = rest[2:]
    if not rest or rest[0] not in COMMANDS:
        raise ValueError(f"stage cmd {cmd!r}: no codi command in it (known: {sorted(COMMANDS)})")
    return rest[0]


def code_dep_problems(stages: dict, root: Path = REPO_ROOT) -> list[str]:
    """Every way the stages' code deps differ from their import closures, in words."""
    problems = []
    for name, stage in stages.items():
        closure = {p.relative_to(root).as_posix() for p in stage_code_files(stage_module(stage_command(stage["cmd"])))}
        deps = [d for d in stage.get("deps", []) if d == "codi" or d.startswith("codi/")]
        listed: set[str] = set()
        for dep in deps:
            path = root / dep
            if not path.exists():
                problems.append(f"{name}: dep {dep} does not exist")
            files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
            listed |= {f.relative_to(root).as_posix() for f in files if "__pycache__" not in f.parts}
        problems += [f"{name}: imports {f}, which is not a dep" for f in sorted(closure - listed)]
        problems += [f"{name}: dep {f} is not imported by the stage" for f in sorted(listed - closure)]
    return problems


@pytest.fixture(scope="module")
def stages() -> dict:
    return yaml.safe_load(DVC_YAML.read_text())["stages"]


def test_every_stage_runs_a_codi_command(stages):
    assert {stage_command(s["cmd"]) for s in stages.values()} <= set(COMMANDS)


def test_code_deps_are_exactly_the_import_closure(stages):
    assert code_dep_problems(stages) == []


def test_a_missing_dep_is_found(stages):
    """The check fails on a dvc.yaml with one needed dep removed (and on one with a needless dep)."""
    mutated = copy.deepcopy(stages)
    mutated["evaluate"]["deps"].remove("codi/data/values.py")
    assert code_dep_problems(mutated) == ["evaluate: imports codi/data/values.py, which is not a dep"]
    mutated = copy.deepcopy(stages)
    mutated["codi"]["deps"].remove("codi/training")  # a folder dep covers every file under it
    assert code_dep_problems(mutated)[0] == "codi: imports codi/training/__init__.py, which is not a dep"
    mutated = copy.deepcopy(stages)
    mutated["extract"]["deps"].append("codi/data/batching.py")
    assert code_dep_problems(mutated) == ["extract: dep codi/data/batching.py is not imported by the stage"]


def stages_reading(file: str) -> set[str]:
    """The stages whose import closure holds `file` (an edit to it reruns them)."""
    return {name for name in COMMANDS if name not in ("trace", "params", "kernels")
            if file in {p.relative_to(REPO_ROOT).as_posix() for p in stage_code_files(stage_module(name))}}


def test_a_section_schema_edit_reruns_only_the_stages_that_read_it():
    """One schema module per params.yaml section: editing the codi section's schema reruns codi (and evaluate,
    which reads the CODI options back from the model folder), not extract, precompute or sft."""
    assert stages_reading("codi/schemas/codi.py") == {"codi"}
    assert stages_reading("codi/schemas/options.py") == {"codi", "evaluate"}
    assert stages_reading("codi/schemas/extract.py") == {"extract"}
    assert stages_reading("codi/schemas/evaluate.py") == {"evaluate"}
    assert stages_reading("codi/schemas/pipeline.py") == set()
    assert stages_reading("codi/schemas/params.py") == set()      # the whole file's schema: checked, no code dep


def test_a_function_local_import_is_in_the_closure(tmp_path):
    """Lazy imports count (a superset of one run's imports is safe; missing one is not)."""
    files = {p.relative_to(REPO_ROOT).as_posix() for p in stage_code_files("codi.stages.sft")}
    assert "codi/infra/launch.py" in files and "codi/infra/linux.py" in files   # launch is imported at the top; linux by launch
    assert "codi/modeling/model.py" not in files                    # sft trains no CodiModel
    assert "codi/stages/extract.py" not in files                    # the CLI table imports no stage module


def test_the_stage_command_parser():
    assert stage_command("python -m codi sft --cache data/cache") == "sft"
    assert stage_command("python -m codi --params p.yaml evaluate") == "evaluate"
    with pytest.raises(ValueError, match="expected `python -m codi"):
        stage_command("python train.py")
