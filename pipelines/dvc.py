"""DVC for the flows, through DVC's Python API: the stages in the order `dvc repro` runs them, one stage
reproduced (whether it ran is what `Repo.reproduce` returns), experiments and their rows, and the failure
classification the flows retry on. No Prefect here.

    from pipelines.dvc import stage_order, run_stage
    for stage in stage_order(repo):                  # DVC's plan: upstream first
        run_stage(repo, stage, on_line=print)        # StageRun(stage, "ran" | "skipped", seconds), or StageFailed

Every reproduction runs in a subprocess (`python -m pipelines.dvc repro ...`, or `dvc exp run`) through
pipelines.process.run_streaming: its output is streamed, its process group is killed as a whole on every exit
path (killing the DVC process alone leaves the stage command running), and it waits for the repo lock.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from codi.infra.config import ConfigError, flatten, get_dotted
from experiments.dvc_exp import exp_run_args, format_value
from pipelines.process import LineCallback, ProcessTimeout, RunResult, last_lines, run_streaming

__all__ = ["LineCallback", "ProcessTimeout", "RunResult", "StageFailed", "StageRun", "check", "dvc_command",
           "expand_grid", "experiment_name", "experiment_row", "format_value", "is_transient",
           "run_experiment", "run_stage", "stage_exit_code", "stage_order", "subprocess_env"]

# Output that marks a failure as transient: worth a retry after a delay. Matched case-insensitively. DVC's repo
# lock is not here: every command waits for it (`dvc --wait-for-lock`).
TRANSIENT_PATTERNS = (
    # DVC lets go of the repo lock while a stage's command runs and guards that stage's deps and outs with locks
    # of their own, which --wait-for-lock does not wait for: another DVC process that touches them fails at once.
    "it is being blocked by",
    "temporary failure in name resolution",  # hub downloads of a non-default `model.base`
    "connection reset by peer",
    "read timed out",
    "503 service unavailable",
    "502 bad gateway",
)
# A stage killed by one of these did not fail on its own: the OOM killer (SIGKILL), a shutdown or preemption
# (SIGTERM, SIGHUP). A crash (SIGSEGV, SIGABRT) is a bug and deterministic; SIGINT is a person stopping it.
TRANSIENT_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGHUP})

_EXITED_WITH = re.compile(r"exited with (-?\d+)")


# ------------------------------------------------------------------------------------- errors
class StageFailed(RuntimeError):
    """A DVC stage (or experiment) exited with an error. `transient` says whether a retry may help."""

    def __init__(self, stage: str, exit_code: int, tail: Sequence[str], transient: bool, kind: str = "stage") -> None:
        # Every field in args: Prefect pickles exceptions into task states, and unpickling calls cls(*args).
        super().__init__(stage, exit_code, tuple(tail), transient, kind)
        self.stage, self.exit_code, self.tail, self.transient, self.kind = stage, exit_code, tuple(tail), transient, kind

    def __str__(self) -> str:
        how = _describe_exit(self.exit_code)
        why = "transient, may be retried" if self.transient else "deterministic, not retried"
        return f"{self.kind} '{self.stage}' failed with {how} ({why}){last_lines(self.tail)}"


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code} (killed by signal {-code})"
    return f"exit code {code}"


# ------------------------------------------------------------------------------ environment
def subprocess_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every DVC subprocess.

    DVC_NO_ANALYTICS: DVC forks an analytics reporter per command otherwise. PYTHONUNBUFFERED: Python stage
    commands write to a pipe here, and would hold their lines back in a block buffer instead of streaming
    them. PATH starts with this interpreter's bin: the `python` of a stage command is the one running us.
    """
    env = dict(os.environ)
    env.update(DVC_NO_ANALYTICS="1", PYTHONUNBUFFERED="1")
    bin_dir = str(Path(sys.executable).parent)
    if env.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH", "")) if p)
    env.update(extra or {})
    return env


