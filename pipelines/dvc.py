"""DVC for the flows: the stage graph and experiment rows from DVC's Python API, `dvc repro` / `dvc exp run` as
subprocesses with their output streamed, and the failure classification the flows retry on. No Prefect here.

    from pipelines.dvc import stage_order, run_stage
    for stage in stage_order(repo):                  # dvc.yaml's stages, upstream first
        run_stage(repo, stage, on_line=print)        # raises StageFailed(stage, exit_code, tail, transient)

Every DVC command runs through pipelines.process.run_streaming, in a process group of its own that is killed as
a whole on every exit path (killing `dvc` alone leaves the stage command running), and waits for the repo lock.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import networkx as nx
import yaml

from codi.config import ConfigError, flatten
from pipelines.process import LineCallback, ProcessTimeout, RunResult, last_lines, run_streaming

__all__ = ["LineCallback", "ProcessTimeout", "RunResult", "StageFailed", "StageRun", "check", "comparison_rows",
           "dvc_command", "exp_show", "expand_grid", "experiment_name", "format_value", "is_transient", "lookup",
           "metric_keys", "run_dvc", "run_experiment", "run_stage", "stage_edges", "stage_exit_code", "stage_graph",
           "stage_order", "subprocess_env"]

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


def run_dvc(args: Sequence[str], repo: str | Path, on_line: LineCallback, timeout_s: float | None, what: str) -> RunResult:
    """`dvc ARGS` in `repo` with the subprocess environment, streamed (see pipelines.process)."""
    return run_streaming(dvc_command(*args), repo, on_line, timeout_s, env=subprocess_env(), what=what)


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


# ------------------------------------------------------------------------------------ the DAG
def stage_graph(repo: str | Path) -> nx.DiGraph:
    """The pipeline as DVC resolves it (deps matched to outs, foreach/matrix, templating, wdir, every dvc.yaml):
    one node per stage with a command, named as `dvc repro` takes it (`name`, `sub/dvc.yaml:name`), in dvc.yaml
    order; an edge runs from a stage to one that depends on it. Data sources (.dvc files) are left out.
    A dvc.yaml that DVC refuses (syntax, a cycle, two stages writing one path) raises ConfigError."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    root = Path(repo).resolve()
    try:
        with Repo(str(root)) as dvc_repo:      # an explicit root: the API resolves paths against it, not the cwd
            index = dvc_repo.index
            stages = [s for s in index.stages if isinstance(s, PipelineStage) and s.cmd]
            stages.sort(key=lambda s: s.path_in_repo != "dvc.yaml")    # the root dvc.yaml first, stable
            name = {s: s.name if s.path_in_repo == "dvc.yaml" else f"{s.path_in_repo}:{s.name}" for s in stages}
            graph = nx.DiGraph()
            graph.add_nodes_from(name.values())
            # DVC's edges point from a stage to the stage it depends on.
            graph.add_edges_from((name[b], name[a]) for a, b in index.graph.edges if a in name and b in name)
    except DvcException as e:
        raise ConfigError(f"{root}: DVC cannot read the pipeline: {e}") from None
    return graph


def stage_edges(repo: str | Path) -> list[tuple[str, str]]:
    """(upstream, downstream) for every dependency between two stages of the pipeline."""
    return list(stage_graph(repo).edges)


def stage_order(repo: str | Path, on_line: LineCallback | None = None) -> list[str]:
    """The stages of the repo's pipeline, each after everything it depends on; among stages that could run at
    the same point, dvc.yaml's order (deterministic)."""
    graph = stage_graph(repo)
    rank = {n: i for i, n in enumerate(graph)}
    order = list(nx.lexicographical_topological_sort(graph, key=rank.__getitem__))
    if on_line:
        on_line("stages in DAG order: " + " -> ".join(order))
    return order


