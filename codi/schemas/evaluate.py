"""The `evaluate` section: explicit-trace vs latent vs no-trace decoding."""

from __future__ import annotations

from dataclasses import dataclass

from codi.infra.config import option
from codi.schemas.modes import MODES


@dataclass(frozen=True)
class EvaluateConfig:
    """`evaluate`: explicit-trace vs latent vs no-trace decoding on held-out problems."""

    modes: list[str] = option("decoders to compare",
                              choices=MODES, nonempty=True)
    splits: list[str] = option("cache splits to evaluate on", choices=("train", "val", "test", "holdout"), nonempty=True)
    max_examples: int = option("examples per split; 0 = all", ge=0)
    batch_size: int = option("examples decoded together", ge=1)
    max_new_tokens: int = option("generated positions (tokens + latents) per example", ge=1)
    max_frames: int = option("generated frames per example", ge=1)
    constrain_actions: bool = option("explicit/latent: after <|action_sep|> write only one of the program's "
                                     "lines (the model still picks which); false = free decoding")
    torch_threads: int = option("torch intra-op threads on CPU; 0 = torch's default", ge=0)
    processes: int = option("processes the evaluation's units (the modes' interleaved decoding; latent's forced "
                            "actions, probe and constant-latent ablation) run in, each with torch_threads threads; 1 = "
                            "all in the stage's process. Every accuracy and probe figure is the same either way; the "
                            "modes are timed batch by batch together, so the wall speedup compares them under the "
                            "same load either way", ge=1)
    bootstrap_samples: int = option("resamples of the percentile bootstrap over problems behind every interval", ge=100)
    bootstrap_seed: int = option("seed of the bootstrap (fixed: a rerun gives the same intervals)")
    ci_level: float = option("confidence level of the intervals", gt=0.5, lt=1.0)
    ablate_latents: bool = option("latent: decode again with every latent input replaced by one constant vector (the "
                                  "mean latent input): what the latents carry is what that loses (codi.evaluation.probe)")
    probe_train_examples: int = option("latent probe: train examples whose blocks fit the linear probe (the first "
                                       "ones of train.arrow); 0 = no probe (codi.evaluation.probe)", ge=0)
