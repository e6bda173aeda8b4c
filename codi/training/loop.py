"""The shared body of a training stage: arguments, resume, tracking, train, and the final model saved atomically.

    job = TrainingJob(stage="sft", cfg=params.sft, logged={"sft": to_dict(params.sft)}, trainer_cls=LengthGroupedTrainer,
                      trainer_kwargs={"model": model, "train_dataset": train, ...}, fingerprint=fp, save=save_hf)
    done = train(job, StagePaths(out=..., checkpoints=..., live=...), params.wandb)   # TrainingRun
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from codi.config import ConfigError, TrainConfig, WandbConfig
from codi.data import CacheDataset
from codi.files import atomic_dir
from codi.training.args import training_arguments
from codi.training.checkpoints import CheckpointDir, checkpoint_step
from codi.training.tracking import LiveMetrics, experiment_name, finish_wandb, setup_wandb


@dataclass(frozen=True)
class StagePaths:
    """Where a training stage writes: the final model, its checkpoints, its dvclive folder."""

    out: Path
    checkpoints: Path
    live: Path


@dataclass
class TrainingJob:
    """What a stage hands the shared loop."""

    stage: str
    cfg: TrainConfig
    logged: dict[str, Any]                 # the params the stage read: the wandb run's config
    trainer_cls: type
    trainer_kwargs: dict[str, Any]         # model, datasets, collator, tokenizer, and the trainer's own options
    fingerprint: dict[str, Any]            # what decides the result (codi.training.checkpoints.run_fingerprint)
    save: Callable[[Any, Path], None]      # (trainer, folder) -> writes the final model into the folder
    args_extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainingRun:
    """A finished training: the trainer (state, log history), and what this session (since a resume) did."""

    trainer: Any
    seconds: float
    session: "SessionStart"
    wandb_dir: str | None

    @property
    def steps_this_session(self) -> int:
        return self.trainer.state.global_step - self.session.step

    @property
    def tokens_this_session(self) -> int:
        return self.trainer.state.num_input_tokens_seen - self.session.tokens

    @property
    def is_main(self) -> bool:
        return self.trainer.is_world_process_zero()

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.trainer.state.log_history


class SessionStart(TrainerCallback):
    """Where this session starts (after the Trainer restored a checkpoint's state): step and tokens seen."""

    step = 0
    tokens = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.step, self.tokens = state.global_step, state.num_input_tokens_seen


def training_splits(cache: Path) -> tuple[CacheDataset, CacheDataset]:
    """The train and val splits of the cache; an empty train split is an error that names the file."""
    train_ds, val_ds = CacheDataset(cache / "train.arrow"), CacheDataset(cache / "val.arrow")
    if len(train_ds) == 0:
        raise ConfigError(f"{cache / 'train.arrow'}: the train split is empty")
    return train_ds, val_ds


def train(job: TrainingJob, paths: StagePaths, wandb_cfg: WandbConfig) -> TrainingRun:
    has_eval = bool(job.trainer_kwargs.get("eval_dataset"))
    # TrainingArguments first: it sets up the distributed state everything below relies on.
    args = training_arguments(job.cfg, output_dir=paths.checkpoints, run_name=f"{experiment_name()}-{job.stage}",
                              has_eval=has_eval, **job.args_extra)
    is_main = args.process_index == 0
    with args.main_process_first(local=False, desc="checkpoint folder"):
        resume = CheckpointDir(paths.checkpoints, job.fingerprint).prepare()
    args.report_to = setup_wandb(wandb_cfg, job.stage, job.logged, is_main)
    session = SessionStart()
    callbacks = [session] + ([LiveMetrics(paths.live, checkpoint_step(resume) if resume else None)] if is_main else [])
    trainer = job.trainer_cls(args=args, callbacks=callbacks, **job.trainer_kwargs)
    t0 = time.time()
    trainer.train(resume_from_checkpoint=resume)
    seconds = time.time() - t0
    if trainer.is_world_process_zero():
        with atomic_dir(paths.out) as tmp:
            job.save(trainer, tmp)
    return TrainingRun(trainer, seconds, session, finish_wandb(args.report_to))
