"""DVC as subprocesses: the stage order, `dvc repro` / `dvc exp run` with their output streamed, and the
failure classification the flows retry on. Imports no Prefect (the flows wrap it).

    from pipelines.dvc import stage_order, run_stage
    for stage in stage_order(repo):                  # dvc.yaml's stages, upstream first
        run_stage(repo, stage, on_line=print)        # raises StageFailed(stage, exit_code, tail, transient)

Every DVC command runs through pipelines.process.run_streaming: in a process group of its own that is
killed as a whole on every exit path (killing `dvc` alone leaves the stage command running).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pipelines.process import MESSAGE_LINES, LineCallback, ProcessTimeout, RunResult, last_lines, run_streaming

__all__ = ["LineCallback", "ProcessTimeout", "RunResult", "StageFailed", "StageRun", "check", "comparison_rows",
           "dvc_command", "run_dvc", "exp_show", "expand_grid", "experiment_name", "flatten", "format_value", "is_transient",
           "lookup", "parse_dot", "run_experiment", "run_stage", "stage_exit_code", "stage_order",
           "subprocess_env", "topological_order"]

# Output that marks a failure as transient: worth a retry after a delay. Matched case-insensitively.
TRANSIENT_PATTERNS = (
    "unable to acquire lock",               # another DVC process holds the repo lock (DVC gives up after ~3 s)
    "it is being blocked by",               # ... or the rwlock of an output this stage reads or writes
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
_DOT_EDGE = re.compile(r'^\s*"((?:[^"\\]|\\.)*)"\s*->\s*"((?:[^"\\]|\\.)*)"\s*;?\s*$')
_DOT_NODE = re.compile(r'^\s*"((?:[^"\\]|\\.)*)"\s*;?\s*$')


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
        label = "output" if self.kind == "command" else "last lines"
        return f"{self.kind} '{self.stage}' failed with {how} ({why}){last_lines(self.tail, label)}"


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
    """`dvc ARGS` run by this interpreter's DVC (no dependency on a `dvc` on PATH)."""
    return [sys.executable, "-m", "dvc", *args]


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
    """True for failures a retry can fix: DVC lock contention, a kill from outside (OOM killer, shutdown),
    a network hiccup. A Python traceback that exits 1, a missing dependency, a bad param: deterministic."""
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
def parse_dot(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Nodes (in order of appearance) and edges of `dvc dag --dot` output."""
    nodes: list[str] = []
    edges: list[tuple[str, str]] = []

    def add(n: str) -> None:
        if n not in nodes:
            nodes.append(n)

    for line in text.splitlines():
        if m := _DOT_EDGE.match(line):
            a, b = (json.loads(f'"{g}"') for g in m.groups())
            add(a), add(b)
            edges.append((a, b))
        elif m := _DOT_NODE.match(line):
            add(json.loads(f'"{m.group(1)}"'))
    return nodes, edges


def topological_order(nodes: Sequence[str], edges: Iterable[tuple[str, str]], rank: Callable[[str], Any] = lambda n: 0) -> list[str]:
    """Kahn's algorithm; among stages ready at the same time the lowest `rank` goes first (dvc.yaml order),
    so the order is deterministic. A cycle (DVC refuses those) raises ValueError."""
    order_of = {n: i for i, n in enumerate(nodes)}
    parents: dict[str, set[str]] = {n: set() for n in nodes}
    children: dict[str, set[str]] = {n: set() for n in nodes}
    for a, b in edges:
        parents.setdefault(b, set()).add(a)
        children.setdefault(a, set()).add(b)
        parents.setdefault(a, set())
        children.setdefault(b, set())
    key = lambda n: (rank(n), order_of.get(n, len(order_of)), n)  # noqa: E731
    ready = sorted((n for n, ps in parents.items() if not ps), key=key)
    out: list[str] = []
    while ready:
        n = ready.pop(0)
        out.append(n)
        for c in children[n]:
            parents[c].discard(n)
            if not parents[c]:
                ready.append(c)
        ready.sort(key=key)
    if len(out) != len(parents):
        raise ValueError(f"dependency cycle among stages {sorted(set(parents) - set(out))}")
    return out


def _dvc_yaml_rank(repo: Path) -> Callable[[str], int]:
    """Rank of a stage = position of its name (`name@key` for foreach/matrix stages) in dvc.yaml."""
    import yaml

    try:
        stages = list((yaml.safe_load((repo / "dvc.yaml").read_text()) or {}).get("stages") or {})
    except (OSError, yaml.YAMLError):
        stages = []
    pos = {name: i for i, name in enumerate(stages)}
    return lambda n: pos.get(n.split("@", 1)[0], len(pos))


def stage_order(repo: str | Path, on_line: LineCallback | None = None) -> list[str]:
    """The stages of the repo's pipeline, each after everything it depends on.

    The edges come from `dvc dag --dot`, i.e. from DVC itself (deps matched to outs, directories, foreach
    stages, templating and `wdir` all as DVC resolves them); ties follow dvc.yaml's order."""
    repo = Path(repo)
    lines: list[str] = []
    result = run_dvc(["dag", "--dot"], repo, lines.append, timeout_s=120, what="dvc dag")
    if result.returncode != 0:     # DVC says what is wrong with dvc.yaml first: keep the head of its output
        raise StageFailed("dvc dag", result.returncode, tuple(lines[:MESSAGE_LINES]), False, kind="command")
    nodes, edges = parse_dot("\n".join(lines))
    order = topological_order(nodes, edges, _dvc_yaml_rank(repo))
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


def exp_show(repo: str | Path, timeout_s: float = 300) -> list[dict[str, Any]]:
    """`dvc exp show --json`: the workspace, the baseline commit and its experiments."""
    lines: list[str] = []
    result = run_dvc(["exp", "show", "--json"], repo, lines.append, timeout_s, what="dvc exp show")
    if result.returncode != 0:
        raise StageFailed("dvc exp show", result.returncode, tuple(lines[:MESSAGE_LINES]), False, kind="command")
    text = "\n".join(lines)
    start = text.find("[")     # DVC may print a warning before the JSON
    try:
        return json.loads(text[start:] if start >= 0 else text)
    except json.JSONDecodeError as e:
        raise ValueError(f"dvc exp show --json printed something that is not JSON ({e}): {text[:300]!r}") from None


def iter_experiments(show: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(name, data) of every experiment in `dvc exp show --json` output."""
    for baseline in show:
        for exp in baseline.get("experiments") or ():
            for rev in exp.get("revs") or ():
                if rev.get("data") is not None:
                    yield rev.get("name") or exp.get("name") or rev.get("rev", "")[:7], rev["data"]


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


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"latent": {"acc": 1}} -> {"latent.acc": 1}; lists stay values."""
    if not isinstance(data, Mapping):
        return {prefix: data} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, Mapping) else {f"{prefix}{k}": v})
    return {k.rstrip("."): v for k, v in out.items()}


def param_value(params: Mapping[str, Any], key: str) -> Any:
    """The value of `key` ("gamma", or "file.yaml:key") in exp show's params block."""
    file, _, dotted = key.rpartition(":") if ":" in key else ("params.yaml", "", key)
    return lookup((params.get(file) or {}).get("data") or {}, dotted)


def comparison_rows(show: Sequence[Mapping[str, Any]], names: Sequence[str], param_keys: Sequence[str],
                    metrics_file: str) -> list[dict[str, Any]]:
    """One row per named experiment, in the order of `names`: name, the overridden params (as DVC recorded
    them), then the flattened metrics of `metrics_file` only (not every metric and dep of the project)."""
    found = {name: data for name, data in iter_experiments(show) if name in names}
    rows: list[dict[str, Any]] = []
    for name in names:
        data = found.get(name)
        if data is None:
            continue
        row: dict[str, Any] = {"experiment": name}
        for key in param_keys:
            row[key] = param_value(data.get("params") or {}, key)
        metrics = ((data.get("metrics") or {}).get(metrics_file) or {}).get("data")
        row.update(flatten(metrics or {}))
        rows.append(row)
    return rows

