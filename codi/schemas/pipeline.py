"""The `pipeline` section: the Prefect deployment (pipelines/). Not a DVC dependency."""

from __future__ import annotations

from dataclasses import dataclass

from codi.infra.config import option


@dataclass(frozen=True)
class PipelineConfig:
    """The Prefect deployment (pipelines/): schedule and retries. Not a DVC dependency."""

    cron: str = option("schedule of the served pipeline deployment", nonempty=True)
    retries: int = option("retries of a stage that failed transiently", ge=0)
    retry_delay_s: float = option("seconds before a retry", ge=0)
