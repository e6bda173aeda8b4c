"""Stages `sft` (stage 1: CE on the explicit trace) and `sft_direct` (the no-trace baseline: CE on the answer).

    python -m codi sft | sft_direct              # models/base -> models/<stage>; params.yaml `sft` / `sft_direct`
    torchrun --nproc_per_node=2 -m codi sft      # DDP, the Trainer's own
    dvc exp run -S sft.lora.r=16                 # LoRA (codi.modeling.lora, docs/LORA.md): models/sft merged, + adapter/
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from codi.data.batching import CausalLMCollator
from codi.data.cache import check_tokenizer
from codi.infra.config import ConfigError, to_dict
from codi.infra.device import set_threads
from codi.infra.files import write_json
from codi.infra.hf import load_causal_lm
from codi.infra.launch import maybe_relaunch
from codi.modeling.lora import apply_lora, check_lora, load_for_lora, trainable_summary
from codi.schemas.model import ModelConfig
from codi.schemas.train import SftConfig, TrainConfig
from codi.schemas.wandb import WandbConfig
from codi.tracing.tokens import load_tokenizer, token_ids
from codi.training.checkpoints import run_fingerprint
from codi.training.grouped import LengthGroupedTrainer, LoraTrainer
from codi.training.loop import StagePaths, TrainingJob, train, training_splits
from codi.training.summary import save_loss_png, sft_summary, unigram_loss

TARGET = {"sft": "trace", "sft_direct": "answer"}  # what the loss covers after the prompt


@dataclass(frozen=True)
class SftParams:
    """What these stages read from params.yaml: their own section, `model` (logged) and `wandb`."""

    sft: SftConfig
    sft_direct: TrainConfig
    model: ModelConfig
    wandb: WandbConfig


def run(params: SftParams, stage: str, cache: Path, base: Path, out: Path, checkpoints: Path, metrics: Path,
        plots: Path, live: Path, argv: list[str]) -> int:
    cfg = getattr(params, stage)
    check_lora(cfg.lora, stage)
    if (code := maybe_relaunch(cfg.cpu_processes, argv)) is not None:
        return code
    import torch

    if not (base / "config.json").is_file():
        raise ConfigError(f"{base}: no model here (run the precompute stage first)")
    set_threads(cfg.torch_threads)
    train_ds, val_ds = training_splits(cache)
    tok = load_tokenizer(base)
    check_tokenizer(tok, cache, base)
    trainer_cls, extra = LengthGroupedTrainer, {}
    if cfg.lora.enabled:  # adapters on a frozen base; the final folder is still a plain (merged) HF model
        run_lora = apply_lora(load_for_lora(base, torch.float32, cfg.lora), cfg.lora, token_ids(tok), start=base,
                              gradient_checkpointing=cfg.gradient_checkpointing)
        model, trainer_cls, extra = run_lora.peft, LoraTrainer, {"lora": run_lora}
        print(f"{stage}: LoRA r={cfg.lora.r}: {trainable_summary(model)}")
    else:
        model = load_causal_lm(base, torch.float32)

    job = TrainingJob(
        stage=stage, cfg=cfg, logged={stage: to_dict(cfg), "model": to_dict(params.model)},
        trainer_cls=trainer_cls,
        trainer_kwargs=dict(model=model, train_dataset=train_ds, eval_dataset=val_ds if len(val_ds) else None,
                            data_collator=CausalLMCollator(tok.pad_token_id, TARGET[stage], computed_weight=(
                                cfg.computed_weight if isinstance(cfg, SftConfig) else 1.0), ids=token_ids(tok)),
                            processing_class=tok,
                            group_by_length=cfg.group_by_length, **extra),
        fingerprint=run_fingerprint(stage, __name__, to_dict(cfg), cache / "manifest.json", {"start_model": base}),
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
    write_json(metrics, summary)
    save_loss_png(done.history, ("loss", "eval_loss"), plots / "loss.png", f"{stage}: train and validation loss")
    print(f"{stage}: {summary['steps']} steps in {summary['train_runtime_s']}s ({summary['tokens_per_s']} tokens/s); "
          f"train loss {summary['train_loss']}, val loss {summary['val_loss']} (unigram baseline "
          f"{summary['unigram_val_loss']}); model -> {out}" + (f"; wandb run in {done.wandb_dir}" if done.wandb_dir else ""))
    return 0