# ------------------------------------------------------------------------------------- stages
@dataclasses.dataclass(frozen=True)
class StageRun:
    """One stage's `dvc repro`: what DVC did and how long it took. status: "ran" (the command ran),
    "skipped" (up to date: "didn't change, skipping"), "restored" (outputs checked out from the run cache)."""

    stage: str
    status: str
    seconds: float

    @property
    def ran(self) -> bool:
        return self.status == "ran"


def run_stage(repo: str | Path, stage: str, on_line: LineCallback, timeout_s: float | None = None) -> StageRun:
    """`dvc repro --single-item STAGE` in `repo`: DVC decides whether it is stale. Raises StageFailed."""
    result = run_dvc(["repro", "--single-item", stage], repo, on_line, timeout_s,
                           what=f"stage '{stage}'")
    check(result, stage)
    status = "ran"
    for line in result.tail:
        if f"'{stage}' didn't change, skipping" in line:
            status = "skipped"
        elif f"'{stage}' is cached - skipping run" in line:
            status = "restored"
    return StageRun(stage, status, result.seconds)


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


def format_value(value: Any) -> str:
    """A value as DVC's `-S key=value` reads it (YAML): true/false, null, numbers, JSON for lists and maps."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value
    return json.dumps(value)


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
    args = ["exp", "run", "--temp", "-n", name]
    for key, value in overrides.items():
        args += ["-S", f"{key}={format_value(value)}"]
    result = run_dvc(args, repo, on_line, timeout_s, what=f"experiment '{name}'")
    check(result, name, kind="experiment")
    return result


def exp_show(repo: str | Path) -> list[dict[str, Any]]:
    """DVC's experiment rows (`dvc.api.exp_show`): one flat row per baseline and experiment of HEAD, with
    "Experiment" (name), "rev", "typ", ..., then every metric, param and dep as a column (named `key`, or
    `file:key` where two files share a key). DVC gives numbers as floats, other values as text, None if absent."""
    import dvc.api
    from dvc.exceptions import DvcException

    root = Path(repo).resolve()
    try:
        return dvc.api.exp_show(repo=str(root))
    except DvcException as e:
        raise RuntimeError(f"{root}: DVC cannot list the experiments: {e}") from None


def metric_keys(repo: str | Path, metrics_file: str, rev: str) -> list[str]:
    """The flattened keys of `metrics_file` (relative to the repo root) at `rev` (an experiment's name);
    [] if it has none there."""
    import dvc.api
    from dvc.exceptions import DvcException

    try:
        data = yaml.safe_load(dvc.api.read(metrics_file, repo=str(Path(repo).resolve()), rev=rev))
    except (DvcException, OSError, yaml.YAMLError):
        return []
    return list(flatten(data)) if isinstance(data, dict) else []


def lookup(data: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """data["a"]["b"] for "a.b" (list items as "a.0"); `default` if absent."""
    cur: Any = data
    for part in dotted.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return default
    return cur


def _column(row: Mapping[str, Any], file: str, key: str) -> Any:
    """exp_show's value of `key` from `file`: its column is `file:key` where another file has the key too."""
    return row.get(f"{file}:{key}", row.get(key))


def comparison_rows(show: Sequence[Mapping[str, Any]], names: Sequence[str], param_keys: Sequence[str],
                    metrics_file: str, keys: Sequence[str]) -> list[dict[str, Any]]:
    """One row per named experiment found in exp_show's rows, in the order of `names`: name, the overridden
    params (as DVC recorded them; "gamma" or "file.yaml:key"), then the metrics `keys` of `metrics_file` only
    (not every metric and dep of the project)."""
    found = {row.get("Experiment"): row for row in show if row.get("Experiment") in names}
    rows: list[dict[str, Any]] = []
    for name in names:
        if name not in found:
            continue
        data = found[name]
        row: dict[str, Any] = {"experiment": name}
        for key in param_keys:
            file, _, dotted = key.rpartition(":") if ":" in key else ("params.yaml", "", key)
            row[key] = _column(data, file, dotted)
        row.update({k: _column(data, metrics_file, k) for k in keys})
        rows.append(row)
    return rows
