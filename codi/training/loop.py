"""The shared body of a training stage: arguments, resume, tracking, train, and the final model saved atomically.

    job = TrainingJob(stage="sft", cfg=params.sft, logged={"sft": to_dict(params.sft)}, trainer_cls=LengthGroupedTrainer,
                      model=weights.trainable, weights=weights, data=TrainerData(train, val, collator, tok),
                      fingerprint=fp)
    done = train(job, StagePaths(out=..., checkpoints=..., live=...), params.wandb)   # TrainingRun

Every trainer takes the same arguments: the model, the HF TrainingArguments built here from the stage's section,
the section itself (`section=`, once), the params the run logs (`record=`), the full-or-LoRA strategy
(`weights=`, codi.training.weights) and the data. The trainer writes its model folders, checkpoints (`_save`) and
the final model (`save_final`) alike; the stage gets a TrainingRun, not the trainer.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from codi.data.cache import CacheDataset
from codi.infra.config import ConfigError
from codi.infra.device import describe_resolution
from codi.infra.files import atomic_dir
from codi.schemas.train import TrainConfig
from codi.schemas.wandb import WandbConfig
from codi.training.args import training_arguments
from codi.training.checkpoints import CheckpointDir, CorruptCheckpoint, checkpoint_root, checkpoint_step
from codi.training.tracking import LiveMetrics, experiment_name, finish_wandb, setup_wandb
from codi.training.weights import Weights


@dataclass(frozen=True)
class StagePaths:
    """Where a training stage writes: the final model, its checkpoints, its dvclive folder."""

    out: Path
    checkpoints: Path
    live: Path


@dataclass(frozen=True)
class TrainerData:
    """The data a trainer trains and validates on, and how it batches and tokenizes."""

    train_dataset: Any
    eval_dataset: Any | None               # None: no validation split
    data_collator: Any
    tokenizer: Any


@dataclass
class TrainingJob:
    """What a stage hands the shared loop."""

    stage: str
    cfg: TrainConfig                       # the stage's section: the trainer's `section`
    logged: dict[str, Any]                 # the params the stage read: the wandb run's config, the trainer's `record`
    trainer_cls: type                      # LengthGroupedTrainer or a subclass (CodiTrainer)
    model: Any                             # what the trainer trains
    weights: Weights                       # full or LoRA: what the folders hold (codi.training.weights)
    data: TrainerData
    fingerprint: dict[str, Any]            # what decides the result (codi.training.checkpoints.run_fingerprint)
    args_extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingRun:
    """A finished training, as the stage needs it; `is_main` False on the other ranks of a DDP run."""

    is_main: bool
    model: Any                             # the trained model, unwrapped (DDP)
    steps: int                             # optimizer steps in all, resumed ones included
    world_size: int                        # processes that trained together
    history: list[dict[str, Any]]          # the Trainer's log history (losses, eval metrics)
    best_metric: float | None              # the lowest validation loss (keep: best)
    seconds: float
    steps_this_session: int                # since the resume, if any
    tokens_this_session: int
    wandb_dir: str | None


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
    has_eval = bool(job.data.eval_dataset)
    ck_root = checkpoint_root(paths.checkpoints, job.stage, job.fingerprint)
    in_temp_copy = ck_root != Path(paths.checkpoints)
    # TrainingArguments first: it sets up the distributed state everything below relies on.
    args = training_arguments(job.cfg, output_dir=ck_root, run_name=f"{experiment_name()}-{job.stage}",
                              has_eval=has_eval, section=job.stage, **job.args_extra)
    is_main = args.process_index == 0
    if is_main:
        print(describe_resolution(job.cfg.optimizer, job.cfg.precision, job.stage), flush=True)
        if in_temp_copy:
            print(f"{job.stage}: checkpoints in {ck_root} (this DVC experiment's temporary copy would not outlive a "
                  "kill; a rerun of the same experiment resumes from there)", flush=True)
    with args.main_process_first(local=False, desc="checkpoint folder"):
        try:
            resume = CheckpointDir(ck_root, job.fingerprint).prepare()
        except CorruptCheckpoint:
            if is_main:
                raise
            sys.exit(2)  # the main process found it first and prints the one error line
    args.report_to = setup_wandb(wandb_cfg, job.stage, job.logged, is_main)
    session = SessionStart()
    callbacks = [session] + ([LiveMetrics(paths.live, checkpoint_step(resume) if resume else None)] if is_main else [])
    data = job.data
    trainer = job.trainer_cls(model=job.model, args=args, section=job.cfg, record=job.logged, weights=job.weights,
                              train_dataset=data.train_dataset, eval_dataset=data.eval_dataset,
                              data_collator=data.data_collator, processing_class=data.tokenizer, callbacks=callbacks)
    t0 = time.time()
    trainer.train(resume_from_checkpoint=resume)
    seconds = time.time() - t0
    is_main = trainer.is_world_process_zero()
    trainer.gather_full_state()  # every rank: under FSDP, the final weights are gathered onto rank 0
    if is_main:
        with atomic_dir(paths.out) as tmp:
            trainer.save_final(tmp)
        if in_temp_copy:  # finished: the experiment holds the model, nothing is left to resume
            shutil.rmtree(ck_root, ignore_errors=True)
    state = trainer.state
    return TrainingRun(is_main=is_main, model=trainer.accelerator.unwrap_model(trainer.model), steps=state.global_step,
                       world_size=trainer.args.world_size, history=state.log_history, best_metric=state.best_metric,
                       seconds=seconds, steps_this_session=state.global_step - session.step,
                       tokens_this_session=state.num_input_tokens_seen - session.tokens,
                       wandb_dir=finish_wandb(args.report_to))
