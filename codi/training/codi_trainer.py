"""CodiTrainer: the HF Trainer of the codi stage, and the pieces it shares with tests (collation, ss draws).

    CodiTrainer(model=CodiModel(...), args=..., section=params.codi, weights=weights, data_collator=collate_examples,
                record={"codi": ..., "alpha": ...}, train_dataset=..., eval_dataset=..., processing_class=tok)

It is the one writer of codi model folders (codi.modeling.io): checkpoints and the final model alike.
"""

from __future__ import annotations

import copy
import os
import random
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from codi.data.answers import answers_match
from codi.evaluation.decoding import iter_decode
from codi.infra.config import ConfigError
from codi.modeling.io import PROJECTOR_FILE, save_codi_model
from codi.modeling.plan import latent_share, ss_ramp, stage_latent_count, stage_of, unit_at, unit_ladder, value_ramp
from codi.schemas.codi import CodiConfig
from codi.schemas.options import CodiOptions
from codi.training.grouped import LengthGroupedTrainer
from codi.training.tracking import experiment_name
from codi.training.weights import FullWeights, Weights

SUB_LOSSES = ("teacher_loss", "student_loss", "kd_loss")
RECON_LOSS = "recon_loss"  # a sub-loss only when codi.recon_weight > 0


def sub_losses(cfg: CodiOptions) -> tuple[str, ...]:
    """The sub-losses a run logs: the reference's three, and the reconstruction's and the value terms' when on."""
    return SUB_LOSSES + ((RECON_LOSS,) if cfg.recon_weight > 0 else ()) + (
        ("value_loss",) if cfg.value_weight > 0 else ()) + (("value_kd_loss",) if cfg.value_kd_weight > 0 else ())


RECON_FILE = "recon_decoder.safetensors"  # checkpoints only: the auxiliary decoder (recon_decoder copy)


