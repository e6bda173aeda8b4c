"""kill -9 at a random point of every stage, then a rerun: the outputs equal an uninterrupted run's (md5), and
no partial output is ever left where DVC or the next stage would take it as complete.

The fast case (default suite): extract killed once it has finished two shards resumes from them. The slow ones
(`pytest -m slow tests/integration/test_kill_9.py`) kill each stage of the tiny pipeline at a random moment of
its run (the seed is printed, and a failure names it); sft and codi are also killed after a checkpoint by
tests/integration/test_training_procs.py."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.test_training_procs import ENV, run
from tests.tiny import tiny_params, write_params

# Every output of each stage (dvc.yaml `outs`), as the stage's CLI names them for a run tagged `tag`, and the
# stage's command line writing them there. Wall times differ between any two runs, killed or not: the metrics
# files (not compared), eval.md's time columns (checked present only) and the predictions' `time_s` (left out).
TIMED = ("eval.md",)


def stage_run(stage: str, tag: str) -> tuple[list[str], list[str]]:
    if stage == "extract":
        return (["extract", "--out", f"{tag}/traces", "--metrics", f"{tag}/extract.json",
                 "--checkpoints", f"ck/{tag}-extract"], [f"{tag}/traces"])
    if stage == "precompute":
        return (["precompute", "--traces", "data/traces", "--cache", f"{tag}/cache", "--base-out", f"{tag}/base",
                 "--metrics", f"{tag}/precompute.json"],
                [f"{tag}/base", *(f"{tag}/cache/{f}" for f in
                                  ("train.arrow", "val.arrow", "test.arrow", "holdout.arrow", "manifest.json"))])
    if stage in ("sft", "sft_direct", "codi"):
        start = ["--sft", "models/sft"] if stage == "codi" else ["--base", "models/base"]
        return ([stage, "--cache", "data/cache", *start, "--out", f"{tag}/{stage}", "--checkpoints",
                 f"ck/{tag}-{stage}", "--metrics", f"{tag}/{stage}.json", "--plots", f"{tag}/plots-{stage}",
                 "--live", f"{tag}/live-{stage}"], [f"{tag}/{stage}"])
    assert stage == "evaluate"
    return (["evaluate", "--cache", "data/cache", "--sft", "models/sft", "--codi", "models/codi", "--direct",
             "models/sft_direct", "--metrics", f"{tag}/metrics", "--predictions", f"{tag}/predictions.parquet",
             "--plots", f"{tag}/plots"],
            [f"{tag}/predictions.parquet", f"{tag}/metrics/eval.md",
             *(f"{tag}/plots/{f}" for f in ("accuracy.csv", "accuracy_by_source.csv", "accuracy_vs_positions.csv"))])


def digest(path: Path) -> dict[str, str]:
    """md5 of a file, or of every file in a folder, by path relative to `path` (the timed parts left out)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p.relative_to(path)): file_md5(p) for p in files}


def file_md5(path: Path) -> str:
    if path.name in TIMED:
        return "present"
    if path.name == "predictions.parquet":
        import pyarrow.parquet as pq
        table = pq.read_table(path)
        return hashlib.md5(repr(table.drop_columns(["time_s"]).to_pylist()).encode()).hexdigest()
    return hashlib.md5(path.read_bytes()).hexdigest()


