"""The served deployments: the pipeline on a cron schedule (params.yaml `pipeline.cron` unless --cron),
the experiments on demand. The schedule fires only on a real Prefect server (the steps on any port, and why
PREFECT_API_URL comes before the server starts: docs/ORCHESTRATION.md):

    $ export PREFECT_API_URL=http://127.0.0.1:4200/api PREFECT_SERVER_ANALYTICS_ENABLED=false
    $ prefect server start --host 127.0.0.1 &                  # its UI calls the PREFECT_API_URL it started with
    $ python -m pipelines serve [--cron "0 3 * * *"] [--repo PATH]
    $ prefect deployment run codi-pipeline/scheduled            # or "Run" in the UI

`prefect.serve` runs each flow run in a subprocess of this process, one at a time; stop it with Ctrl-C or
SIGTERM (its schedules are paused on the way out and resume when served again). The cron schedule is in UTC.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import serve as prefect_serve
from prefect.deployments.runner import RunnerDeployment
from prefect.types.entrypoint import EntrypointType

from pipelines.flows import experiments, pipeline, pipeline_config, resolve_repo

PIPELINE_DEPLOYMENT = "scheduled"
EXPERIMENTS_DEPLOYMENT = "on-demand"
DEFAULT_GRID = {"gamma": [0.5, 1.0, 2.0]}   # what a click on "Run" in the UI sweeps unless edited there
TAGS = ["codi-trace"]


def build_deployments(repo: str | Path = ".", cron: str | None = None) -> list[RunnerDeployment]:
    """The two deployments for `repo`: codi-pipeline/scheduled (cron) and codi-experiments/on-demand."""
    root = resolve_repo(repo)
    source = "--cron" if cron is not None else f"{root / 'params.yaml'}: pipeline.cron"
    cron = cron if cron is not None else pipeline_config(root).cron
    # MODULE_PATH: the flow run subprocess imports pipelines.flows wherever `serve` was started from.
    try:
        scheduled = pipeline.to_deployment(
            name=PIPELINE_DEPLOYMENT, cron=cron, parameters={"repo": str(root)}, tags=TAGS,
            entrypoint_type=EntrypointType.MODULE_PATH,
            description=f"All DVC stages of {root} in DAG order (DVC skips what is up to date); cron {cron!r}.")
    except ValueError as e:    # pydantic's ValidationError: keep its one-line reason
        reason = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
        raise ValueError(f"bad cron schedule {cron!r} ({source}): {reason}") from None
    on_demand = experiments.to_deployment(
        name=EXPERIMENTS_DEPLOYMENT, parameters={"repo": str(root), "grid": DEFAULT_GRID}, tags=TAGS,
        entrypoint_type=EntrypointType.MODULE_PATH,
        description=f"A grid of DVC experiments of {root} (parameter grid, e.g. {DEFAULT_GRID}), one comparison table.")
    return [scheduled, on_demand]


def serve(repo: str | Path = ".", cron: str | None = None) -> None:
    """Register both deployments with the Prefect API and run their flow runs until interrupted."""
    deployments = build_deployments(repo, cron)
    if not os.environ.get("PREFECT_API_URL") and not _profile_api_url():
        print("warning: PREFECT_API_URL is not set: serving against a temporary server that the UI cannot see "
              "and that never fires the schedule; start a Prefect server first (docs/ORCHESTRATION.md, "
              "'Serve it, see it, trigger it')")
    # One flow run at a time: both flows work in the same repo, and two DVC processes there contend for its
    # lock. A run that fires while another is in progress waits for the slot instead of failing.
    prefect_serve(*deployments, limit=1)


def _profile_api_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url
