"""pipelines/ over tiny throwaway DVC projects (tests/dvc_projects.py): DVC's stage order, a stage's ran or
skipped from DVC's API, process-group hygiene, the Prefect flows on a test server (their retries, timeouts,
cancellation, artifacts), and a first `python -m pipelines run` on an empty PREFECT_HOME.

One Prefect test server for the module (prefect_test_harness, ~11 s; tests/integration/conftest.py)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import pipelines
from codi.infra.config import ConfigError
from pipelines import dvc, process
from tests.dvc_projects import DAG_ORDER, DAG_STAGES, artifacts_of, group_survivors, make_project, wait_for_file


# ------------------------------------------------------------------------- DVC, no Prefect
def test_stage_order_is_dvcs_own_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_project(tmp_path / "p", DAG_STAGES)
    monkeypatch.chdir(tmp_path)      # DVC's API resolves paths against the cwd unless given the root
    assert dvc.stage_order(root) == DAG_ORDER


def test_stage_order_has_foreach_stages_sub_pipelines_and_no_data_sources(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p", {
        "merge": {"cmd": "python tool.py write merged.txt part-b.txt part-a.txt", "deps": ["part-a.txt", "part-b.txt"],
                  "outs": ["merged.txt"]},
        "part": {"foreach": ["b", "a"], "do": {"cmd": "python tool.py write part-${item}.txt raw.txt",
                                                "deps": ["raw.txt"], "outs": ["part-${item}.txt"]}}})
    (root / "raw.txt").write_text("raw\n")
    subprocess.run(dvc.dvc_command("add", "-q", "raw.txt"), cwd=root, env=dvc.subprocess_env(), check=True)
    (root / "sub").mkdir()
    report = {"cmd": "python ../tool.py write report.txt ../merged.txt", "deps": ["../merged.txt"], "outs": ["report.txt"]}
    (root / "sub/dvc.yaml").write_text(yaml.safe_dump({"stages": {"report": report}}))
    order = dvc.stage_order(root)
    assert sorted(order) == ["merge", "part@a", "part@b", "sub/dvc.yaml:report"]
    assert order.index("part@a") < order.index("merge") < order.index("sub/dvc.yaml:report")
    assert order.index("part@b") < order.index("merge")
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {      # a cycle: DVC refuses the pipeline
        f"s{i}": {"cmd": f"python tool.py write {i}.txt", "deps": [f"{(i + 1) % 3}.txt"], "outs": [f"{i}.txt"]}
        for i in range(3)}}))
    cycle = r"DVC cannot read the pipeline: Same item\(s\) are defined as both a dependency and an output"
    with pytest.raises(ConfigError, match=cycle):
        dvc.stage_order(root)


def test_ran_or_skipped_is_what_dvc_reproduced(tmp_path: Path) -> None:
    """From `Repo.reproduce`'s result, not from DVC's log lines; a sub-pipeline's stage by its address."""
    root = make_project(tmp_path / "p", {"extract": DAG_STAGES["extract"]})
    (root / "sub").mkdir()
    (root / "sub/dvc.yaml").write_text(yaml.safe_dump({"stages": {"report": {
        "cmd": "python ../tool.py write report.txt ../data/traces.txt", "deps": ["../data/traces.txt"],
        "outs": ["report.txt"]}}}))
    lines: list[str] = []
    assert dvc.run_stage(root, "extract", on_line=lines.append).status == "ran"
    assert "wrote data/traces.txt" in lines
    assert dvc.run_stage(root, "extract", on_line=lambda l: None).status == "skipped"
    assert dvc.run_stage(root, "sub/dvc.yaml:report", on_line=lambda l: None).status == "ran"
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"extract": {**DAG_STAGES["extract"],
                                                                          "cmd": "python tool.py fail"}}}))
    with pytest.raises(dvc.StageFailed) as failed:
        dvc.run_stage(root, "extract", on_line=lambda l: None)
    assert (failed.value.exit_code, failed.value.transient) == (1, False)


def test_keyboard_interrupt_and_stragglers_leave_no_process(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p", {"sleep": {"cmd": "python tool.py sleep"},
                                         "daemon": {"cmd": "python tool.py daemon"}})

    def interrupt(line: str) -> None:
        if line == "sleeping":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dvc.run_stage(root, "sleep", on_line=interrupt, timeout_s=60)
    assert group_survivors(json.loads((root / "pids.json").read_text())["pgid"]) == []
    # A stage that exits 0 but leaves a child holding its output: the stage is done, the child is killed.
    start = time.monotonic()
    assert dvc.run_stage(root, "daemon", on_line=lambda l: None, timeout_s=60).status == "ran"
    assert time.monotonic() - start < 30
    assert group_survivors(json.loads((root / "pids.json").read_text())["pgid"]) == []


