"""Stage `codi` (stage 2b): CODI self-distillation of the sft model into latent LINE frames.

    python -m codi codi                      # models/sft -> models/codi; params.yaml `codi`, `alpha`, `beta`, `gamma`
    dvc exp run -S gamma=2.0                 # reruns this stage and evaluate only
    dvc exp run -S codi.lora.r=128           # LoRA (docs/LORA.md): models/codi merged + projector, + adapter/
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from codi.data.values import WithValues
from codi.infra.config import ConfigError, to_dict
from codi.infra.device import resolve_precision
from codi.infra.hf import load_causal_lm
from codi.modeling.latent import identity_projector_
from codi.modeling.model import CodiModel
from codi.infra.kernels import kernels_in_effect
from codi.schemas.codi import CodiConfig, TopLevelWeights
from codi.schemas.kernels import KernelsConfig
from codi.schemas.wandb import WandbConfig
from codi.tracing.tokens import token_ids
from codi.training.checkpoints import run_fingerprint
from codi.training.codi_trainer import CodiTrainer, collate_examples, sub_losses
from codi.training.loop import StagePaths, TrainerData, TrainingJob, train
from codi.training.stage import begin, finish
from codi.training.summary import codi_summary, recon_probe
from codi.training.weights import load_weights


@dataclass(frozen=True)
class CodiParams(TopLevelWeights):
    """What this stage reads from params.yaml: alpha, beta, gamma, `codi`, `kernels` and `wandb`."""

    codi: CodiConfig
    kernels: KernelsConfig
    wandb: WandbConfig


def run(params: CodiParams, cache: Path, sft: Path, out: Path, checkpoints: Path, metrics: Path, plots: Path,
        live: Path, argv: list[str]) -> int:
    cfg = params.codi
    start = begin("codi", cfg, params.kernels, sft, cache, argv, missing="run the sft stage first")
    if isinstance(start, int):
        return start
    import torch

    teacher_path = Path(os.path.expanduser(cfg.frozen_teacher)) if cfg.frozen_teacher else None
    if teacher_path is not None and not (teacher_path / "config.json").is_file():
        raise ConfigError(f"codi.frozen_teacher = {cfg.frozen_teacher!r}: no model folder (config.json) there")
    train_ds, val_ds, tok = start.train, start.val, start.tokenizer
    if cfg.uses_values:  # each LINE span's assigned value (codi.data.values): the value CE / KD targets
        train_ds, val_ds = WithValues(train_ds, tok), WithValues(val_ds, tok)
        print(f"codi: value slots (train) {train_ds.coverage()}")
    dtype = torch.bfloat16 if resolve_precision(cfg.precision)["bf16"] else torch.float32
    weights = load_weights(sft, dtype, cfg.lora)
    teacher = load_causal_lm(teacher_path, dtype) if teacher_path else None
    torch.manual_seed(cfg.seed)  # the projector's initialisation: a rerun (or a resume) starts from the same one
    # LoRA: adapters inside the base; CodiModel wraps the same modules, the projector trains in full. CodiModel
    # checkpoints the teacher itself (non-reentrant): no input-grad hooks needed.
    weights.adapt(token_ids(tok), start=sft, gradient_checkpointing=False)
    try:
        model = CodiModel.from_config(weights.lm, token_ids(tok), cfg, params.loss_weights, frozen_teacher=teacher)
    except ValueError as e:  # a value valid alone but not for this model (kd_layers out of range, ...)
        raise ConfigError(str(e)) from None
    if cfg.projector_init == "identity":  # after the default init drew its numbers: every later draw is as before
        identity_projector_(model.projector)
    if (line := weights.describe(model)) is not None:
        print(f"codi: {line}")

    job = TrainingJob(
        stage="codi", cfg=cfg, trainer_cls=CodiTrainer, model=model, weights=weights,
        logged={"codi": to_dict(cfg), "alpha": params.alpha, "beta": params.beta, "gamma": params.gamma},
        data=TrainerData(train_ds, val_ds if len(val_ds) else None, collate_examples, tok),
        fingerprint=run_fingerprint("codi", __name__, to_dict(cfg), cache / "manifest.json",
                                    {"start_model": sft, "frozen_teacher": teacher_path},
                                    weights=[params.alpha, params.beta, params.gamma],
                                    kernels=kernels_in_effect(params.kernels.cpu)),
        # The teacher's activation checkpointing is CodiModel's own; the Trainer's flag would call
        # gradient_checkpointing_enable on a module that is not a PreTrainedModel.
        # DDP must expect parameters without a gradient when there are steps without latents: latent_steps 0
        # (the projector), or the start of a latent curriculum (the projector and the reconstruction decoder).
        args_extra={"activation_checkpointing": False,
                    "ddp_find_unused_parameters": cfg.latent_steps == 0 or cfg.latent_curriculum_frac > 0})
    done = train(job, StagePaths(out=out, checkpoints=checkpoints, live=live), params.wandb)
    if not done.is_main:
        return 0

    summary = codi_summary(done.history, steps=done.steps, seconds=done.seconds,
                           examples_per_step=cfg.batch_size * cfg.grad_accum * done.world_size,
                           steps_this_session=done.steps_this_session)
    if cfg.recon_weight > 0 and len(val_ds):  # what the latents hold: locals decoded back from them (held out)
        summary.update(recon_probe(done.model, val_ds, cfg.eval_batch_size))
    return finish(done, summary, metrics, plots / "loss.png", ("loss", *sub_losses(cfg), "eval_loss",
                                                               "eval_student_loss"),
                  "codi: loss and sub-losses",
                  f"codi: {summary['steps']} steps in {summary['train_runtime_s']}s; student loss "
                  f"{summary['student_loss_first']} -> {summary['student_loss_last']}; val student loss "
                  f"{summary['val_student_loss']}, val latent accuracy {summary['val_latent_accuracy']}; model -> {out}")
