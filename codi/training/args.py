"""TrainingArguments from a training section of params.yaml: every value a user would tune comes from it.

    args = training_arguments(params.sft, output_dir="checkpoints/sft", run_name="workspace-sft", has_eval=True)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from codi.infra.device import resolve_optimizer, resolve_precision, use_cuda
from codi.schemas.train import TrainConfig


def training_arguments(cfg: TrainConfig, output_dir: Path, run_name: str, has_eval: bool, section: str = "",
                       **extra: Any):
    """HF TrainingArguments for `cfg` (params section `section`, named in errors); `extra` holds stage-specific
    settings that win (e.g. codi's own checkpointing)."""
    from transformers import TrainingArguments

    keep_best = cfg.keep == "best" and has_eval
    kw: dict[str, Any] = dict(
        output_dir=str(output_dir),
        run_name=run_name,
        max_steps=cfg.max_steps,
        num_train_epochs=cfg.epochs,
        learning_rate=cfg.lr,
        lr_scheduler_type=cfg.lr_schedule,
        warmup_steps=cfg.warmup_ratio,  # a float < 1 is a ratio of the total steps in transformers 5
        weight_decay=cfg.weight_decay,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.eval_batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        max_grad_norm=cfg.max_grad_norm,
        optim=resolve_optimizer(cfg.optimizer, f"{section or 'training'}.optimizer"),
        **resolve_precision(cfg.precision),
        activation_checkpointing=cfg.gradient_checkpointing,
        seed=cfg.seed,
        data_seed=cfg.seed,
        logging_strategy="steps",
        logging_steps=cfg.logging_steps,
        logging_first_step=True,
        # The Trainer's DefaultFlowCallback also evaluates and saves at max_steps: metrics and resume see the end.
        eval_strategy="steps" if has_eval else "no",
        eval_steps=cfg.eval_steps,
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit or None,
        load_best_model_at_end=keep_best,
        metric_for_best_model="eval_loss" if keep_best else None,
        greater_is_better=False if keep_best else None,
        report_to=[],  # wandb and dvclive are set up by codi.training.tracking, not by name
        remove_unused_columns=False,
        dataloader_num_workers=0,
        # gloo for CPU processes under a launcher; the Trainer picks nccl on GPUs. Single process: none.
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not use_cuda() else None,
        ddp_find_unused_parameters=False,
        disable_tqdm=False,
        use_cpu=not use_cuda(),
    )
    kw.update(extra)
    return TrainingArguments(**kw)
