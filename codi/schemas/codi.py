"""The `codi` section (and the top-level alpha, beta, gamma): the CODI options plus the training hyperparameters.

The CODI options themselves (latent_steps, kd_*, recon_*, the latent curriculum) are codi.schemas.options.CodiOptions,
the type a saved codi model records; this module adds what only the training run needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from codi.infra.config import ConfigError, option
from codi.schemas.options import CodiOptions, LossWeights
from codi.schemas.train import TrainConfig


@dataclass(frozen=True)
class CodiConfig(TrainConfig, CodiOptions):
    """`codi` (stage 2b): the CODI options, the training hyperparameters, and the run's own settings."""

    frozen_teacher: str = option("path of a frozen teacher model; \"\" = the shared-weight teacher")
    ss_prob: float = option("scheduled sampling: final probability of feeding a post-latent segment's own argmax",
                            ge=0.0, le=1.0)
    ss_ramp_frac: float = option("share of steps over which ss_prob ramps up linearly from 0", gt=0.0, le=1.0)
    val_accuracy_samples: int = option("val examples decoded with latents at each evaluation (output accuracy); 0 = off",
                                       ge=0)
    # research V: how training starts (a saved model does not need it: codi_config.json is as before)
    projector_init: Literal["default", "identity"] = option(
        "the thought projector's start: default (PyTorch's random init) | identity: both linear maps the identity, so "
        "a latent starts as LayerNorm(GELU(last hidden)), near Coconut's projector-free latent")
    value_ramp_frac: float = option(
        "the value terms' weights (value_weight, value_kd_weight) ramp linearly from 0 to their value over this share "
        "of max_steps, then stay; 0 = off: full weight from the first step", ge=0.0, le=1.0)

    def __post_init__(self) -> None:
        TrainConfig.__post_init__(self)
        CodiOptions.__post_init__(self)
        if self.strategy == "fsdp" and self.recon_weight > 0:
            # the latent probe after training runs the reconstruction decoder on the main process alone, and
            # under FSDP that decoder's weights are sharded over every process
            raise ConfigError("codi.strategy = 'fsdp' with recon_weight > 0: the reconstruction probe needs the "
                              "unsharded model on one process; use strategy: ddp")

    @property
    def options(self) -> CodiOptions:
        """The CODI options alone: what CodiModel takes and a saved model records."""
        return CodiOptions.of(self)


@dataclass(frozen=True)
class TopLevelWeights:
    """params.yaml's top-level loss weights: L = alpha*L_teacher + beta*L_student + gamma*L_kd."""

    alpha: float = option("weight of the teacher CE (L = alpha*Lt + beta*Ls + gamma*Lkd)", ge=0.0)
    beta: float = option("weight of the student CE", ge=0.0)
    gamma: float = option("weight of the KD loss", ge=0.0)

    @property
    def loss_weights(self) -> LossWeights:
        return LossWeights(teacher_ce_weight=self.alpha, student_ce_weight=self.beta, kd_weight=self.gamma)
