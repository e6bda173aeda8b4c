"""Stage `codi` (stage 2b): CODI self-distillation of the sft model into latent LINE frames.

    python -m codi codi [--sft models/sft] [--out models/codi]
    torchrun --nproc_per_node=2 -m codi codi            # DDP, the Trainer's own
    dvc exp run -S gamma=2.0                            # reruns this stage and evaluate only

The model is codi.modeling.CodiModel (the reference design of seed/train_codi.py, batched); this
module only wires it into the HF Trainer: the scheduled-sampling ramp as a pure function of the step,
sub-losses averaged over each logging window, validation (losses on the val split plus the latent
decoder's output accuracy on `codi.val_accuracy_samples` val examples), checkpoints that hold model +
projector + optimizer + scheduler + RNG and are loadable by `load_codi_model`, and the final model in
`models/codi/` (HF config + weights with tied embeddings stored once, tokenizer, thought projector,
resolved codi config). Metrics: `metrics/codi.json`; plots: `plots/codi/loss.{tsv,png}`.
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from codi.config import CodiConfig, ConfigError, Params, to_dict
from codi.data import CacheDataset
from codi.training import (CheckpointDir, atomic_dir, experiment_name, file_digest, finish_wandb,
                           model_fingerprint, save_loss_history, set_threads, setup_wandb,
                           training_arguments, write_json)

SUB_LOSSES = ("teacher_loss", "student_loss", "kd_loss")


def collate_examples(batch: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The codi contract: the model takes the example dicts themselves."""
    return {"examples": [{"prompt_ids": ex["prompt_ids"], "trace_ids": ex["trace_ids"], "spans": ex["spans"]}
                         for ex in batch]}


def ss_rng(seed: int, step: int, micro: int, rank: int) -> random.Random:
    """Scheduled-sampling draws: a pure function of (seed, step, micro-batch, rank), so a resumed
    run draws what the uninterrupted one would have (string seeds hash with sha512: stable)."""
    return random.Random(f"codi-ss/{seed}/{step}/{micro}/{rank}")


def load_codi_weights(model, ckpt: str | Path) -> None:
    """Load base weights + projector saved by save_codi_model into an existing CodiModel."""
    from safetensors.torch import load_file

    from codi.modeling.io import PROJECTOR_FILE

    ckpt = Path(ckpt)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("model*.safetensors")):
        state.update(load_file(str(f)))
    result = model.model.load_state_dict(state, strict=False)
    tied = {k for k in result.missing_keys if k.endswith("lm_head.weight")} if model.model.config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ValueError(f"{ckpt}: weights do not match the model (missing {sorted(set(result.missing_keys) - tied)[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]})")
    model.model.tie_weights()
    model.projector.load_state_dict(load_file(str(ckpt / PROJECTOR_FILE)))


