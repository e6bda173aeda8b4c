"""The `precompute` section: tokenize, locate locals spans, split by problem."""

from __future__ import annotations

from dataclasses import dataclass

from codi.infra.config import ConfigError, option
from codi.schemas.source_names import source_names


@dataclass(frozen=True)
class PrecomputeConfig:
    """`precompute`: tokenize, locate locals spans, split by problem, write the cache."""

    max_seq_len: int = option("drop examples whose prompt + trace tokens exceed this", ge=1)
    max_frames: int = option("drop examples with more frames than this", ge=1)
    val_fraction: float = option("share of problems in the val split", ge=0.0, lt=1.0)
    test_fraction: float = option("share of problems in the test split", ge=0.0, lt=1.0)
    split_salt: str = option("salt of the stable problem-id hash that assigns splits")
    holdout_sources: list[str] = option("sources kept whole for evaluation only (split `holdout`)", choices=source_names)
    batch_size: int = option("examples per fast-tokenizer batch", ge=1)

    def __post_init__(self) -> None:
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ConfigError(
                f"precompute.val_fraction + precompute.test_fraction = {self.val_fraction + self.test_fraction}: "
                "expected < 1 (some problems must remain for training)"
            )