def collate_examples(batch: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The codi contract: CodiModel takes the example dicts themselves."""
    keys = ("prompt_ids", "trace_ids", "spans", "value_pos")  # value_pos: the value options (codi.data.values.WithValues)
    return {"examples": [{k: ex[k] for k in keys if k in ex} for ex in batch]}


def stage_rng(seed: int, step: int, micro: int, rank: int) -> random.Random:
    """The stage curriculum's draws (mixing, smoothing) as a pure function of (seed, step, micro-batch, rank)."""
    return random.Random(f"codi-stage/{seed}/{step}/{micro}/{rank}")


def ss_rng(seed: int, step: int, micro: int, rank: int) -> random.Random:
    """Scheduled-sampling draws as a pure function of (seed, step, micro-batch, rank): a resumed run draws
    what the uninterrupted one would have (string seeds hash with sha512: stable across processes)."""
    return random.Random(f"codi-ss/{seed}/{step}/{micro}/{rank}")


def _tied_state(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A causal LM's state dict without a tied lm_head (safetensors refuses shared tensors)."""
    tied = getattr(lm.config, "tie_word_embeddings", False)
    return {k: v.detach().contiguous().cpu() for k, v in lm.state_dict().items() if not (tied and k == "lm_head.weight")}


def plain_causal_lm(like: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An unsharded causal LM of `like`'s config and generation config holding `state` (FSDP's gathered weights):
    what save_pretrained writes of it is what it writes of the LM a DDP run trained."""
    from transformers import AutoModelForCausalLM

    dtype = next(iter(state.values())).dtype if state else torch.float32
    with torch.random.fork_rng():  # its initialisation is overwritten: it must not move the run's RNG
        plain = AutoModelForCausalLM.from_config(like.config, dtype=dtype)
    plain.generation_config = copy.deepcopy(like.generation_config)
    result = plain.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if plain.config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise RuntimeError(f"gathered weights do not match the model (missing {result.missing_keys[:3]}, "
                           f"unexpected {result.unexpected_keys[:3]})")
    plain.tie_weights()
    return plain


def save_recon_decoder(model, folder: str | Path) -> None:
    """The auxiliary reconstruction decoder of a checkpoint (none to save under recon_decoder shared)."""
    if model.recon_model is not None:
        from safetensors.torch import save_file
        save_file(_tied_state(model.recon_model), str(Path(folder) / RECON_FILE))


def load_codi_weights(model, ckpt: str | Path, weights: Weights | None = None) -> None:
    """Load the base weights and the projector that save_codi_model wrote into an existing CodiModel (and the
    auxiliary reconstruction decoder of a checkpoint, which a model with one requires). The base's trainable part
    is what `weights` saved (codi.training.weights: the whole LM, or under LoRA the adapter; CodiTrainer._save)."""
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    (weights if weights is not None else FullWeights(model.model)).load_checkpoint(ckpt)
    model.projector.load_state_dict(load_file(str(ckpt / PROJECTOR_FILE)))
    if model.recon_model is not None:
        if not (ckpt / RECON_FILE).is_file():
            raise ValueError(f"{ckpt}: no {RECON_FILE}, but codi.recon_decoder = copy needs the decoder's weights")
        result = model.recon_model.load_state_dict(load_file(str(ckpt / RECON_FILE)), strict=False)
        if set(result.missing_keys) - {"lm_head.weight"} or result.unexpected_keys:
            raise ValueError(f"{ckpt / RECON_FILE}: weights do not match the reconstruction decoder")
        model.recon_model.tie_weights()


class CodiTrainer(LengthGroupedTrainer):
    """Trainer for CodiModel: overrides only the loss, logging, evaluation and (de)serialisation.

    - loss: the model's L = alpha*Lt + beta*Ls + gamma*Lkd (+ recon_weight*Lrecon), with the scheduled-sampling
      probability (`ss_ramp`) and the latent share (`latent_share`) pure functions of the step, the ss draws
      from `ss_rng`; validation runs every LINE frame latent (as decoded);
    - logging: the sub-losses averaged over each logging window, the current ss probability and latent share;
    - evaluation: the losses on the val split (sharded over ranks) and the latent decoder's output accuracy
      on the first `codi.val_accuracy_samples` val examples;
    - folders: the final model (`save_final`) is a codi model folder (`load_codi_model`); a checkpoint is the
      same folder plus the reconstruction decoder, optimizer, scheduler and RNG states. Both record the step,
      the experiment and `record` (the params the run was trained with) in codi_config.json's `extra`."""

    # Under FSDP one group for the whole CodiModel: it runs the LM's layers a batch-dependent number of times, and
    # per-layer groups would all-gather a different number of times on each rank (codi.training.fsdp).
    fsdp_layer_groups = False

    def __init__(self, *args: Any, section: CodiConfig, **kwargs: Any):
        super().__init__(*args, section=section, **kwargs)
        self.codi_cfg = section
        val = self.eval_dataset
        # the answers the latent decoder is scored against at each evaluation (the first val_accuracy_samples)
        self.val_answers = val.column("answer")[:min(section.val_accuracy_samples, len(val))] if val else []
        self._window: dict[str, list[float]] = defaultdict(list)
        self._micro = (-1, 0)  # (step, micro-batch index within it)
        self._reset_at = -1    # the step whose stage switch last reset the optimizer
        # the unit curriculum (codi.unit_stage_steps): training steps set the model's options to their stage's unit;
        # evaluation, checkpoints and the final folder see the configured options
        self._final_options = self.model.options
        self._ladder = unit_ladder(section.latent_unit, section.frames_per_block, section.latent_call)
        if section.unit_stage_steps > 0 and (len(self._ladder) - 1) * section.unit_stage_steps >= section.max_steps:
            raise ConfigError(f"codi.unit_stage_steps = {section.unit_stage_steps}: its {len(self._ladder) - 1} earlier "
                              f"unit(s) would take all of codi.max_steps = {section.max_steps}, so the configured unit "
                              "would never train")

    def ss_prob(self) -> float:
        c = self.codi_cfg
        return ss_ramp(self.state.global_step, self.state.max_steps, c.ss_prob, c.ss_ramp_frac)

    def latent_share(self) -> float:
        c = self.codi_cfg
        return latent_share(self.state.global_step, self.state.max_steps, c.latent_curriculum_frac, c.mix_explicit_prob)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        step, c = self.state.global_step, self.codi_cfg
        micro = self._micro[1] + 1 if self._micro[0] == step else 0
        self._micro = (step, micro)
        p = self.ss_prob() if model.training else 0.0
        rng = ss_rng(self.codi_cfg.seed, step, micro, self.args.process_index) if p > 0 else None
        share = self.latent_share() if model.training else 1.0
        count = None
        if model.training and c.stage_steps > 0:  # the stage curriculum: this batch's latent frames
            count = stage_latent_count(step, c.stage_steps, c.stage_smoothing, c.stage_mix_prob,
                                       stage_rng(c.seed, step, micro, self.args.process_index))
            self._window["latent_frames"].append(float(count))
        if c.unit_stage_steps > 0:  # the unit curriculum: this step's unit (the configured one outside training)
            core = self.accelerator.unwrap_model(model)
            if model.training:
                stage, unit = unit_at(step, c.unit_stage_steps, self._ladder)
                core.options = self._final_options.at_unit(unit)
                self._window["unit_stage"].append(float(stage))
            else:
                core.options = self._final_options
        scale = value_ramp(step, self.state.max_steps, c.value_ramp_frac) if model.training else 1.0
        if model.training and c.value_ramp_frac > 0:
            self._window["value_scale"].append(scale)
        out = model(inputs["examples"], ss_prob=p, ss_rng=rng, latent_share=share, latent_count=count,
                    value_scale=scale)
        if model.training:
            for k in sub_losses(self.codi_cfg):
                self._window[k].append(out[k].item())
        return (out["loss"], out) if return_outputs else out["loss"]

    def training_step(self, model, inputs, num_items_in_batch=None):
        c, step = self.codi_cfg, self.state.global_step
        switch = (step > 0 and step % c.stage_steps == 0) if c.stage_steps > 0 else (
            c.unit_stage_steps > 0 and 0 < step < len(self._ladder) * c.unit_stage_steps
            and step % c.unit_stage_steps == 0)
        if c.stage_reset_optimizer and switch and self._reset_at != step:
            # A stage switch (Coconut, iCoT-SI): the optimizer starts afresh. Keyed on the step alone, so a run
            # resumed from the checkpoint at the switch resets where the uninterrupted one did.
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            inner.state.clear()
            self._reset_at = step
            stage = stage_of(step, c.stage_steps) if c.stage_steps > 0 else unit_at(step, c.unit_stage_steps,
                                                                                      self._ladder)[0] + 1
            print(f"codi: stage {stage} from step {step}: optimizer state reset")
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._window:  # a training log: the window's sub-losses, averaged over the ranks
            # (each rank holds its own share of the batch; every rank logs at the same step, as for "loss")
            names = list(self._window)
            means = torch.tensor([sum(self._window[k]) / len(self._window[k]) for k in names],
                                 dtype=torch.float64, device=self.args.device)
            means = self.accelerator.reduce(means, reduction="mean")
            for k, v in zip(names, means.tolist()):
                logs[k] = round(v, 6)
            logs["ss_prob"] = round(self.ss_prob(), 6)
            logs["latent_share"] = round(self.latent_share(), 6)
            self._window.clear()
        super().log(logs, start_time)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        core = self.accelerator.unwrap_model(self.model)
        core.options = self._final_options  # the unit curriculum: evaluated as decoded, in the configured unit
        was_training = core.training
        core.eval()
        metrics = self._val_losses(core, ds, metric_key_prefix)
        k_acc = min(self.codi_cfg.val_accuracy_samples, len(ds))
        if k_acc:
            metrics[f"{metric_key_prefix}_latent_accuracy"] = self._val_latent_accuracy(core, ds, k_acc)
        if was_training:
            core.train()
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _val_losses(self, core, ds, prefix: str) -> dict[str, float]:
        world, rank = self.args.world_size, self.args.process_index
        names = sub_losses(self.codi_cfg)
        sums = torch.zeros(len(names) + 2, dtype=torch.float64)  # loss, sub-losses..., count
        bs = self.args.per_device_eval_batch_size
        mine = list(range(rank, len(ds), world))  # each rank a shard; the sums are all-reduced
        # Under FSDP every forward all-gathers, so every rank runs as many as the rank with most: a rank out of
        # examples runs one more batch of example 0 and counts none of it.
        extra = -(-len(ds) // world) - len(mine) if self.fsdp else 0
        with torch.no_grad():
            for s in range(0, len(mine) + extra, bs):
                if s >= len(mine):
                    core(collate_examples([ds[0]])["examples"])
                    continue
                batch = [ds[k] for k in mine[s:s + bs]]
                out = core(collate_examples(batch)["examples"])
                vals = [out["loss"].item(), *(out[k].item() for k in names)]
                sums[:-1] += torch.tensor(vals, dtype=torch.float64) * len(batch)
                sums[-1] += len(batch)
        if world > 1:
            torch.distributed.all_reduce(sums)
        n = max(sums[-1].item(), 1.0)
        metrics = {f"{prefix}_loss": sums[0].item() / n}
        metrics.update({f"{prefix}_{k}": v / n for k, v in zip(names, sums[1:-1].tolist())})
        return metrics

    def _val_latent_accuracy(self, core, ds, k: int) -> float:
        exs = [ds[i] for i in range(k)]
        frame_sep = core.token_ids.frame_sep

        def decode() -> list:
            return list(iter_decode(
                "latent", core.model, self.processing_class, [e["prompt_ids"] for e in exs], projector=core.projector,
                latent_steps=core.options.latent_steps, value_feedback=core.options.value_feedback,
                latent_unit=core.options.latent_unit, frames_per_block=core.options.frames_per_block,
                latent_call=core.options.latent_call,
                batch_size=self.args.per_device_eval_batch_size,
                max_new_tokens=max(len(e["trace_ids"]) for e in exs) + 64,
                max_frames=max(e["trace_ids"].count(frame_sep) for e in exs) + 8))

        if self.fsdp:  # the decoder calls the LM and the projector, not the root: run it as a forward of the root,
            # whose hooks gather the weights for it (every rank decodes the same examples: the same collectives)
            if not hasattr(core, "run_unsharded"):
                from torch.distributed.fsdp import register_fsdp_forward_method

                core.run_unsharded = types.MethodType(lambda _module, fn: fn(), core)
                register_fsdp_forward_method(core, "run_unsharded")
            results = core.run_unsharded(decode)
        else:
            results = decode()
        return sum(answers_match(r.answer, truth) for r, truth in zip(results, self.val_answers)) / k

    def save_final(self, folder: str | Path) -> None:
        """A codi model folder of the model as it is now (the final model; the core of a checkpoint). Under LoRA:
        the merged base + projector (what load_codi_model and evaluate read), the adapter in `adapter/`."""
        merged = self.weights.final_lm(folder)
        projector_state = None
        if self.fsdp:  # the weights gathered on this rank (gather_full_state), into a plain copy of the LM
            full = self._full_state or {}
            merged = plain_causal_lm(self.weights.lm, {k[len("model."):]: v for k, v in full.items()
                                                       if k.startswith("model.")})
            projector_state = {k[len("projector."):]: v for k, v in full.items() if k.startswith("projector.")}
        self.accelerator.unwrap_model(self.model).options = self._final_options  # (the unit curriculum's stage)
        save_codi_model(self.accelerator.unwrap_model(self.model), self.processing_class, folder,
                        extra={"step": self.state.global_step, "experiment": experiment_name(), "params": self.record},
                        base=merged, projector_state=projector_state)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if not self.args.should_save:
            return
        output_dir = output_dir or self.args.output_dir
        core = self.accelerator.unwrap_model(self.model)
        if not self.weights.save_checkpoint(output_dir):
            self.save_final(output_dir)
        else:  # a LoRA checkpoint: the adapter (saved above, not a merged copy of the frozen base), projector, tokenizer
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().cpu() for k, v in core.projector.state_dict().items()},
                      os.path.join(output_dir, PROJECTOR_FILE))
            self.processing_class.save_pretrained(output_dir)
        save_recon_decoder(core, output_dir)  # what a resume needs besides
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.fsdp:  # the sharded checkpoint holds the whole CodiModel
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_codi_weights(self.accelerator.unwrap_model(model or self.model), resume_from_checkpoint, self.weights)

    def _load_best_model(self) -> None:
        if self.fsdp:
            return super()._load_best_model()
        load_codi_weights(self.accelerator.unwrap_model(self.model), self.state.best_model_checkpoint, self.weights)
