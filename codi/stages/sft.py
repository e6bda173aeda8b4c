"""Stages `sft` (stage 1: CE on the explicit trace) and `sft_direct` (the no-trace baseline: CE on the answer).

    python -m codi sft | sft_direct              # models/base -> models/<stage>; params.yaml `sft` / `sft_direct`
    torchrun --nproc_per_node=2 -m codi sft      # DDP, the Trainer's own
    dvc exp run -S sft.lora.r=16                 # LoRA (codi.modeling.lora, docs/LORA.md): models/sft merged, + adapter/
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from codi.data.batching import CausalLMCollator
from codi.infra.config import to_dict
from codi.schemas.model import ModelConfig
from codi.infra.kernels import kernels_in_effect
from codi.schemas.kernels import KernelsConfig
from codi.schemas.train import SftConfig, TrainConfig
from codi.schemas.wandb import WandbConfig
from codi.tracing.tokens import token_ids
from codi.training.checkpoints import run_fingerprint
from codi.training.grouped import LengthGroupedTrainer
from codi.training.loop import StagePaths, TrainerData, TrainingJob, train
from codi.training.stage import begin, finish
from codi.training.summary import sft_summary, unigram_loss
from codi.training.weights import load_weights

TARGET = {"sft": "trace", "sft_direct": "answer"}  # what the loss covers after the prompt


@dataclass(frozen=True)
class SftParams:
    """What these stages read from params.yaml: their own section, `model` (logged) and `wandb`."""

    sft: SftConfig
    sft_direct: TrainConfig
    model: ModelConfig
    kernels: KernelsConfig
    wandb: WandbConfig


def run(params: SftParams, stage: str, cache: Path, base: Path, out: Path, checkpoints: Path, metrics: Path,
        plots: Path, live: Path, argv: list[str]) -> int:
    cfg = getattr(params, stage)
    start = begin(stage, cfg, params.kernels, base, cache, argv, missing="run the precompute stage first")
    if isinstance(start, int):
        return start
    import torch

    train_ds, val_ds, tok = start.train, start.val, start.tokenizer
    weights = load_weights(base, torch.float32, cfg.lora)
    # LoRA: adapters on a frozen base; the final folder is still a plain (merged) HF model
    weights.adapt(token_ids(tok), start=base, gradient_checkpointing=cfg.gradient_checkpointing)
    if (line := weights.describe(weights.trainable)) is not None:
        print(f"{stage}: {line}")

    collator = CausalLMCollator(tok.pad_token_id, TARGET[stage], ids=token_ids(tok),
                                computed_weight=cfg.computed_weight if isinstance(cfg, SftConfig) else 1.0)
    job = TrainingJob(
        stage=stage, cfg=cfg, logged={stage: to_dict(cfg), "model": to_dict(params.model)},
        trainer_cls=LengthGroupedTrainer, model=weights.trainable, weights=weights,
        data=TrainerData(train_ds, val_ds if len(val_ds) else None, collator, tok),
        fingerprint=run_fingerprint(stage, __name__, to_dict(cfg), cache / "manifest.json", {"start_model": base},
                                    kernels=kernels_in_effect(params.kernels.cpu)),
        args_extra={"include_num_input_tokens_seen": "non_padding"})
    done = train(job, StagePaths(out=out, checkpoints=checkpoints, live=live), params.wandb)
    if not done.is_main:
        return 0

    key = f"{TARGET[stage]}_ids"
    unigram = (unigram_loss((ex[key] for ex in train_ds), (ex[key] for ex in val_ds), len(tok))
               if len(val_ds) else None)
    summary = sft_summary(done.history, steps=done.steps, examples=len(train_ds), seconds=done.seconds,
                          tokens=done.tokens_this_session, unigram=unigram,
                          best_val_loss=done.best_metric if cfg.keep == "best" else None)
    return finish(done, summary, metrics, plots / "loss.png", ("loss", "eval_loss"),
                  f"{stage}: train and validation loss",
                  f"{stage}: {summary['steps']} steps in {summary['train_runtime_s']}s ({summary['tokens_per_s']} "
                  f"tokens/s); train loss {summary['train_loss']}, val loss {summary['val_loss']} (unigram baseline "
                  f"{summary['unigram_val_loss']}); model -> {out}")
