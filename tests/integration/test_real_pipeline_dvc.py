"""The project's own dvc.yaml on the tiny params, in a temporary git repo: repro, no-op repro, exactly the
affected stages rerun, `dvc exp run -S gamma=2.0` + `dvc exp show --json`, and the Prefect pipeline flow
driving the real stages. Slow (minutes): `pytest -m slow tests/integration/test_real_pipeline_dvc.py`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.dvc_projects import artifacts_of
from tests.tiny import ROOT, tiny_params, write_params

pytestmark = pytest.mark.slow
GIT = ["git", "-c", "user.name=ci", "-c", "user.email=ci@localhost"]


def env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "DVC_NO_ANALYTICS": "1", "WANDB_MODE": "disabled", "PATH": bin_dir + os.pathsep + os.environ["PATH"]}


def sh(repo: Path, *cmd: str, timeout: int = 900) -> str:
    proc = subprocess.run(list(cmd), cwd=repo, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def dvc(repo: Path, *args: str) -> str:
    return sh(repo, sys.executable, "-m", "dvc", *args)


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([a-z_]+)'", output)


def copy_project(repo: Path) -> None:
    """The project's tracked files into `repo`, without the committed run's results (the copy makes its own)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if f.startswith(("metrics/", "plots/")) or f == "dvc.lock":
            continue
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, repo / f)


def tiny_repo(repo: Path) -> Path:
    """A copy of the project's tracked files in `repo` with tiny params, committed, after a first `dvc repro`
    (its results committed too). Also used by test_dvc_remote.py."""
    copy_project(repo)
    write_params(repo / "params.yaml", tiny_params(gamma=1.0))  # the tests below move it to 2.0
    sh(repo, "git", "init", "-q")
    sh(repo, "git", "add", "-A")
    sh(repo, *GIT, "commit", "-qm", "tiny")
    out = dvc(repo, "repro")
    assert ran(out) == ["extract", "precompute", "sft", "sft_direct", "codi", "evaluate"] or \
        sorted(ran(out)) == sorted(["extract", "precompute", "sft", "sft_direct", "codi", "evaluate"])
    sh(repo, "git", "add", "-A")
    sh(repo, *GIT, "commit", "-qm", "baseline results")
    return repo


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return tiny_repo(tmp_path_factory.mktemp("repo"))


def test_repro_then_status_is_clean_and_no_op_repro_runs_nothing(repo):
    assert "up to date" in dvc(repo, "status")
    assert ran(dvc(repo, "repro")) == []


def dry(repo: Path) -> list[str]:
    """The stages a `dvc repro` would run now.

    `dvc repro --dry` lists only the stages whose own deps or params changed: it cannot know that a
    stage's rerun writes new outs. Every change here does change them (new params, new data, new
    code), so the stages downstream of a listed one rerun too: close the list over the stage graph."""
    stale = set(ran(dvc(repo, "repro", "--dry")))
    edges = stage_edges(repo)
    while True:
        more = {b for a, b in edges if a in stale} - stale
        if not more:
            return sorted(stale)
        stale |= more


def stage_edges(repo: Path) -> list[tuple[str, str]]:
    """(upstream, downstream) for every stage that depends on another's output (dvc.yaml's deps and outs)."""
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    outs = {name: [next(iter(o)) if isinstance(o, dict) else o for o in st.get("outs", [])] for name, st in stages.items()}
    return [(a, b) for b, st in stages.items() for a in stages
            if any(d == o or d.startswith(o + "/") for d in st.get("deps", []) for o in outs[a])]


def test_the_flow_runs_the_stages_in_dvcs_order_upstream_first(repo):
    from pipelines.dvc import stage_order

    order = stage_order(repo)
    assert sorted(order) == sorted(["extract", "precompute", "sft", "sft_direct", "codi", "evaluate"])
    assert all(order.index(a) < order.index(b) for a, b in stage_edges(repo))