def make_trainer_class():
    from codi.training import grouped_trainer_class
    Trainer = grouped_trainer_class()

    from codi.answers import answers_match
    from codi.decoding import iter_decode
    from codi.modeling import save_codi_model, ss_ramp

    class CodiTrainer(Trainer):
        """HF Trainer for CodiModel: overrides only loss, logging, evaluation and (de)serialisation."""

        def __init__(self, *a, codi_cfg: CodiConfig, val_answers: list[str], **kw):
            super().__init__(*a, **kw)
            self.codi_cfg = codi_cfg
            self.group_by_length = codi_cfg.group_by_length
            self.val_answers = val_answers
            self._window: dict[str, list[float]] = defaultdict(list)
            self._micro = (-1, 0)  # (step, micro-batch index within it)

        def ss_prob(self) -> float:
            c = self.codi_cfg
            return ss_ramp(self.state.global_step, self.state.max_steps, c.ss_prob, c.ss_ramp_frac)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            step = self.state.global_step
            micro = self._micro[1] + 1 if self._micro[0] == step else 0
            self._micro = (step, micro)
            p = self.ss_prob() if model.training else 0.0
            rng = ss_rng(self.codi_cfg.seed, step, micro, self.args.process_index) if p > 0 else None
            out = model(inputs["examples"], ss_prob=p, ss_rng=rng)
            if model.training:
                for k in SUB_LOSSES:
                    self._window[k].append(out[k].item())
            return (out["loss"], out) if return_outputs else out["loss"]

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if "loss" in logs and self._window:  # a training log: sub-losses averaged over the window
                for k, v in self._window.items():
                    logs[k] = round(sum(v) / len(v), 6)
                logs["ss_prob"] = round(self.ss_prob(), 6)
                self._window.clear()
            super().log(logs, start_time)

        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
            ds = eval_dataset if eval_dataset is not None else self.eval_dataset
            core = self.accelerator.unwrap_model(self.model)
            was_training = core.training
            core.eval()
            world, rank = self.args.world_size, self.args.process_index
            sums = torch.zeros(len(SUB_LOSSES) + 2, dtype=torch.float64)  # loss, subs..., count
            bs = self.args.per_device_eval_batch_size
            mine = list(range(rank, len(ds), world))  # each rank a shard; sums all-reduced below
            with torch.no_grad():
                for s in range(0, len(mine), bs):
                    batch = [ds[k] for k in mine[s:s + bs]]
                    out = core(collate_examples(batch)["examples"])
                    vals = [out["loss"].item(), *(out[k].item() for k in SUB_LOSSES)]
                    sums[:-1] += torch.tensor(vals, dtype=torch.float64) * len(batch)
                    sums[-1] += len(batch)
            if world > 1:
                torch.distributed.all_reduce(sums)
            n = max(sums[-1].item(), 1.0)
            metrics = {f"{metric_key_prefix}_loss": sums[0].item() / n}
            for k, v in zip(SUB_LOSSES, sums[1:-1].tolist()):
                metrics[f"{metric_key_prefix}_{k}"] = v / n
            k_acc = min(self.codi_cfg.val_accuracy_samples, len(ds))
            if k_acc:
                exs = [ds[k] for k in range(k_acc)]
                results = list(iter_decode(
                    "latent", core.model, self.processing_class, [e["prompt_ids"] for e in exs],
                    projector=core.projector, latent_steps=core.latent_steps, batch_size=bs,
                    max_new_tokens=max(len(e["trace_ids"]) for e in exs) + 64,
                    max_frames=max(e["trace_ids"].count(core.token_ids.frame_sep) for e in exs) + 8))
                hits = sum(answers_match(r.answer, truth) for r, truth in zip(results, self.val_answers))
                metrics[f"{metric_key_prefix}_latent_accuracy"] = hits / k_acc
            if was_training:
                core.train()
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

        def _save(self, output_dir: str | None = None, state_dict=None) -> None:
            if not self.args.should_save:
                return
            output_dir = output_dir or self.args.output_dir
            core = self.accelerator.unwrap_model(self.model)
            save_codi_model(core, self.processing_class, output_dir,
                            extra={"step": self.state.global_step, "experiment": experiment_name()})
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

        def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
            load_codi_weights(self.accelerator.unwrap_model(model or self.model), resume_from_checkpoint)

        def _load_best_model(self) -> None:
            load_codi_weights(self.accelerator.unwrap_model(self.model), self.state.best_model_checkpoint)

    return CodiTrainer


