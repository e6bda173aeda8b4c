"""Prefect flows over the DVC pipeline. Prefect adds sequencing, retries, logs and artifacts; what is stale
and what is cached stays with DVC (two caches would disagree), so every stage is a `dvc repro` subprocess.

    $ python -m pipelines run                          # one pipeline flow run now
    $ python -m pipelines experiments gamma=0.5,1,2    # a grid of DVC experiments, one comparison table
    $ python -m pipelines serve                        # both as deployments, the pipeline on params' cron

    from pipelines.flows import pipeline, experiments
    pipeline(repo=".")                                 # stage summaries + metrics/eval.json's content
    experiments(grid={"gamma": [0.5, 2.0]})            # one row per experiment

Stages, retries, artifacts and where to see them: docs/ORCHESTRATION.md.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.runtime import flow_run as runtime_flow_run

from codi.infra.config import ConfigError, build, flatten, get_dotted, read_yaml
from codi.schemas.pipeline import PipelineConfig
from pipelines import dvc

EVAL_JSON = "metrics/eval.json"
EVAL_MD = "metrics/eval.md"
PLOTS_DIR = "plots"
ARTIFACT_PROGRESS = "codi-progress"
ARTIFACT_EVAL_MD = "codi-eval"
ARTIFACT_EVAL_TABLE = "codi-eval-table"
ARTIFACT_PLOTS = "codi-plots"
ARTIFACT_EXPERIMENTS = "codi-experiments"
MAX_EMBEDDED_PNG_BYTES = 2 * 1024 * 1024     # a larger plot is named, not embedded (the UI loads it every time)


# ------------------------------------------------------------------------------------ config
def resolve_repo(repo: str | Path) -> Path:
    """The absolute repository root; it must hold a dvc.yaml."""
    root = Path(repo).expanduser().resolve()
    if not (root / "dvc.yaml").is_file():
        raise FileNotFoundError(f"{root}: no dvc.yaml here: pass the project's root as repo")
    return root


def pipeline_config(root: Path, retries: int | None = None, retry_delay_s: float | None = None) -> PipelineConfig:
    """params.yaml's `pipeline` section, with the flow's overrides, validated by the one schema."""
    path = root / "params.yaml"
    raw = read_yaml(path)
    section = raw.get("pipeline") if isinstance(raw, dict) else None
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: missing key pipeline (a mapping with cron, retries, retry_delay_s)")
    overrides = {k: v for k, v in (("retries", retries), ("retry_delay_s", retry_delay_s)) if v is not None}
    source = f"{path} (with flow parameters {overrides})" if overrides else str(path)
    return build(PipelineConfig, {**section, **overrides}, prefix="pipeline.", source=source)


# --------------------------------------------------------------------------------------- tasks
def retry_if_transient(task: Any, task_run: TaskRun, state: State) -> bool:
    """Prefect's retry_condition_fn: retry a StageFailed marked transient, nothing else (a timeout, a bad
    parameter, a traceback in the stage: the same input fails the same way)."""
    exc = state.result(raise_on_failure=False)
    return isinstance(exc, dvc.StageFailed) and exc.transient


@task(name="dvc-stage", task_run_name="{stage}", retry_condition_fn=retry_if_transient,
      cache_policy=NO_CACHE, persist_result=False)
def dvc_stage(repo: str, stage: str, timeout_s: float | None = None) -> dict[str, Any]:
    """`dvc repro --single-item STAGE`, its output streamed into this task run's log."""
    run = dvc.run_stage(repo, stage, on_line=get_run_logger().info, timeout_s=timeout_s)
    if run.status != "ran":
        get_run_logger().info("stage '%s' %s by DVC (up to date)", stage, run.status)
    return {"stage": run.stage, "status": run.status, "seconds": round(run.seconds, 2)}


@task(name="dvc-experiment", task_run_name="{name}", retry_condition_fn=retry_if_transient,
      cache_policy=NO_CACHE, persist_result=False)
def dvc_experiment(repo: str, overrides: dict[str, Any], name: str, timeout_s: float | None = None) -> str:
    """`dvc exp run --temp -n NAME -S k=v ...`, its output streamed into this task run's log."""
    dvc.run_experiment(repo, overrides, name, on_line=get_run_logger().info, timeout_s=timeout_s)
    return name