def dvc_command(*args: str) -> list[str]:
    """`dvc ARGS` run by this interpreter's DVC (no dependency on a `dvc` on PATH). `--wait-for-lock`: another
    DVC process at work in the repo (a second run, `dvc status`) makes this one wait, not fail after 3 s."""
    return [sys.executable, "-m", "dvc", "--wait-for-lock", *args]


# ---------------------------------------------------------------------------- classification
def stage_exit_code(result: RunResult) -> int:
    """The stage command's own exit code (DVC reports "failed to run: CMD, exited with N", then exits 255),
    else DVC's exit code."""
    for line in reversed(result.tail):
        m = _EXITED_WITH.search(line)
        if m:
            return int(m.group(1))
    return result.returncode


def is_transient(exit_code: int, tail: Sequence[str]) -> bool:
    """True for failures a retry can fix: a kill from outside (OOM killer, shutdown), a path busy in another DVC
    process, a network hiccup. A Python traceback that exits 1, a missing dependency, a bad param: deterministic."""
    if exit_code < 0 and -exit_code in TRANSIENT_SIGNALS:
        return True
    if exit_code > 128 and exit_code - 128 in TRANSIENT_SIGNALS:   # a shell reports its killed child as 128+N
        return True
    text = "\n".join(tail).lower()
    return any(p in text for p in TRANSIENT_PATTERNS)


def check(result: RunResult, name: str, kind: str = "stage") -> None:
    """Raise StageFailed if `result` is a failure."""
    if result.returncode != 0:
        code = stage_exit_code(result)
        raise StageFailed(name, code, result.tail, is_transient(code, result.tail), kind)


# ------------------------------------------------------------------------------- the stages
def _open_repo(root: Path):
    from dvc.repo import Repo

    # An explicit root: the API resolves paths against it, not the cwd. _wait_for_lock is what `dvc
    # --wait-for-lock` sets: another DVC process at work in the repo makes this one wait, not fail after 3 s.
    return Repo(str(root), _wait_for_lock=True)


def _address(stage: Any) -> str:
    """A stage as `dvc repro` takes it from the repo root: `name` (`name@item`), or `sub/dvc.yaml:name`."""
    return stage.name if stage.path_in_repo == "dvc.yaml" else f"{stage.path_in_repo}:{stage.name}"


def stage_order(repo: str | Path, on_line: LineCallback | None = None) -> list[str]:
    """The stages with a command of every dvc.yaml of the repo, in the order `dvc repro` runs them (DVC's own
    plan, upstream first: a forced dry run), named as `dvc repro` takes them (`name`, `name@item`,
    `sub/dvc.yaml:name`). A dvc.yaml that DVC refuses (syntax, a cycle, two stages writing one path) raises
    ConfigError."""
    from dvc.exceptions import DvcException
    from dvc.logger import set_loggers_level

    root = Path(repo).resolve()
    try:   # quiet: a dry run says "Running stage" for every stage
        with set_loggers_level(logging.WARNING), _open_repo(root) as dvc_repo:
            planned = dvc_repo.reproduce(all_pipelines=True, force=True, dry=True)
    except DvcException as e:
        raise ConfigError(f"{root}: DVC cannot read the pipeline: {e}") from None
    order = [_address(stage) for stage in planned if getattr(stage, "cmd", None)]   # not data sources (.dvc)
    if on_line:
        on_line("stages in DAG order: " + " -> ".join(order))
    return order


@dataclasses.dataclass(frozen=True)
class StageRun:
    """One stage's reproduction: "ran" (DVC reproduced it: it ran its command, or restored its outputs from
    the run cache) or "skipped" (up to date), and how long it took."""

    stage: str
    status: str
    seconds: float


