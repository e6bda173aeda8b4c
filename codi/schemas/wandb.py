"""The `wandb` section: where training runs log. Not a DVC dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from codi.infra.config import option


@dataclass(frozen=True)
class WandbConfig:
    """Where training runs log. Not a DVC dependency: changing where logs go never retrains."""

    mode: Literal["offline", "online", "disabled"] = option("offline runs sync later with `wandb sync`; WANDB_MODE overrides")
    project: str = option("wandb project", nonempty=True)
    entity: str = option("wandb entity (team); \"\" = your default")
