"""pipelines/: the Prefect flows over tiny throwaway DVC projects (tmp git repo + `dvc init`, stages are
`python tool.py ...` one-liners), DVC's stage graph, retry classification, process-group hygiene, artifacts,
the offline defaults, and a first `python -m pipelines run` on an empty PREFECT_HOME.

One Prefect test server for the module (prefect_test_harness, ~11 s), PREFECT_HOME in a tmp dir."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

import pipelines
from codi.config import ConfigError
from pipelines import dvc, process
from pipelines.__main__ import main as cli_main
from pipelines.__main__ import parse_grid, parse_value

# The stage commands of the tiny projects. `write OUT [IN...]` is a stage that reads its inputs and writes OUT.
TOOL = textwrap.dedent(r'''
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    import yaml
    cmd, *args = sys.argv[1:]
    def attempt():
        p = Path("attempts.txt"); n = len(p.read_text().splitlines()) if p.exists() else 0
        p.write_text("x\n" * (n + 1)); return n
    def record_group(pids):
        Path("pids.json").write_text(json.dumps({"pgid": os.getpgid(0), "pids": pids}))
    if cmd == "write":
        out, *ins = args
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("".join(Path(i).read_text() for i in ins) + out + "\n")
        print(f"wrote {out}")
    elif cmd == "evaluate":
        gamma = yaml.safe_load(Path("params.yaml").read_text())["gamma"]
        if gamma < 0:
            raise ValueError(f"gamma = {gamma}: expected >= 0")
        Path("metrics").mkdir(exist_ok=True); Path("plots/eval").mkdir(parents=True, exist_ok=True)
        metrics = {"explicit": {"accuracy": 0.5, "n": 4}, "latent": {"accuracy": gamma / 4, "n": 4},
                   "retention": gamma / 2, "compression": 3.0}
        Path("metrics/eval.json").write_text(json.dumps(metrics))
        Path("metrics/eval.md").write_text("| mode | accuracy |\n|---|---|\n| explicit | 0.5 |\n| latent | %s |\n" % (gamma / 4))
        Path("plots/eval/accuracy.png").write_bytes(b"\x89PNG fake")
        print("evaluated")
    elif cmd == "fail":
        attempt(); raise ValueError("boom in stage")
    elif cmd == "killonce":
        if attempt() == 0:
            print("about to be killed", flush=True); os.kill(os.getpid(), signal.SIGKILL)
        Path(args[0]).write_text("ok")
    elif cmd == "sleep":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        record_group([os.getpid(), child.pid]); print("sleeping", flush=True); time.sleep(120)
    elif cmd == "daemon":
        # exits at once but leaves a child that holds the output pipe open
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        record_group([child.pid]); print("left a child behind")
''')

PIPELINE_PARAMS = {"cron": "0 3 * * *", "retries": 1, "retry_delay_s": 0.0}

# The project's DAG in miniature, listed out of order on purpose.
DAG_STAGES = {
    "evaluate": {"cmd": "python tool.py evaluate", "deps": ["models/codi.txt", "models/sft_direct.txt"],
                 "params": ["gamma"], "metrics": [{"metrics/eval.json": {"cache": False}}],
                 "outs": [{"metrics/eval.md": {"cache": False}}, {"plots/eval": {"cache": False}}]},
    "codi": {"cmd": "python tool.py write models/codi.txt models/sft.txt", "deps": ["models/sft.txt"],
             "params": ["gamma"], "outs": ["models/codi.txt"]},
    "sft_direct": {"cmd": "python tool.py write models/sft_direct.txt data/cache.txt", "deps": ["data/cache.txt"],
                   "outs": ["models/sft_direct.txt"]},
    "sft": {"cmd": "python tool.py write models/sft.txt data/cache.txt", "deps": ["data/cache.txt"],
            "outs": ["models/sft.txt"]},
    "precompute": {"cmd": "python tool.py write data/cache.txt data/traces.txt", "deps": ["data/traces.txt"],
                   "outs": ["data/cache.txt"]},
    "extract": {"cmd": "python tool.py write data/traces.txt", "outs": ["data/traces.txt"]},
}
DAG_ORDER = ["extract", "precompute", "sft_direct", "sft", "codi", "evaluate"]  # ties: dvc.yaml order


def make_project(root: Path, stages: dict[str, Any], gamma: float = 1.0) -> Path:
    """A committed git + DVC project in `root` with these stages."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tool.py").write_text(TOOL)
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (root / "params.yaml").write_text(yaml.safe_dump({"gamma": gamma, "pipeline": PIPELINE_PARAMS}, sort_keys=False))
    (root / ".gitignore").write_text("attempts.txt\npids.json\n")
    env = dvc.subprocess_env()
    for cmd in (["git", "init", "-q"], dvc.dvc_command("init", "-q"), ["git", "add", "-A"],
                ["git", "-c", "user.name=ci", "-c", "user.email=ci@localhost", "commit", "-qm", "tiny project"]):
        subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
    return root


