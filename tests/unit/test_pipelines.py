"""pipelines/ without Prefect's server or DVC subprocesses: retry classification, output streaming, grids and
tables, artifacts' markdown, the offline defaults, params and deployments, the command line. The flows and DVC
itself: tests/integration/test_pipelines_flows.py."""

from __future__ import annotations

import base64
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

import pipelines
from codi.infra.config import ConfigError
from pipelines import dvc, process
from pipelines.__main__ import main as cli_main
from pipelines.__main__ import parse_grid, parse_value
from tests.dvc_projects import PIPELINE_PARAMS


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


def test_eval_table_rows() -> None:
    from pipelines.flows import eval_table

    rows = eval_table({"explicit": {"accuracy": 0.5}, "latent": {"accuracy": 0.25, "steps": {"mean": 3}},
                       "retention": 0.5})
    assert rows == [
        {"name": "explicit", "accuracy": 0.5, "steps.mean": None, "retention": None},
        {"name": "latent", "accuracy": 0.25, "steps.mean": 3, "retention": None},
        {"name": "summary", "accuracy": None, "steps.mean": None, "retention": 0.5},
    ]


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


def test_cli_reports_bad_input_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["experiments", "gamma"]) == 1
    assert capsys.readouterr().err == "error: bad override 'gamma': expected KEY=V1[,V2...], e.g. gamma=0.5,1,2\n"


@pytest.mark.parametrize("value", ["a: b", "true", "1e-3", "null", "tiny", "x y", "[1]", 0.5, 1e-05, 7, True, None,
                                   [1, 2], ["max", "min"], {"a": 1}, "it's"])
def test_one_formatter_of_set_values_reads_back_equal(value):
    """`-S key=value` text: what DVC reads back (YAML) is the value asked for, also for a string YAML would read
    as something else; the ladder, the profiles and the flows share it (experiments.dvc_exp)."""
    from codi.infra.config import yaml_value
    from experiments import dvc_exp

    assert yaml_value(dvc_exp.format_value(value)) == value
    assert dvc.format_value is dvc_exp.format_value
    assert dvc_exp.exp_run_args({"k": value}, "n", queue=True)[:5] == ["exp", "run", "--queue", "-n", "n"]
