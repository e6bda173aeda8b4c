"""pipelines/ against real DVC behaviour that takes seconds to show (a held repo lock, staleness, a served
deployment on a real Prefect server). Slow: `pytest -m slow tests/integration/test_pipelines_dvc.py`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipelines import dvc
from tests.dvc_projects import DAG_STAGES, artifacts_of, make_project

pytestmark = pytest.mark.slow


def hold_dvc_lock(root: Path, seconds: float) -> threading.Thread:
    """Hold the repo lock that every `dvc repro` takes, from this process, for `seconds`."""
    import zc.lockfile

    lock = zc.lockfile.LockFile(str(root / ".dvc" / "tmp" / "lock"))
    thread = threading.Thread(target=lambda: (time.sleep(seconds), lock.close()), daemon=True)
    thread.start()
    return thread


def test_a_held_repo_lock_is_waited_for(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p", {"extract": DAG_STAGES["extract"]})
    holder = hold_dvc_lock(root, 6)     # without --wait-for-lock DVC gives up after ~3 s
    start = time.monotonic()
    assert dvc.run_stage(root, "extract", on_line=lambda l: None).status == "ran"
    assert time.monotonic() - start > 5
    holder.join()


def test_flow_waits_for_the_lock_without_a_retry(prefect_server: str, tmp_path: Path) -> None:
    from pipelines.flows import pipeline

    root = make_project(tmp_path / "p", {"extract": DAG_STAGES["extract"]})
    hold_dvc_lock(root, 6)
    summary = pipeline(repo=str(root), retries=0)
    assert summary["stages"][0]["status"] == "ran"


def test_a_path_busy_in_another_dvc_process_is_transient(tmp_path: Path) -> None:
    """Why TRANSIENT_PATTERNS keeps "it is being blocked by": while `dvc repro` runs a stage's command it lets
    go of the repo lock and holds its own locks on the stage's paths, which --wait-for-lock does not wait for."""
    slow = {"cmd": "python -c \"import time; time.sleep(30)\" && python tool.py write out.txt", "outs": ["out.txt"]}
    root = make_project(tmp_path / "p", {"slow": slow})
    other = subprocess.Popen(dvc.dvc_command("repro", "slow"), cwd=root, env=dvc.subprocess_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        rwlock = root / ".dvc/tmp/rwlock"
        _wait(lambda: rwlock.exists() and "out.txt" in rwlock.read_text(), 60, "the other repro's output lock")
        start = time.monotonic()
        with pytest.raises(dvc.StageFailed) as info:
            dvc.run_stage(root, "slow", on_line=lambda l: None)
        assert time.monotonic() - start < 20 and info.value.transient
        assert "is busy, it is being blocked by" in str(info.value)
    finally:
        _stop(other)


def test_dvc_decides_what_reruns(prefect_server: str, tmp_path: Path) -> None:
    from pipelines.flows import pipeline

    root = make_project(tmp_path / "p", DAG_STAGES)
    pipeline(repo=str(root))
    assert {s["status"] for s in pipeline(repo=str(root))["stages"]} == {"skipped"}
    params = yaml.safe_load((root / "params.yaml").read_text())
    (root / "params.yaml").write_text(yaml.safe_dump({**params, "gamma": 3.0}, sort_keys=False))
    summary = pipeline(repo=str(root))
    assert [s["stage"] for s in summary["stages"] if s["status"] == "ran"] == ["codi", "evaluate"]
    assert summary["eval"]["latent"]["accuracy"] == 0.75


def test_a_failed_experiment_keeps_the_others(prefect_server: str, tmp_path: Path) -> None:
    from pipelines.flows import ARTIFACT_EXPERIMENTS, experiments

    stages = {"prepare": DAG_STAGES["extract"], "evaluate": {**DAG_STAGES["evaluate"], "deps": ["data/traces.txt"]}}
    root = make_project(tmp_path / "p", stages)
    state = experiments(grid={"gamma": [0.5, -1.0]}, repo=str(root), retries=0, return_state=True)
    assert state.is_failed() and "1 of 2 experiments failed" in state.message
    table = json.loads(artifacts_of(state.state_details.flow_run_id)[ARTIFACT_EXPERIMENTS].data)
    assert [(r["gamma"], r["status"]) for r in table] == [(0.5, "ok"), (-1.0, "failed: exit code 1")]
    assert table[0]["latent.accuracy"] == 0.125 and table[1]["latent.accuracy"] is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_served_deployment_runs_on_a_real_server(tmp_path: Path) -> None:
    """What docs/ORCHESTRATION.md's steps do: server, serve, `prefect deployment ls`, a triggered run that completes."""
    root = make_project(tmp_path / "p", DAG_STAGES)
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="INFO",
               COLUMNS="250")     # rich tables of the CLI are cut to the terminal width otherwise
    prefect = [str(Path(sys.executable).parent / "prefect")]
    logs = tmp_path / "logs"
    logs.mkdir()
    server = subprocess.Popen([*prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=(logs / "server.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    served = None
    try:
        def healthy() -> bool:
            try:
                return urllib.request.urlopen(f"{api}/health", timeout=2).read() == b"true"
            except OSError:
                return False

        _wait(healthy, 120, "the Prefect server")
        # PREFECT_API_URL was set before the server started: its UI calls the API on this port, not on 4200
        ui = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=10).read())
        assert ui["api_url"] == api
        served = subprocess.Popen([sys.executable, "-m", "pipelines", "serve", "--repo", str(root), "--cron", "0 0 1 1 *"],
                                  env=env, stdout=(logs / "serve.log").open("w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)

        def listed() -> bool:
            out = subprocess.run([*prefect, "deployment", "ls"], env=env, capture_output=True, text=True).stdout
            return "codi-pipeline/scheduled" in out and "codi-experiments/on-demand" in out

        _wait(listed, 120, "the served deployments")
        inspect = subprocess.run([*prefect, "deployment", "inspect", "codi-pipeline/scheduled"], env=env,
                                 capture_output=True, text=True, check=True).stdout
        assert "'cron': '0 0 1 1 *'" in inspect and str(root) in inspect
        run = subprocess.run([*prefect, "deployment", "run", "codi-pipeline/scheduled", "--watch", "--watch-timeout", "180"],
                             env=env, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout + run.stderr
        assert json.loads((root / "metrics/eval.json").read_text())["latent"]["accuracy"] == 0.25
        arts = subprocess.run([*prefect, "artifact", "ls"], env=env, capture_output=True, text=True).stdout
        assert all(key in arts for key in ("codi-progress", "codi-eval-table", "codi-plots")), arts
        os.killpg(served.pid, signal.SIGTERM)     # serve stops first: it pauses its schedule through the server
        assert served.wait(timeout=60) == 0
        inspect = subprocess.run([*prefect, "deployment", "inspect", "codi-pipeline/scheduled"], env=env,
                                 capture_output=True, text=True, check=True).stdout
        assert "'paused': True" in inspect
    finally:
        if served is not None:
            _stop(served)
        _stop(server)