def group_survivors(pgid: int, wait_s: float = 2.0) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, after giving them `wait_s` to go away."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for p in psutil.process_iter(["status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
            except (ProcessLookupError, PermissionError):
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def wait_for_file(path: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory):
    """The module's Prefect test server; yields its API URL."""
    from prefect.settings import (PREFECT_API_URL, PREFECT_HOME, PREFECT_LOGGING_LEVEL,
                                  PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings)
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_HOME", str(home))
        mp.setenv("PREFECT_LOGGING_LEVEL", "WARNING")
        mp.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        with temporary_settings({PREFECT_HOME: str(home), PREFECT_LOGGING_LEVEL: "WARNING",
                                 PREFECT_SERVER_ANALYTICS_ENABLED: False}):
            with prefect_test_harness(server_startup_timeout=120):
                yield PREFECT_API_URL.value()


def artifacts_of(flow_run_id: Any) -> dict[str, Any]:
    """key -> artifact of one flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in found}


# ---------------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize("code, tail, transient", [
    # the repo lock is waited for (`dvc --wait-for-lock`): an error about it is not retried; an output's lock is not
    (255, ["ERROR: Unable to acquire lock. Most likely another DVC process is running or was terminated abruptly."], False),
    (255, ["ERROR: 'data/cache' is busy, it is being blocked by:", "  (PID 12): dvc repro"], True),
    (-9, ["ERROR: failed to reproduce 'codi': failed to run: python -m codi codi, exited with -9"], True),
    (137, ["Killed"], True),
    (-15, [], True),
    (1, ["Traceback (most recent call last):", "ValueError: boom", "ERROR: failed to reproduce 'codi': ... exited with 1"], False),
    (-11, ["exited with -11"], False),                   # a segfault is a bug
    (255, ["ERROR: failed to reproduce 'f': dependency 'b.txt' does not exist"], False),
    (1, ["requests.exceptions.ConnectionError: Read timed out."], True),
])
def test_transient_vs_deterministic(code: int, tail: list[str], transient: bool) -> None:
    assert dvc.is_transient(code, tail) is transient


def test_stage_failed_names_the_stage_exit_code_and_last_lines_and_pickles() -> None:
    import pickle

    result = process.RunResult(255, ("Traceback (most recent call last):", "ValueError: boom",
                                 "ERROR: failed to reproduce 'codi': failed to run: python x.py, exited with 1"), 1.0)
    with pytest.raises(dvc.StageFailed) as info:
        dvc.check(result, "codi")
    err = info.value
    assert (err.stage, err.exit_code, err.transient) == ("codi", 1, False)
    assert str(err).startswith("stage 'codi' failed with exit code 1 (deterministic, not retried) (last lines: ")
    assert "ValueError: boom" in str(err)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)      # Prefect stores exceptions in task states
    killed = dvc.StageFailed("sft", -9, (), True)
    assert "exit code -9 (killed by SIGKILL) (transient, may be retried)" in str(killed)


def test_line_splitter_handles_crlf_progress_bars_and_chunk_boundaries() -> None:
    now = [0.0]
    s = process.LineSplitter(progress_interval_s=5.0, clock=lambda: now[0])
    assert s.feed(b"one\r") == []                 # could be the first half of "\r\n"
    assert s.feed(b"\ntw") == ["one"]
    assert s.feed(b"o\n 10%\r 20%\r 30%\r") == ["two", " 10%"]   # 20%: too soon after 10%; 30%: undecided
    now[0] = 6.0
    assert s.feed(b" 60%\r100%|done\n") == [" 30%", "100%|done"]   # 60%: too soon after 30%; the end is kept
    assert s.feed(b"caf\xc3") == [] and s.feed(b"\xa9 \xff") == []    # a UTF-8 character split across reads
    assert s.flush() == ["caf\u00e9 \ufffd"]
    big = process.LineSplitter()
    assert [len(x) for x in big.feed(b"x" * (process.MAX_LINE_BYTES + 10))] == [process.MAX_LINE_BYTES]


def test_run_streaming_delivers_lines_as_they_come(tmp_path: Path) -> None:
    seen: list[tuple[float, str]] = []
    code = "import time; print('first'); time.sleep(1.0); print('second')"
    result = process.run_streaming([sys.executable, "-c", code], tmp_path, lambda l: seen.append((time.monotonic(), l)))
    assert result.returncode == 0 and [l for _, l in seen] == ["first", "second"]
    assert seen[1][0] - seen[0][0] > 0.8      # 'first' arrived before the sleep, not at exit: no block buffering


def test_grid_expansion_names_and_values() -> None:
    assert dvc.expand_grid({"gamma": [0.5, 1], "codi.lr": [1e-4]}) == [
        {"gamma": 0.5, "codi.lr": 1e-4}, {"gamma": 1, "codi.lr": 1e-4}]
    with pytest.raises(ValueError, match="gamma"):
        dvc.expand_grid({"gamma": []})
    with pytest.raises(ValueError, match="empty"):
        dvc.expand_grid({})
    assert [dvc.format_value(v) for v in (True, None, 0.5, 1e-05, "tiny", [1, 2])] == \
        ["true", "null", "0.5", "1e-05", "tiny", "[1, 2]"]
    assert dvc.experiment_name({"gamma": 0.5, "codi.lr": 1e-4}, "ab12") == "gamma-0.5-lr-0.0001-ab12"
    assert parse_grid(["gamma=0.5,1,2", "model.base=tiny", "codi.single_anchor=true"]) == {
        "gamma": [0.5, 1, 2], "model.base": ["tiny"], "codi.single_anchor": [True]}
    assert parse_value("1e-4") == 1e-4
    with pytest.raises(ValueError, match="KEY=V1"):
        parse_grid(["gamma"])


def test_eval_table_rows_and_comparison_rows() -> None:
    from pipelines.flows import eval_table

    rows = eval_table({"explicit": {"accuracy": 0.5}, "latent": {"accuracy": 0.25, "steps": {"mean": 3}},
                       "retention": 0.5})
    assert rows == [
        {"name": "explicit", "accuracy": 0.5, "steps.mean": None, "retention": None},
        {"name": "latent", "accuracy": 0.25, "steps.mean": 3, "retention": None},
        {"name": "summary", "accuracy": None, "steps.mean": None, "retention": 0.5},
    ]
    # dvc.api.exp_show's rows: a key two files share is a `file:key` column (here `n`, also `lr` of other.yaml)
    fixed = {"rev": "abc1234", "typ": "branch_commit", "Created": "01:19 PM", "parent": None, "State": None,
             "Executor": None}
    exp = {**fixed, "Experiment": "e1", "latent.accuracy": 0.5, "metrics/eval.json:n": 4.0, "metrics/sft.json:n": 9.0,
           "loss": 1.0, "gamma": 2.0, "params.yaml:lr": 0.1, "other.yaml:lr": 0.2, "data/x": "e19921"}
    show = [{**fixed, "Experiment": None, "rev": "workspace", "typ": "baseline", "gamma": 1.0}, exp,
            {**exp, "Experiment": "other"}]
    assert dvc.comparison_rows(show, ["e1", "missing"], ["gamma", "lr", "other.yaml:lr"], "metrics/eval.json",
                               ["latent.accuracy", "n"]) == [
        {"experiment": "e1", "gamma": 2.0, "lr": 0.1, "other.yaml:lr": 0.2, "latent.accuracy": 0.5, "n": 4.0}]


def test_offline_defaults_yield_to_the_environment_and_the_prefect_profile(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for key in pipelines.OFFLINE_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("PREFECT_PROFILES_PATH", raising=False)
    monkeypatch.delenv("PREFECT_PROFILE", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.setenv("DO_NOT_TRACK", "0")                                  # the user's environment
    (tmp_path / "profiles.toml").write_text('active = "mine"\n[profiles.mine]\n'
                                            'PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS = "300"\n')
    pipelines._set_offline_defaults()
    assert os.environ["DO_NOT_TRACK"] == "0"
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" not in os.environ     # the profile's 300 applies
    assert (os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"], os.environ["DVC_NO_ANALYTICS"]) == ("false", "1")
    (tmp_path / "profiles.toml").unlink()
    pipelines._set_offline_defaults()
    assert os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == "180"


def test_plots_markdown_embeds_the_images(tmp_path: Path) -> None:
    from pipelines.flows import MAX_EMBEDDED_PNG_BYTES, plots_markdown

    small, big = tmp_path / "plots/eval/a.png", tmp_path / "plots/big.png"
    small.parent.mkdir(parents=True)
    small.write_bytes(b"\x89PNG small")
    big.write_bytes(b"\0" * (MAX_EMBEDDED_PNG_BYTES + 1))
    md = plots_markdown(tmp_path, [small, big])
    assert f"![plots/eval/a.png](data:image/png;base64,{base64.b64encode(small.read_bytes()).decode()})" in md
    assert f"`{big}` (2.0 MiB: too large to embed)" in md and "base64,AAAA" not in md


def test_pipeline_config_reads_params_and_applies_overrides(tmp_path: Path) -> None:
    from pipelines.flows import pipeline_config

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"pipeline": PIPELINE_PARAMS}))
    cfg = pipeline_config(tmp_path, retries=3)
    assert (cfg.cron, cfg.retries, cfg.retry_delay_s) == ("0 3 * * *", 3, 0.0)
    with pytest.raises(ConfigError, match="pipeline.retries = -1"):
        pipeline_config(tmp_path, retries=-1)
    (tmp_path / "params.yaml").write_text("gamma: 1.0\n")
    with pytest.raises(ConfigError, match="missing key pipeline"):
        pipeline_config(tmp_path)


def test_deployments_carry_the_cron_schedule_and_the_repo(tmp_path: Path) -> None:
    from pipelines.serve import build_deployments

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"pipeline": {**PIPELINE_PARAMS, "cron": "15 4 * * 1"}}))
    scheduled, on_demand = build_deployments(tmp_path)
    assert (scheduled.flow_name, scheduled.name, on_demand.flow_name, on_demand.name) == \
        ("codi-pipeline", "scheduled", "codi-experiments", "on-demand")
    assert [s.schedule.cron for s in scheduled.schedules] == ["15 4 * * 1"] and not on_demand.schedules
    assert scheduled.parameters == {"repo": str(tmp_path.resolve())}
    assert scheduled.entrypoint == "pipelines.flows.pipeline"       # importable from any working directory
    assert [s.schedule.cron for s in build_deployments(tmp_path, cron="*/5 * * * *")[0].schedules] == ["*/5 * * * *"]
    with pytest.raises(ValueError, match="bad cron schedule 'every day' \\(--cron\\)"):
        build_deployments(tmp_path, cron="every day")


# ------------------------------------------------------------------------- DVC, no Prefect
def test_stage_order_comes_from_dvcs_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_project(tmp_path / "p", DAG_STAGES)
    monkeypatch.chdir(tmp_path)      # DVC's API resolves paths against the cwd unless given the root
    assert dvc.stage_order(root) == DAG_ORDER
    assert sorted(dvc.stage_edges(root)) == sorted([
        ("extract", "precompute"), ("precompute", "sft"), ("precompute", "sft_direct"), ("sft", "codi"),
        ("codi", "evaluate"), ("sft_direct", "evaluate")])


def test_stage_graph_has_foreach_stages_sub_pipelines_and_no_data_sources(tmp_path: Path) -> None:
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
    assert dvc.stage_order(root) == ["part@b", "part@a", "merge", "sub/dvc.yaml:report"]    # ties: dvc.yaml order
    assert sorted(dvc.stage_edges(root)) == [("merge", "sub/dvc.yaml:report"), ("part@a", "merge"), ("part@b", "merge")]
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {      # a cycle: DVC refuses the pipeline
        f"s{i}": {"cmd": f"python tool.py write {i}.txt", "deps": [f"{(i + 1) % 3}.txt"], "outs": [f"{i}.txt"]}
        for i in range(3)}}))
    cycle = r"DVC cannot read the pipeline: Same item\(s\) are defined as both a dependency and an output"
    with pytest.raises(ConfigError, match=cycle):
        dvc.stage_order(root)


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


def test_cli_reports_bad_input_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["experiments", "gamma"]) == 1
    assert capsys.readouterr().err == "error: bad override 'gamma': expected KEY=V1[,V2...], e.g. gamma=0.5,1,2\n"


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
