"""The real command line on a damaged workspace: a cache, traces and base model that extract and precompute built
(the tiny params), then one file truncated. Each run prints exactly one `error:` line that names the file and the
stage that rebuilds it, and exits 2; a full disk during precompute keeps the previous cache as it was.
(Each damage one by one, in-process: tests/unit/test_faults_inputs.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codi.__main__ import main
from codi.data.cache import SPLITS, verify_split
from codi.infra.files import temporary_sibling
from tests.tiny import tiny_params, write_params


def in_process(ws: Path, *args: str) -> int:
    cwd = os.getcwd()
    os.chdir(ws)
    try:
        return main(["--params", "params.yaml", *args])
    finally:
        os.chdir(cwd)


def codi_cli(ws: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m codi <args>` in `ws`, as DVC runs a stage."""
    return subprocess.run([sys.executable, "-m", "codi", *args], cwd=ws, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A workspace after extract -> precompute: data/traces, data/cache, models/base."""
    ws = tmp_path_factory.mktemp("built")
    write_params(ws / "params.yaml", tiny_params())
    for stage in ("extract", "precompute"):
        assert in_process(ws, stage) == 0, stage
    return ws


@pytest.fixture
def ws(built: Path, tmp_path: Path) -> Path:
    """A copy of the built workspace, to damage."""
    return Path(shutil.copytree(built, tmp_path / "ws"))


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("command, damaged, names", [
    ("evaluate", "data/cache/val.arrow", "truncated"),
    ("sft", "data/cache/val.arrow", "truncated"),
    ("sft_direct", "models/base/model.safetensors", "truncated"),
    ("precompute", "data/traces/synthetic.parquet", "truncated"),
])
def test_a_truncated_input_is_one_error_line(ws, command, damaged, names):
    cut_in_half(ws / damaged)
    line = one_error_line(codi_cli(ws, command))
    rebuilds = {"data/cache": "precompute", "models/base": "precompute", "data/traces": "extract"}
    assert line.startswith(f"error: {damaged}: {names}")
    assert f"dvc repro {rebuilds[str(Path(damaged).parent)]}" in line


def test_a_missing_manifest_is_one_error_line(ws):
    (ws / "data/cache/manifest.json").unlink()
    line = one_error_line(codi_cli(ws, "evaluate"))
    assert line.startswith("error: data/cache/manifest.json: missing") and "dvc repro precompute" in line


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_full_disk_during_precompute_keeps_the_previous_cache(ws, capsys):
    """The first cache file precompute writes fills the disk (its temporary file is /dev/full): one error line
    naming it, exit 2, and the cache and base model a consumer would read are the previous, complete ones."""
    before = {p.relative_to(ws).as_posix(): p.read_bytes() for d in ("data/cache", "models/base")
              for p in (ws / d).rglob("*") if p.is_file()}
    temporary_sibling(ws / "data/cache/train.arrow").symlink_to("/dev/full")
    assert in_process(ws, "precompute") == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [lines[0]] and lines[0].startswith("error: data/cache/train.arrow: no space left on the device")
    after = {p.relative_to(ws).as_posix(): p.read_bytes() for d in ("data/cache", "models/base")
             for p in (ws / d).rglob("*") if p.is_file()}
    assert after == before  # nothing partial left beside it, nothing complete lost
    assert not temporary_sibling(ws / "data/cache/train.arrow").is_symlink()
    for split in SPLITS:  # the previous cache still checks against its manifest
        verify_split(ws / f"data/cache/{split}.arrow")