def test_killing_the_caller_with_sigkill_leaves_no_process(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p", {"sleep": {"cmd": "python tool.py sleep"}})
    caller = subprocess.Popen([sys.executable, "-c", "from pipelines import dvc; "
                               "dvc.run_stage('.', 'sleep', on_line=print)"], cwd=root, stdout=subprocess.DEVNULL)
    info = wait_for_file(root / "pids.json")
    caller.kill()      # no finally runs: the guard's parent-death signal must do the cleanup
    caller.wait()
    assert group_survivors(info["pgid"], wait_s=10) == []


# ---------------------------------------------------------------------------------- flows
def test_pipeline_flow_runs_the_dag_and_publishes_the_eval_table(prefect_server: str, tmp_path: Path) -> None:
    from pipelines.flows import ARTIFACT_EVAL_MD, ARTIFACT_EVAL_TABLE, ARTIFACT_PLOTS, ARTIFACT_PROGRESS, pipeline

    root = make_project(tmp_path / "p", DAG_STAGES, gamma=2.0)
    state = pipeline(repo=str(root), return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert [s["stage"] for s in summary["stages"]] == DAG_ORDER and {s["status"] for s in summary["stages"]} == {"ran"}
    assert summary["eval"]["latent"]["accuracy"] == 0.5
    arts = artifacts_of(state.state_details.flow_run_id)
    assert set(arts) == set(summary["artifacts"]) == {
        ARTIFACT_PROGRESS, ARTIFACT_EVAL_MD, ARTIFACT_EVAL_TABLE, ARTIFACT_PLOTS}
    assert (arts[ARTIFACT_PROGRESS].type, arts[ARTIFACT_PROGRESS].data) == ("progress", 100.0)
    assert arts[ARTIFACT_PROGRESS].description == "stage 6 of 6 done: evaluate (ran)"
    table = json.loads(arts[ARTIFACT_EVAL_TABLE].data)
    assert {"name": "latent", "accuracy": 0.5, "n": 4, "retention": None, "compression": None} in table
    assert {"name": "summary", "accuracy": None, "n": None, "retention": 1.0, "compression": 3.0} in table
    assert arts[ARTIFACT_EVAL_MD].data == (root / "metrics/eval.md").read_text()
    png = base64.b64encode((root / "plots/eval/accuracy.png").read_bytes()).decode()
    assert arts[ARTIFACT_PLOTS].type == "markdown"
    assert f"![plots/eval/accuracy.png](data:image/png;base64,{png})" in arts[ARTIFACT_PLOTS].data


def test_missing_eval_files_are_a_warning_not_a_failure(prefect_server: str, tmp_path: Path) -> None:
    from pipelines.flows import pipeline

    root = make_project(tmp_path / "p", {"extract": DAG_STAGES["extract"]})
    summary = pipeline(repo=str(root))
    assert summary["artifacts"] == ["codi-progress"] and summary["eval"] is None
    assert summary["stages"][0]["status"] == "ran"


def test_failing_stage_fails_the_flow_by_name_and_later_stages_do_not_run(prefect_server: str, tmp_path: Path) -> None:
    from pipelines.flows import pipeline

    root = make_project(tmp_path / "p", {
        "extract": DAG_STAGES["extract"],
        "precompute": {"cmd": "python tool.py fail", "deps": ["data/traces.txt"], "outs": ["data/cache.txt"]},
        "sft": DAG_STAGES["sft"]})
    state = pipeline(repo=str(root), retries=2, retry_delay_s=0, return_state=True)
    with pytest.raises(dvc.StageFailed) as info:
        state.result()
    msg = str(info.value)
    assert msg.startswith("stage 'precompute' failed with exit code 1 (deterministic, not retried)"), msg
    assert "ValueError: boom in stage" in msg
    assert (root / "attempts.txt").read_text() == "x\n"           # a traceback is not retried
    assert (root / "data/traces.txt").exists() and not (root / "models/sft.txt").exists()
    progress = artifacts_of(state.state_details.flow_run_id)["codi-progress"]
    assert (round(progress.data, 1), progress.description) == (33.3, "stage 2 of 3 failed: precompute")


def test_transiently_killed_stage_is_retried(prefect_server: str, tmp_path: Path) -> None:
    from pipelines.flows import pipeline

    root = make_project(tmp_path / "p", {"flaky": {"cmd": "python tool.py killonce out.txt", "outs": ["out.txt"]}})
    summary = pipeline(repo=str(root), retries=1, retry_delay_s=0)
    assert [(s["stage"], s["status"]) for s in summary["stages"]] == [("flaky", "ran")]
    assert (root / "attempts.txt").read_text() == "x\nx\n" and (root / "out.txt").read_text() == "ok"


def test_timed_out_stage_leaves_no_process(prefect_server: str, tmp_path: Path) -> None:
    from pipelines.flows import pipeline

    root = make_project(tmp_path / "p", {"sleep": {"cmd": "python tool.py sleep"}})
    with pytest.raises(process.ProcessTimeout, match="stage 'sleep' timed out after 4 s"):
        pipeline(repo=str(root), stage_timeout_s=4, retries=1)
    assert group_survivors(json.loads((root / "pids.json").read_text())["pgid"]) == []


def test_cancelled_flow_run_leaves_no_process(prefect_server: str, tmp_path: Path) -> None:
    """Prefect cancels a served flow run with SIGTERM to its process (the runner's kill): the stage's group
    must go with it."""
    root = make_project(tmp_path / "p", {"sleep": {"cmd": "python tool.py sleep"}})
    env = dict(os.environ, PREFECT_API_URL=prefect_server)
    run = subprocess.Popen([sys.executable, "-c", "from pipelines.flows import pipeline; pipeline(repo='.')"],
                           cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    info = wait_for_file(root / "pids.json")
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) != 0
    assert group_survivors(info["pgid"]) == []


def test_experiments_flow_publishes_one_row_per_experiment(prefect_server: str, tmp_path: Path) -> None:
    from pipelines.flows import ARTIFACT_EXPERIMENTS, experiments

    stages = {"prepare": DAG_STAGES["extract"],
              "evaluate": {**DAG_STAGES["evaluate"], "deps": ["data/traces.txt"]}}
    root = make_project(tmp_path / "p", stages)
    state = experiments(grid={"gamma": [0.5, 2.0]}, repo=str(root), return_state=True)
    assert state.is_completed(), state.message
    rows = state.result()
    assert [(r["gamma"], r["latent.accuracy"], r["status"]) for r in rows] == [(0.5, 0.125, "ok"), (2.0, 0.5, "ok")]
    assert set(rows[0]) == {"experiment", "status", "gamma", "explicit.accuracy", "explicit.n", "latent.accuracy",
                            "latent.n", "retention", "compression"}     # no deps, outs, other params
    assert rows[0]["experiment"] != rows[1]["experiment"]
    table = json.loads(artifacts_of(state.state_details.flow_run_id)[ARTIFACT_EXPERIMENTS].data)
    assert [r["experiment"] for r in table] == [r["experiment"] for r in rows]
    assert yaml.safe_load((root / "params.yaml").read_text())["gamma"] == 1.0      # the workspace is untouched
    with pytest.raises(ConfigError, match="'gama' is not a key of"):
        experiments(grid={"gama": [1.0]}, repo=str(root))


class ConnectionRecorder:
    """A local "proxy" that records the first line of every connection made to it and closes it: with
    HTTP(S)_PROXY pointing here, an attempt to reach the network shows up here instead of leaving the machine."""

    def __init__(self) -> None:
        import socket
        import threading

        self.seen: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:       # closed
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    self.seen.append(conn.recv(256).split(b"\r\n")[0].decode("ascii", "replace"))
                except OSError:
                    self.seen.append("(no request line)")

    def close(self) -> None:
        self.sock.close()


def test_first_run_on_an_empty_prefect_home_passes_and_stays_offline(tmp_path: Path) -> None:
    """What a new user does: `python -m pipelines run` with no Prefect setting at all. The temporary server's first
    start (it creates its database) takes longer than Prefect's 20 s default on 2 cores; nothing may reach out."""
    root = make_project(tmp_path / "p", {"extract": DAG_STAGES["extract"]})
    proxy = ConnectionRecorder()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFECT_") and k not in pipelines.OFFLINE_DEFAULTS and k.lower() not in
           ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), HTTP_PROXY=proxy.url, HTTPS_PROXY=proxy.url,
               ALL_PROXY=proxy.url, NO_PROXY="127.0.0.1,localhost")     # the temporary server is local
    try:
        proc = subprocess.run([sys.executable, "-m", "pipelines", "run", "--repo", str(root)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        time.sleep(0.5)
    finally:
        proxy.close()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "pipeline done: 1 stages, ran ['extract']" in out
    assert "Failed to send telemetry" not in out and "Timed out" not in out, out[-3000:]
    assert proxy.seen == []
