"""Faults around DVC, on tiny throwaway projects (tests/dvc_projects.py): two `dvc repro` at once, and the
Prefect pipeline flow killed with kill -9 at a random point, then run again.

The flow case is slow (a Prefect test server, a whole flow three times):
`pytest -m slow tests/integration/test_faults_dvc.py`."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines import dvc
from tests.dvc_projects import DAG_STAGES, make_project

# The miniature DAG's outputs, each stage slowed down so that a kill lands inside one.
DAG_OUTPUTS = ["data/traces.txt", "data/cache.txt", "models/sft.txt", "models/codi.txt", "models/sft_direct.txt",
               "metrics/eval.json", "metrics/eval.md", "plots/eval/accuracy.png"]
SLOW_DAG = {name: {**stage, "cmd": f"sleep 0.4 && {stage['cmd']}"} for name, stage in DAG_STAGES.items()}


def dvc_run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(dvc.dvc_command(*args), cwd=root, env=dvc.subprocess_env(), capture_output=True, text=True,
                          timeout=300)


def md5s(root: Path, paths: list[str]) -> dict[str, str]:
    return {p: hashlib.md5((root / p).read_bytes()).hexdigest() for p in paths if (root / p).exists()}


def test_a_second_dvc_repro_refuses_cleanly_and_the_first_is_unharmed(tmp_path: Path) -> None:
    stages = {"slow": {"cmd": "python tool.py write started.txt && sleep 3 && python tool.py write data/out.txt",
                       "outs": ["data/out.txt"]},
              "next": {"cmd": "python tool.py write data/next.txt data/out.txt", "deps": ["data/out.txt"],
                       "outs": ["data/next.txt"]}}
    outputs = ["data/out.txt", "data/next.txt"]
    solo = make_project(tmp_path / "solo", stages)
    assert dvc_run(solo, "repro").returncode == 0
    root = make_project(tmp_path / "p", stages)
    first = subprocess.Popen(dvc.dvc_command("repro"), cwd=root, env=dvc.subprocess_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (root / "started.txt").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    second = dvc_run(root, "repro")
    first_output = first.communicate(timeout=300)[0]
    # DVC's locks: the repo lock while it plans, the outputs' own lock while a stage's command runs.
    assert second.returncode == 255, second.stdout + second.stderr
    assert ("is busy, it is being blocked by" in second.stderr or "Unable to acquire lock" in second.stderr), \
        second.stderr
    assert "Running stage" not in second.stdout + second.stderr           # it ran nothing
    assert first.returncode == 0, first_output
    assert md5s(root, outputs) == md5s(solo, outputs) and len(md5s(root, outputs)) == 2
    assert "up to date" in dvc_run(root, "status").stdout


@pytest.mark.slow
def test_pipeline_flow_killed_with_kill_9_then_rerun_equals_an_uninterrupted_run(prefect_server: str,
                                                                                   tmp_path: Path) -> None:
    env = dict(os.environ, PREFECT_API_URL=prefect_server)
    flow = [sys.executable, "-c", "from pipelines.flows import pipeline; pipeline(repo='.')"]
    solo = make_project(tmp_path / "solo", SLOW_DAG)
    t0 = time.monotonic()
    subprocess.run(flow, cwd=solo, env=env, check=True, capture_output=True, timeout=300)
    seconds = time.monotonic() - t0
    root = make_project(tmp_path / "p", SLOW_DAG)
    why = kill_flow_at_random(flow, root, env, seconds, (0.2, 0.8))
    print(why)
    for path, md5 in md5s(root, DAG_OUTPUTS).items():   # what exists is complete
        assert md5 == md5s(solo, [path])[path], f"{path}: partial after the kill: {why}"
    assert "up to date" not in dvc_run(root, "status").stdout, why   # DVC knows the run did not finish
    subprocess.run(flow, cwd=root, env=env, check=True, capture_output=True, timeout=300)
    assert md5s(root, DAG_OUTPUTS) == md5s(solo, DAG_OUTPUTS), why
    assert len(md5s(root, DAG_OUTPUTS)) == len(DAG_OUTPUTS)
    assert "up to date" in dvc_run(root, "status").stdout, why


def kill_flow_at_random(flow: list[str], root: Path, env: dict, seconds: float, share: tuple[float, float]) -> str:
    """Start `flow` in `root`, kill -9 its process group at a random share of `seconds` (an uninterrupted run's
    time), and return what happened, with the seed, for the assertions' messages."""
    seed = random.randrange(1 << 30)
    delay = random.Random(seed).uniform(*share) * seconds
    killed = subprocess.Popen(flow, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    time.sleep(delay)
    assert killed.poll() is None, "the flow ended before it could be killed"
    os.killpg(killed.pid, signal.SIGKILL)    # the stage's own group goes by its parent-death signal
    killed.wait()
    return f"flow killed {delay:.2f} s into a {seconds:.1f} s run (seed {seed})"


def project_outputs(root: Path) -> list[str]:
    """Every `outs` path of the project's dvc.yaml."""
    import yaml

    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    return [o if isinstance(o, str) else next(iter(o)) for s in stages.values() for o in s.get("outs", [])]


@pytest.mark.slow
def test_the_real_pipeline_flow_killed_with_kill_9_then_rerun_equals_an_uninterrupted_repro(
        prefect_server: str, tmp_path: Path) -> None:
    """The project's own dvc.yaml on the tiny params: the flow killed at a random point of its run, then run again,
    ends with what one `dvc repro` writes (md5; the evaluation's wall times aside: tests/integration/test_kill_9.py)."""
    from tests.integration.test_kill_9 import digest
    from tests.integration.test_real_pipeline_dvc import GIT, copy_project, env, sh
    from tests.tiny import tiny_params, write_params

    def project(name: str) -> Path:
        root = tmp_path / name
        copy_project(root)
        write_params(root / "params.yaml", tiny_params())
        sh(root, "git", "init", "-q")
        sh(root, "git", "add", "-A")
        sh(root, *GIT, "commit", "-qm", "tiny")
        return root

    flow_env = {**env(), "PREFECT_API_URL": prefect_server}
    flow = [sys.executable, "-c", "from pipelines.flows import pipeline; pipeline(repo='.')"]
    solo = project("solo")
    t0 = time.monotonic()
    sh(solo, sys.executable, "-m", "dvc", "repro")
    seconds = time.monotonic() - t0
    outputs = project_outputs(solo)
    want = {out: digest(solo / out) for out in outputs}
    root = project("p")
    why = kill_flow_at_random(flow, root, flow_env, seconds, (0.1, 0.9))
    print(why)
    for out in outputs:
        if (root / out).exists():
            assert digest(root / out) == want[out], f"{out}: partial after the kill: {why}"
    proc = subprocess.run(flow, cwd=root, env=flow_env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {out: digest(root / out) for out in outputs} == want, why
    assert "up to date" in sh(root, sys.executable, "-m", "dvc", "status"), why