def test_a_change_reruns_exactly_what_it_affects(repo):
    params = (repo / "params.yaml").read_text()
    try:
        (repo / "params.yaml").write_text(params.replace("gamma: 1.0", "gamma: 2.0"))
        assert dry(repo) == ["codi", "evaluate"]
        (repo / "params.yaml").write_text(params.replace("n_programs: 40", "n_programs: 41"))
        assert dry(repo) == sorted(["extract", "precompute", "sft", "sft_direct", "codi", "evaluate"])
        (repo / "params.yaml").write_text(params.replace("project: codi-trace", "project: elsewhere"))
        assert dry(repo) == []  # where logs go never retrains
    finally:
        (repo / "params.yaml").write_text(params)
    module = repo / "codi/stages/evaluate.py"
    text = module.read_text()
    try:
        module.write_text(text + "\n# touched\n")
        assert dry(repo) == ["evaluate"]
        module.write_text(text)
        (repo / "codi/data/batching.py").write_text((repo / "codi/data/batching.py").read_text() + "\n# touched\n")
        assert dry(repo) == ["codi", "evaluate", "sft", "sft_direct"]
    finally:
        sh(repo, "git", "checkout", "--", "codi")


def test_exp_run_gamma_reruns_codi_and_evaluate_and_exp_show_lists_both(repo):
    out = dvc(repo, "exp", "run", "-n", "gamma-2", "-S", "gamma=2.0")
    assert sorted(ran(out)) == ["codi", "evaluate"]
    show = json.loads(dvc(repo, "exp", "show", "--json"))
    found = {}
    for commit in show:
        for exp in [commit] + [e for e in (commit.get("experiments") or [])]:
            runs = exp.get("revs") or [exp]
            for r in runs:
                data = r.get("data") or {}
                name = r.get("name") or data.get("name") or r.get("rev")
                metrics = (data.get("metrics") or {}).get("metrics/eval.json", {}).get("data")
                gamma = (data.get("params") or {}).get("params.yaml", {}).get("data", {}).get("gamma")
                if metrics:
                    found[name] = (gamma, metrics)
    gammas = sorted(g for g, _ in found.values())
    assert 1.0 in gammas and 2.0 in gammas, found.keys()
    assert all("output_accuracy" in m["latent"] for _, m in found.values())


def test_prefect_pipeline_flow_drives_the_real_stages(repo, prefect_server):
    from pipelines.flows import ARTIFACT_EVAL_TABLE, pipeline

    (repo / "params.yaml").write_text((repo / "params.yaml").read_text().replace("seed: 3", "seed: 4"))
    state = pipeline(repo=str(repo), return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    statuses = {s["stage"]: s["status"] for s in summary["stages"]}
    assert list(statuses) == ["extract", "precompute", "sft", "sft_direct", "codi", "evaluate"]
    assert statuses["extract"] == "ran" and statuses["evaluate"] == "ran"
    table = json.loads(artifacts_of(state.state_details.flow_run_id)[ARTIFACT_EVAL_TABLE].data)
    modes = {"explicit", "latent", "direct"}
    assert {row["name"] for row in table} >= modes  # (and `latent_diagnostics`, `summary`: other columns)
    assert all(row["output_accuracy"] is not None for row in table if row["name"] in modes)
    assert "up to date" in dvc(repo, "status")


def test_a_killed_temp_experiment_resumes_when_run_again(repo):
    """`dvc exp run --temp` runs in a temporary copy that a kill leaves behind: the rerun is a new copy, and
    resumes sft from the checkpoint the killed one wrote to the repository's checkpoints/exps/."""
    import signal
    import time

    cmd = [sys.executable, "-m", "dvc", "exp", "run", "--temp", "-n", "resumed", "-S", "sft.max_steps=40",
           "-S", "sft.save_steps=4", "-S", "sft.eval_steps=20"]
    exps = repo / "checkpoints/exps"
    proc = subprocess.Popen(cmd, cwd=repo, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline, killed_at = time.time() + 600, None
    while time.time() < deadline and proc.poll() is None:
        done = [p for p in exps.glob("sft-*/checkpoint-*") if (p / "trainer_state.json").is_file()]
        if done:
            os.killpg(proc.pid, signal.SIGKILL)
            killed_at = done[0]
            break
        time.sleep(0.01)
    proc.wait()
    assert killed_at is not None, "the experiment ended before it could be killed"
    out = sh(repo, *cmd)
    assert f"resuming from {killed_at.parent}/checkpoint-" in out
    assert not list(exps.glob("sft-*"))  # the finished stage removed what it no longer needs
    assert "resumed" in dvc(repo, "exp", "show", "--json")
