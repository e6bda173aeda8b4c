"""Orchestration of the DVC pipeline with Prefect: flows, deployments, DVC subprocess helpers.

    $ python -m pipelines run | experiments KEY=V1,V2 | serve     (see pipelines/__main__.py)

- `pipelines.flows`: the `pipeline` and `experiments` flows and their artifacts.
- `pipelines.serve`: both as deployments (`prefect.serve`), the pipeline on a cron schedule.
- `pipelines.dvc`: DVC as subprocesses (stage order, stages, experiments, failure classes); no Prefect.
- `pipelines.process`: a streamed subprocess in a process group of its own that never outlives its caller.

Nothing here is imported by `codi/`: `dvc repro` runs the same pipeline without Prefect. This package imports
nothing at import time.
"""
