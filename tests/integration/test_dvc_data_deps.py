"""A dataset file named in extract.paths is a DVC dependency: an edit to it makes `extract` stale.

Dataset files live under data/raw/, which the extract stage depends on; a local path outside it is refused
before any work (DVC would not see it change)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codi.infra.config import ConfigError
from codi.stages.extract import check_tracked_paths
from tests.tiny import ROOT, shipped, tiny_params, write_params

GIT = ["git", "-c", "user.name=ci", "-c", "user.email=ci@localhost"]


def sh(repo: Path, *cmd: str) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(list(cmd), cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout + proc.stderr


def dvc(repo: Path, *args: str) -> str:
    return sh(repo, sys.executable, "-m", "dvc", *args)


def test_a_path_outside_data_raw_is_refused_with_the_key_named(tmp_path):
    outside = shipped("extract", sources=["mbpp"], paths=shipped("extract.paths", mbpp=str(tmp_path / "mbpp.jsonl")))
    with pytest.raises(ConfigError, match=r"extract.paths.mbpp = '.*mbpp.jsonl': outside data/raw/"):
        check_tracked_paths(outside)
    check_tracked_paths(shipped("extract", sources=["mbpp"], paths=shipped("extract.paths", mbpp="data/raw/mbpp.jsonl")))
    check_tracked_paths(shipped("extract", sources=["mbpp"], paths=shipped("extract.paths", mbpp="hf:mbpp")))
    # a path for a source that is not traced is not read, so it is not checked
    check_tracked_paths(shipped("extract", sources=["synthetic"], paths=shipped("extract.paths", mbpp="/elsewhere")))


def test_an_edited_dataset_file_makes_extract_stale(tmp_path):
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if f == "dvc.lock" or f.startswith(("metrics/", "plots/", "dvclive/", "tests/")):
            continue
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, repo / f)
    shutil.copy2(ROOT / "tests/fixtures/sources/mbpp.jsonl", repo / "data/raw/mbpp.jsonl")
    write_params(repo / "params.yaml", tiny_params(extract={"sources": ["mbpp"], "paths": {"mbpp": "data/raw/mbpp.jsonl"}}))
    sh(repo, "git", "init", "-q")
    sh(repo, "git", "add", "-A")
    sh(repo, *GIT, "commit", "-qm", "tiny")
    assert "Running stage 'extract'" in dvc(repo, "repro", "extract")
    assert "up to date" in dvc(repo, "status", "extract")

    raw = repo / "data/raw/mbpp.jsonl"
    raw.write_text(raw.read_text().splitlines()[0] + "\n")  # keep one record
    status = dvc(repo, "status", "extract")
    assert "extract:" in status and "modified:" in status and "data/raw" in status, status