def launch(ws: Path, args: list[str], params: str = "params.yaml") -> subprocess.Popen:
    """A stage in a session of its own, so that kill -9 reaches all its processes (sandbox workers, DDP ranks)."""
    return subprocess.Popen([sys.executable, "-m", "codi", "--params", params, *args], cwd=ws, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def kill_9_when(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float = 240) -> bool:
    """kill -9 the stage's whole group once `ready()`, the group a stage's sandbox workers and DDP ranks share
    (no chance to clean up); False when the stage ended first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.005)
    if proc.poll() is not None:
        return False
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return True


def assert_nothing_partial(ws: Path, outs: list[str], ref: dict[str, dict[str, str]]) -> None:
    """Each output is absent or complete (what the uninterrupted run wrote): never a part of it."""
    for out in outs:
        if (ws / out).exists():
            assert digest(ws / out) == ref[out], f"{out}: a killed run left a partial output"


def test_extract_killed_after_two_shards_resumes_from_them(tmp_path: Path) -> None:
    ws = tmp_path
    write_params(ws / "params.yaml", tiny_params(extract={"synthetic": {"n_programs": 200}, "dask": {"shard_size": 16}}))
    cmd, outs = stage_run("extract", "ref")
    run(ws, ["-m", "codi", *cmd])
    ref = digest(ws / outs[0])
    assert not (ws / "ck/ref-extract").exists()      # finished: nothing left to resume
    cmd, outs = stage_run("extract", "kill")
    shards = ws / "ck/kill-extract/synthetic"
    assert kill_9_when(launch(ws, cmd), lambda: len(list(shards.glob("*.parquet"))) >= 2), "extract ended first"
    assert not (ws / "kill/traces").exists()         # written whole at the end, so not at all yet
    reused = len(list(shards.glob("*.parquet")))
    proc = run(ws, ["-m", "codi", *cmd])
    assert f"extract synthetic: resumed: {reused} finished shards reused from ck/kill-extract" in proc.stdout
    assert digest(ws / "kill/traces") == ref
    assert not (ws / "ck/kill-extract").exists()
    assert not list(ws.glob("kill/.traces.tmp-*"))   # the killed run's temporary folder, if any, is gone


# ----------------------------------------------------------------------------- every stage, at random (slow)
STAGES = ["extract", "precompute", "sft", "sft_direct", "codi", "evaluate"]


@pytest.fixture(scope="module")
def pipeline_ws(tmp_path_factory) -> Path:
    """The tiny pipeline run once into its default paths: each stage's inputs."""
    ws = tmp_path_factory.mktemp("kill9")
    write_params(ws / "params.yaml", tiny_params(extract={"synthetic": {"n_programs": 120}, "dask": {"shard_size": 16}}))
    for stage in STAGES[:-1]:
        run(ws, ["-m", "codi", stage], timeout=600)
    return ws


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_kill_9_at_a_random_point_then_rerun_equals_an_uninterrupted_run(pipeline_ws: Path, stage: str) -> None:
    """The uninterrupted run and the killed one write to the same paths (a training stage's model folder keeps
    its arguments, paths included), one after the other."""
    ws = pipeline_ws
    cmd, outs = stage_run(stage, stage)
    t0 = time.time()
    run(ws, ["-m", "codi", *cmd], timeout=600)
    seconds = time.time() - t0
    ref = {out: digest(ws / out) for out in outs}
    shutil.rmtree(ws / stage)
    shutil.rmtree(ws / f"ck/{stage}-{stage}", ignore_errors=True)   # the killed run must not find the first's
    seed = random.randrange(1 << 30)
    delay = random.Random(seed).uniform(0.1, 0.9) * seconds
    for _ in range(4):   # a run can be quicker than the first (a warm disk cache): then kill it sooner
        start = time.time()
        if kill_9_when(launch(ws, cmd), lambda: time.time() - start > delay):
            break
        shutil.rmtree(ws / stage)
        shutil.rmtree(ws / f"ck/{stage}-{stage}", ignore_errors=True)
        delay /= 2
    else:
        raise AssertionError(f"{stage} always ended before it could be killed (seed {seed})")
    why = f"{stage} killed {delay:.2f} s into a {seconds:.1f} s run (seed {seed})"
    print(why)
    assert_nothing_partial(ws, outs, ref)
    run(ws, ["-m", "codi", *cmd], timeout=600)
    for out in outs:
        assert digest(ws / out) == ref[out], f"{out} differs from the uninterrupted run's: {why}"


def test_precompute_stopped_between_its_files_leaves_the_previous_cache_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Over a complete cache, a run that dies after writing the new splits and manifest, while saving the new
    model: nothing is replaced (the splits and manifest wait in temporary files until models/base is whole), so the
    previous cache and model stay a consistent pair that the next stage takes, and no temporary file is left."""
    import codi.stages.precompute as precompute
    from codi.__main__ import main

    write_params(tmp_path / "params.yaml", tiny_params(extract={"synthetic": {"n_programs": 120}}))
    monkeypatch.chdir(tmp_path)
    assert main(["extract"]) == 0 and main(["precompute"]) == 0
    base, cache = digest(tmp_path / "models/base"), digest(tmp_path / "data/cache")
    write_params(tmp_path / "params.yaml", tiny_params())  # other traces: another cache would follow
    assert main(["extract"]) == 0

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while saving the base model")

    monkeypatch.setattr(precompute, "save_base", killed)
    with pytest.raises(KeyboardInterrupt):
        main(["precompute"])
    assert digest(tmp_path / "models/base") == base and digest(tmp_path / "data/cache") == cache
    assert not [p for p in (tmp_path / "data/cache").iterdir() if ".tmp" in p.name]
    from codi.data.cache import CacheDataset
    assert len(CacheDataset(tmp_path / "data/cache/val.arrow")) >= 0  # the previous cache passes its hash checks
