"""Stages `sft` (stage 1) and `sft_direct` (the no-trace baseline): HF Trainer on the cache.

    python -m codi sft          # models/base -> models/sft: CE on the explicit trace after the prompt
    python -m codi sft_direct   # models/base -> models/sft_direct: CE on the answer right after the prompt
    torchrun --nproc_per_node=2 -m codi sft     # DDP: the Trainer's own (gloo on CPU, nccl on GPU)

Same trainer code, two targets. Hyperparameters: params.yaml sections `sft` / `sft_direct`. A rerun
after a kill resumes from the newest complete checkpoint in `checkpoints/<stage>/` (see
codi.training). Writes `models/<stage>/` (HF format, atomically), `metrics/<stage>.json` (final
train/val loss, the unigram baseline, tokens/s, steps) and `plots/<stage>/loss.{tsv,png}`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path

from codi.config import ConfigError, Params, to_dict
from codi.data import CacheDataset
from codi.training import (CheckpointDir, atomic_dir, experiment_name, file_digest, finish_wandb,
                           grouped_trainer_class, model_fingerprint, save_loss_history, set_threads,
                           setup_wandb, training_arguments, write_json)


def unigram_loss(train: CacheDataset, val: CacheDataset, key: str, vocab_size: int) -> float:
    """Cross-entropy (nats/token) on val targets of a unigram model of the train targets (add-one):
    the floor a model that ignores context reaches. `key` is trace_ids or answer_ids."""
    counts = Counter()
    for ex in train:
        counts.update(ex[key])
    total = sum(counts.values()) + vocab_size
    n, nll = 0, 0.0
    for ex in val:
        for t in ex[key]:
            nll -= math.log((counts[t] + 1) / total)
            n += 1
    return nll / max(n, 1)


def run(params: Params, stage: str, cache_dir: Path, base: Path, out: Path, checkpoints: Path,
        metrics: Path, plots: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from codi.batching import CausalLMCollator

    cfg = params.sft if stage == "sft" else params.sft_direct
    target = "trace" if stage == "sft" else "answer"
    if not (base / "config.json").is_file():
        raise ConfigError(f"{base}: no model here (run the precompute stage first)")
    set_threads(cfg.torch_threads)
    train = CacheDataset(cache_dir / "train.arrow")
    val = CacheDataset(cache_dir / "val.arrow")
    if len(train) == 0:
        raise ConfigError(f"{cache_dir}/train.arrow: the train split is empty")
    manifest = (cache_dir / "manifest.json")

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    fingerprint = {"stage": stage, "params": to_dict(cfg), "cache": file_digest(manifest),
                   **model_fingerprint(base)}

    class FinalStep(TrainerCallback):
        """The last step is always validated and saved: metrics and resume see the end state."""

        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= state.max_steps:
                control.should_save = True
                control.should_evaluate = len(val) > 0
            return control

    # TrainingArguments first: it sets up the distributed state the rest relies on.
    args = training_arguments(cfg, output_dir=checkpoints, run_name=f"{experiment_name()}-{stage}",
                              report_to=[], has_eval=len(val) > 0, include_num_input_tokens_seen="non_padding")
    is_main = args.process_index == 0
    with args.main_process_first(local=False, desc="checkpoint folder"):
        resume = CheckpointDir(checkpoints, fingerprint).prepare()
    report_to = setup_wandb(params.wandb, stage, {stage: to_dict(cfg), "model": to_dict(params.model)}, is_main)
    args.report_to = report_to

    trainer_cls = grouped_trainer_class()
    trainer_cls.group_by_length = cfg.group_by_length
    trainer = trainer_cls(model=model, args=args, train_dataset=train, eval_dataset=val if len(val) else None,
                      data_collator=CausalLMCollator(tok.pad_token_id, target), processing_class=tok,
                      callbacks=[FinalStep()])
    t0 = time.time()
    result = trainer.train(resume_from_checkpoint=resume)
    seconds = time.time() - t0
    # FinalStep validated the last step; with keep=best the Trainer reloaded the best one.
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    val_loss = (trainer.state.best_metric if cfg.keep == "best" else evals[-1]) if evals else None

    if trainer.is_world_process_zero():
        with atomic_dir(out) as tmp:
            trainer.save_model(str(tmp))
        history = trainer.state.log_history
        train_losses = [h["loss"] for h in history if "loss" in h]
        key = "trace_ids" if target == "trace" else "answer_ids"
        unigram = unigram_loss(train, val, key, len(tok)) if len(val) else None
        tokens = trainer.state.num_input_tokens_seen - getattr(trainer, "_initial_num_input_tokens_seen", 0)
        summary = {
            "train_loss": round(train_losses[-1], 5) if train_losses else None,
            "val_loss": round(val_loss, 5) if val_loss is not None else None,
            "unigram_val_loss": round(unigram, 5) if unigram is not None else None,
            "steps": trainer.state.global_step,
            "examples": len(train),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),  # non-padding tokens of this session
            "train_runtime_s": round(result.metrics.get("train_runtime", seconds), 1),
        }
        write_json(metrics, summary)
        save_loss_history(history, ("loss", "eval_loss"), plots / "loss.tsv", plots / "loss.png",
                          title=f"{stage}: train and validation loss")
        wandb_dir = finish_wandb(report_to)
        print(f"{stage}: {summary['steps']} steps in {summary['train_runtime_s']}s "
              f"({summary['tokens_per_s']} tokens/s); train loss {summary['train_loss']}, val loss "
              f"{summary['val_loss']} (unigram baseline {summary['unigram_val_loss']}); model -> {out}"
              + (f"; wandb run in {wandb_dir}" if wandb_dir else ""))
    return 0