def run_stage(repo: str | Path, stage: str, on_line: LineCallback, timeout_s: float | None = None) -> StageRun:
    """Reproduce STAGE alone in `repo` (`Repo.reproduce(stage, single_item=True)` in a subprocess): DVC decides
    whether it is stale. Raises StageFailed."""
    root = Path(repo).resolve()
    with tempfile.TemporaryDirectory(prefix="pipelines-repro-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "pipelines.dvc", "repro", str(root), stage, str(result)]
        run = run_streaming(cmd, root, on_line, timeout_s, env=subprocess_env(), what=f"stage '{stage}'")
        check(run, stage)
        ran = json.loads(result.read_text())["ran"]
    return StageRun(stage, "ran" if ran else "skipped", run.seconds)


def _repro_main(root: str, stage: str, result: str) -> int:
    """`python -m pipelines.dvc repro ROOT STAGE RESULT_JSON`: run_stage's subprocess. Writes {"ran": bool}, the
    stages `Repo.reproduce` returns; on failure prints DVC's error as `dvc repro` does and exits 255."""
    from dvc.exceptions import DvcException

    try:
        with _open_repo(Path(root)) as dvc_repo:
            done = dvc_repo.reproduce(stage, single_item=True)
    except DvcException as e:
        causes, err = [], e
        while err is not None:
            causes.append(str(err))
            err = err.__cause__
        print("ERROR: " + ": ".join(c for c in causes if c), file=sys.stderr, flush=True)
        return 255
    Path(result).write_text(json.dumps({"ran": any(_address(s) == stage for s in done)}))
    return 0


# -------------------------------------------------------------------------------- experiments
def expand_grid(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """{"gamma": [0.5, 1], "beta": [1]} -> [{"gamma": 0.5, "beta": 1}, {"gamma": 1, "beta": 1}] (keys vary in
    the given order, the last fastest)."""
    if not grid:
        raise ValueError("experiments grid is empty: give at least one key with values, e.g. {'gamma': [0.5, 1.0]}")
    for key, values in grid.items():
        if not isinstance(key, str) or not key or re.search(r"[\s=,]", key):
            raise ValueError(f"experiments grid: bad key {key!r}: expected a dotted params key like 'codi.lr'")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"experiments grid: {key} = {values!r}: expected a non-empty list of values")
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def experiment_name(overrides: Mapping[str, Any], tag: str) -> str:
    """A readable, git-ref-safe, unique experiment name: 'gamma-0.5-<tag>'."""
    text = "-".join(f"{re.split(r'[.:]', k)[-1]}-{format_value(v)}" for k, v in overrides.items())
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")
    slug = re.sub(r"\.{2,}", ".", slug)[:60].rstrip("-.")
    return f"{slug}-{tag}" if slug else f"exp-{tag}"


def run_experiment(repo: str | Path, overrides: Mapping[str, Any], name: str, on_line: LineCallback,
                   timeout_s: float | None = None) -> RunResult:
    """`dvc exp run --temp -n NAME -S k=v ...`: one experiment, run now in a temporary copy of the repo (the
    workspace is untouched; uncommitted edits are included). Raises StageFailed."""
    result = run_streaming(dvc_command(*exp_run_args(overrides, name, temp=True)), repo, on_line, timeout_s,
                           env=subprocess_env(), what=f"experiment '{name}'")
    check(result, name, kind="experiment")
    return result


def experiment_row(repo: str | Path, name: str, param_keys: Sequence[str], metrics_file: str) -> dict[str, Any]:
    """One experiment, its files read at its ref (`dvc.api.read`): name, the overridden params ("gamma" or
    "file.yaml:key"), then the metrics of `metrics_file` only (not every metric and dep of the project)."""
    import dvc.api
    from dvc.exceptions import DvcException

    def read(file: str) -> Any:
        try:
            return yaml.safe_load(dvc.api.read(file, repo=str(Path(repo).resolve()), rev=name))
        except (DvcException, OSError, yaml.YAMLError):
            return None

    row: dict[str, Any] = {"experiment": name}
    for key in param_keys:
        file, _, dotted = key.rpartition(":") if ":" in key else ("params.yaml", "", key)
        data = read(file)
        row[key] = get_dotted(data, dotted) if isinstance(data, dict) else None
    metrics = read(metrics_file)
    row.update(flatten(metrics) if isinstance(metrics, dict) else {})
    return row


if __name__ == "__main__" and sys.argv[1:2] == ["repro"] and len(sys.argv) == 5:
    sys.exit(_repro_main(*sys.argv[2:]))
