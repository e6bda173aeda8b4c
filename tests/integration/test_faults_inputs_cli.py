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


def files_under(*folders: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for d in folders for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_full_disk_during_precompute_keeps_the_previous_cache(ws, capsys):
    """The first cache file precompute writes fills the disk: one error line naming it, exit 2, and the cache and
    base model a consumer would read are the previous, complete ones."""
    before = files_under(ws / "data/cache", ws / "models/base")
    # precompute writes train.arrow to a temporary of its own (atomic_paths), through write_split's (atomic_path)
    temporary_sibling(temporary_sibling(ws / "data/cache/train.arrow")).symlink_to("/dev/full")
    assert in_process(ws, "precompute") == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [lines[0]] and lines[0].startswith("error: data/cache/train.arrow: no space left on the device")
    assert files_under(ws / "data/cache", ws / "models/base") == before  # nothing partial, nothing complete lost
    assert not [p.name for p in (ws / "data/cache").iterdir() if ".tmp-" in p.name]
    for split in SPLITS:  # the previous cache still checks against its manifest
        verify_split(ws / f"data/cache/{split}.arrow")


@pytest.fixture
def small_filesystem(tmp_path: Path, request):
    """A tmpfs of `request.param` kB (a real full disk, for every writer, libraries' own included); skips where
    mount is not allowed."""
    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}k", "tmpfs", str(where)],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("small_filesystem", [200], indirect=True)  # one tiny base model, not two
def test_a_really_full_disk_while_precompute_saves_the_base_model(ws, small_filesystem, capsys):
    """models/base on a filesystem with room for one copy: the new one fills it (safetensors' own write), the
    error names the folder, and the previous base model is whole."""
    base = small_filesystem / "base"
    shutil.copytree(ws / "models/base", base)
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    assert in_process(ws, "precompute", "--base-out", str(base)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: {base}: no space left on the device while writing this folder; nothing was replaced "
                     "(an earlier complete version, if any, is unchanged): free some space and rerun the stage"], err
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
    assert [p.name for p in small_filesystem.iterdir()] == ["base"]


# the old cache (140 kB in 4 kB pages), a new train split (84 kB) and not much more
@pytest.mark.parametrize("small_filesystem", [140 + 84 + 8], indirect=True)
def test_a_really_full_disk_midway_through_the_cache_replaces_none_of_it(ws, small_filesystem, capsys):
    """Another split salt, so every split changes; the cache on a filesystem with room for the old cache and about
    one new train split: the disk fills after train.arrow was written, and none of the old files is replaced
    (new splits beside the old manifest would be a cache no consumer can trust)."""
    import yaml

    cache = small_filesystem / "cache"
    shutil.copytree(ws / "data/cache", cache)
    before = files_under(cache)
    params = yaml.safe_load((ws / "params.yaml").read_text())
    params["precompute"]["split_salt"] = "another salt"
    write_params(ws / "params.yaml", params)
    assert in_process(ws, "precompute", "--cache", str(cache)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and f"error: {cache}/" in lines[0] and "no space left on the device" in lines[0], err
    assert files_under(cache) == before
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in (ws / "data/cache").iterdir())