def run(params: Params, cache_dir: Path, sft: Path, out: Path, checkpoints: Path, metrics: Path,
        plots: Path) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from codi.modeling import CodiModel
    from codi.tokens import token_ids

    cfg = params.codi
    if not (sft / "config.json").is_file():
        raise ConfigError(f"{sft}: no model here (run the sft stage first)")
    teacher_path = Path(os.path.expanduser(cfg.frozen_teacher)) if cfg.frozen_teacher else None
    if teacher_path is not None and not (teacher_path / "config.json").is_file():
        raise ConfigError(f"codi.frozen_teacher = {cfg.frozen_teacher!r}: no model folder (config.json) there")
    set_threads(cfg.torch_threads)
    train = CacheDataset(cache_dir / "train.arrow")
    val = CacheDataset(cache_dir / "val.arrow")
    if len(train) == 0:
        raise ConfigError(f"{cache_dir}/train.arrow: the train split is empty")

    tok = AutoTokenizer.from_pretrained(sft)
    dtype = torch.bfloat16 if _use_bf16(cfg) else torch.float32
    base = AutoModelForCausalLM.from_pretrained(sft, dtype=dtype)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=dtype) if teacher_path else None
    torch.manual_seed(cfg.seed)  # the projector's initialisation: a rerun (or a resume) starts from the same one
    try:
        model = CodiModel.from_config(base, token_ids(tok), cfg, params.alpha, params.beta, params.gamma,
                                      frozen_teacher=teacher)
    except ValueError as e:  # a value valid alone but not for this model (kd_layers out of range, ...)
        raise ConfigError(str(e)) from None

    fingerprint = {"stage": "codi", "params": to_dict(cfg), "weights": [params.alpha, params.beta, params.gamma],
                   "cache": file_digest(cache_dir / "manifest.json"), **model_fingerprint(sft),
                   "frozen_teacher": model_fingerprint(teacher_path) if teacher_path else None}

    class FinalStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= state.max_steps:  # the final step is a checkpoint and a validation
                control.should_save = True
                control.should_evaluate = len(val) > 0
            return control

    # The teacher's activation checkpointing is the model's own (codi.modeling); the Trainer's flag
    # would call gradient_checkpointing_enable on a module that is not a PreTrainedModel.
    args = training_arguments(cfg, output_dir=checkpoints, run_name=f"{experiment_name()}-codi", report_to=[],
                              has_eval=len(val) > 0, activation_checkpointing=False,
                              ddp_find_unused_parameters=cfg.latent_steps == 0)
    is_main = args.process_index == 0
    with args.main_process_first(local=False, desc="checkpoint folder"):
        resume = CheckpointDir(checkpoints, fingerprint).prepare()
    args.report_to = setup_wandb(params.wandb, "codi", {"codi": to_dict(cfg), "alpha": params.alpha,
                                                       "beta": params.beta, "gamma": params.gamma}, is_main)

    k_acc = min(cfg.val_accuracy_samples, len(val))
    trainer = make_trainer_class()(
        model=model, args=args, train_dataset=train, eval_dataset=val if len(val) else None,
        data_collator=collate_examples, processing_class=tok, callbacks=[FinalStep()],
        codi_cfg=cfg, val_answers=val.column("answer")[:k_acc])
    t0 = time.time()
    trainer.train(resume_from_checkpoint=resume)
    seconds = time.time() - t0

    if trainer.is_world_process_zero():
        from codi.modeling import save_codi_model

        with atomic_dir(out) as tmp:
            save_codi_model(trainer.accelerator.unwrap_model(trainer.model), tok, tmp,
                            extra={"step": trainer.state.global_step, "experiment": experiment_name(),
                                   "params": {"codi": to_dict(cfg), "alpha": params.alpha, "beta": params.beta,
                                              "gamma": params.gamma}})
        history = trainer.state.log_history
        train_logs = [h for h in history if "student_loss" in h and "loss" in h]
        evals = [h for h in history if "eval_loss" in h]
        last_eval = evals[-1] if evals else {}
        steps_done = trainer.state.global_step - (int(Path(resume).name.split("-")[-1]) if resume else 0)
        summary = {
            "student_loss_first": train_logs[0]["student_loss"] if train_logs else None,
            "student_loss_last": train_logs[-1]["student_loss"] if train_logs else None,
            "teacher_loss_last": train_logs[-1]["teacher_loss"] if train_logs else None,
            "kd_loss_last": train_logs[-1]["kd_loss"] if train_logs else None,
            "val_loss": _r(last_eval.get("eval_loss")),
            "val_student_loss": _r(last_eval.get("eval_student_loss")),
            "val_latent_accuracy": _r(last_eval.get("eval_latent_accuracy")),
            "steps": trainer.state.global_step,
            "examples_per_s": round(steps_done * cfg.batch_size * cfg.grad_accum * args.world_size / max(seconds, 1e-9), 2),
            "train_runtime_s": round(seconds, 1),
        }
        write_json(metrics, summary)
        save_loss_history(history, ("loss", *SUB_LOSSES, "eval_loss", "eval_student_loss"),
                          plots / "loss.tsv", plots / "loss.png", title="codi: loss and sub-losses")
        wandb_dir = finish_wandb(args.report_to)
        print(f"codi: {summary['steps']} steps in {summary['train_runtime_s']}s; student loss "
              f"{summary['student_loss_first']} -> {summary['student_loss_last']}; val student loss "
              f"{summary['val_student_loss']}, val latent accuracy {summary['val_latent_accuracy']}; model -> {out}"
              + (f"; wandb run in {wandb_dir}" if wandb_dir else ""))
    return 0


def _use_bf16(cfg: CodiConfig) -> bool:
    from codi.training import resolve_precision
    return resolve_precision(cfg.precision)["bf16"]


def _r(v: float | None) -> float | None:
    return round(v, 5) if v is not None else None