# ----------------------------------------------------------------------------------- artifacts
def eval_table(data: Any) -> list[dict[str, Any]]:
    """metrics/eval.json as table rows: one row per top-level mapping (a mode, a split: `name` column, nested
    keys flattened to `a.b`), the top-level scalars (retention, compression, ...) in a last row `summary`;
    every row has every column (None where a row has no value)."""
    if not isinstance(data, dict):
        return [{"name": "value", "value": data}]
    rows = [{"name": str(k), **flatten(v)} for k, v in data.items() if isinstance(v, dict)]
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    if scalars:
        rows.append({"name": "summary", **scalars})
    return _same_columns(rows)


def _same_columns(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    return [{c: row.get(c) for c in columns} for row in rows]


def plots_markdown(root: Path, plots: Sequence[Path]) -> str:
    """Markdown that shows each PNG, embedded as a data URI (the UI cannot read files on this machine), under
    its path relative to the repo; one over MAX_EMBEDDED_PNG_BYTES is named with its absolute path instead."""
    lines = [f"# Plots of `{root}`", ""]
    for p in plots:
        rel = p.relative_to(root)
        lines += [f"## {rel}", ""]
        data = p.read_bytes()
        if len(data) > MAX_EMBEDDED_PNG_BYTES:
            lines += [f"`{p}` ({len(data) / 2**20:.1f} MiB: too large to embed)", ""]
        else:
            lines += [f"![{rel}](data:image/png;base64,{base64.b64encode(data).decode('ascii')})", ""]
    return "\n".join(lines)


def publish_eval(root: Path) -> list[str]:
    """Publish eval.md, eval.json (a table) and the plots (images) as artifacts; warn about what is missing.
    Returns their keys."""
    logger = get_run_logger()
    published = []
    md = root / EVAL_MD
    if md.is_file():
        create_markdown_artifact(key=ARTIFACT_EVAL_MD, markdown=md.read_text(), description=f"{md}")
        published.append(ARTIFACT_EVAL_MD)
    else:
        logger.warning("%s not found: no evaluation report artifact (did the evaluate stage write it?)", md)
    js = root / EVAL_JSON
    if js.is_file():
        try:
            data = json.loads(js.read_text())
        except json.JSONDecodeError as e:
            logger.warning("%s is not valid JSON (%s): no evaluation table artifact", js, e)
        else:
            create_table_artifact(key=ARTIFACT_EVAL_TABLE, table=eval_table(data), description=f"{js}")
            published.append(ARTIFACT_EVAL_TABLE)
    else:
        logger.warning("%s not found: no evaluation table artifact (did the evaluate stage write it?)", js)
    plots = sorted((root / PLOTS_DIR).rglob("*.png")) if (root / PLOTS_DIR).is_dir() else []
    if plots:
        create_markdown_artifact(key=ARTIFACT_PLOTS, markdown=plots_markdown(root, plots),
                                 description=f"{len(plots)} plots under {root / PLOTS_DIR}")
        published.append(ARTIFACT_PLOTS)
    else:
        logger.warning("no PNG plots under %s: no plots artifact", root / PLOTS_DIR)
    return published


class Progress:
    """The flow run's progress artifact: "stage k of n", updated as each stage finishes."""

    def __init__(self, stages: Sequence[str]) -> None:
        self.stages, self.done = list(stages), 0
        n = len(self.stages)
        what = f"0 of {n} stages done; next: {self.stages[0]}" if n else "no stages in dvc.yaml"
        self.id = create_progress_artifact(0.0 if n else 100.0, key=ARTIFACT_PROGRESS, description=what)

    def finished(self, stage: str, status: str) -> None:
        self.done += 1
        k, n = self.done, len(self.stages)
        what = f"stage {k} of {n} done: {stage} ({status})" + (f"; next: {self.stages[k]}" if k < n else "")
        update_progress_artifact(self.id, 100.0 * k / n, description=what)

    def failed(self, stage: str) -> None:
        k, n = self.done + 1, len(self.stages)
        update_progress_artifact(self.id, 100.0 * self.done / n, description=f"stage {k} of {n} failed: {stage}")


# --------------------------------------------------------------------------------------- flows
@flow(name="codi-pipeline")
def pipeline(repo: str = ".", retries: int | None = None, retry_delay_s: float | None = None,
             stage_timeout_s: float | None = None) -> dict[str, Any]:
    """Run every DVC stage of `repo` in DAG order (DVC skips what is up to date), with a progress artifact, then
    publish the evaluation.

    Args:
        repo: the project root (holds dvc.yaml and params.yaml).
        retries: retries of a transiently failed stage; default params.yaml pipeline.retries.
        retry_delay_s: seconds before a retry; default params.yaml pipeline.retry_delay_s.
        stage_timeout_s: kill a stage (its whole process group) that runs longer; not retried.
    """
    root = resolve_repo(repo)
    cfg = pipeline_config(root, retries, retry_delay_s)
    stages = dvc.stage_order(root, on_line=get_run_logger().info)
    run = dvc_stage.with_options(retries=cfg.retries, retry_delay_seconds=cfg.retry_delay_s)
    progress = Progress(stages)
    done = []
    for stage in stages:
        try:
            done.append(run(str(root), stage, stage_timeout_s))
        except Exception:      # not on a cancellation or Ctrl-C (BaseException): no API call on the way out
            progress.failed(stage)
            raise
        progress.finished(stage, done[-1]["status"])
    artifacts = [ARTIFACT_PROGRESS, *publish_eval(root)]
    js = root / EVAL_JSON
    return {"repo": str(root), "stages": done, "artifacts": artifacts,
            "eval": json.loads(js.read_text()) if ARTIFACT_EVAL_TABLE in artifacts else None}


def check_grid_keys(root: Path, grid: Mapping[str, Any]) -> None:
    """Every key of the grid must already exist in its params file: a typo would otherwise run the whole
    pipeline with an extra, unused parameter (or fail late in the schema check of a stage)."""
    missing = object()     # not None: `kd_layers: null` is a key that exists
    for key in grid:
        file, _, dotted = key.rpartition(":") if ":" in key else ("params.yaml", "", key)
        data = read_yaml(root / file)
        if get_dotted(data if isinstance(data, dict) else {}, dotted, missing) is missing:
            raise ConfigError(f"experiments grid: {dotted!r} is not a key of {root / file}")


@flow(name="codi-experiments")
def experiments(grid: dict[str, list[Any]], repo: str = ".", metrics_file: str = EVAL_JSON,
                retries: int | None = None, retry_delay_s: float | None = None,
                timeout_s: float | None = None) -> list[dict[str, Any]]:
    """One DVC experiment per point of `grid` (the product of its lists), run one after the other, then ONE
    table artifact comparing them: name, status, the overridden params, the metrics of `metrics_file`.
    A failed experiment does not stop the others; the flow fails at the end.

    Args:
        grid: params keys and the values to try, e.g. {"gamma": [0.5, 1.0, 2.0], "codi.lr": [0.0001]}.
        repo: the project root (a git repository with a commit; holds dvc.yaml and params.yaml).
        metrics_file: the metrics file whose values the table compares.
        retries: retries of a transiently failed experiment; default params.yaml pipeline.retries.
        retry_delay_s: seconds before a retry; default params.yaml pipeline.retry_delay_s.
        timeout_s: kill an experiment (its whole process group) that runs longer; not retried.
    """
    root = resolve_repo(repo)
    cfg = pipeline_config(root, retries, retry_delay_s)
    check_grid_keys(root, grid)
    points = dvc.expand_grid(grid)
    tag = (runtime_flow_run.id or uuid.uuid4().hex)[:6]
    names = [dvc.experiment_name(p, f"{tag}-{i}") for i, p in enumerate(points)]
    run = dvc_experiment.with_options(retries=cfg.retries, retry_delay_seconds=cfg.retry_delay_s)
    failed: dict[str, BaseException] = {}
    for point, name in zip(points, names):
        state = run(str(root), point, name, timeout_s, return_state=True)
        if not state.is_completed():
            exc = state.result(raise_on_failure=False)
            failed[name] = exc if isinstance(exc, BaseException) else RuntimeError(str(state.message))
    rows = []
    for point, name in zip(points, names):
        exc = failed.get(name)
        status = "ok" if exc is None else (
            f"failed: exit code {exc.exit_code}" if isinstance(exc, dvc.StageFailed) else f"failed: {type(exc).__name__}")
        row = dvc.experiment_row(root, name, list(grid), metrics_file) if exc is None else {"experiment": name, **point}
        rows.append({"experiment": name, "status": status, **{k: v for k, v in row.items() if k != "experiment"}})
    rows = _same_columns(rows)
    create_table_artifact(key=ARTIFACT_EXPERIMENTS, table=rows,
                          description=f"{len(rows)} experiments of {root} over {sorted(grid)}; metrics: {metrics_file}")
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(points)} experiments failed: " + "; ".join(map(str, failed.values())))
    return rows
