"""The HF Trainer of the training stages, with length-grouped train batches and an optional token-weighted loss.

    LengthGroupedTrainer(model=weights.trainable, args=..., section=params.sft, weights=weights,
                         train_dataset=CacheDataset(...), ...)   # section.group_by_length; weights: full or LoRA

A batch with `loss_weights` (codi.data.batching, `computed_weight`) trains on sum(w * CE) / sum(w) over the target
tokens of the whole optimizer step (every micro-batch, every rank: the weighted analogue of HF's
num_items_in_batch), so 1 process and N with the same global batch train alike; validation always reports the
plain CE, so val losses compare across weightings.

Resume: each epoch's order is drawn from torch's CPU RNG when the epoch starts, as HF's sampler does. A run
resumed inside epoch e starts from a fresh RNG, not the state epoch e's order was drawn from, so from the second
epoch on it would train on another order. The sampler remembers the state it drew from and every checkpoint
holds it (`sampler_state[_<rank>].pth`), so a resumed run draws the same order: killed at any checkpoint, on
one process or N, it ends with the uninterrupted run's weights (tests/integration/test_training_procs.py).

FSDP (`section.strategy: fsdp` on more than one process, codi.training.fsdp): the Trainer shards the model with
FSDP2 itself instead of letting accelerate wrap it in DDP. A checkpoint then holds the model and optimizer state
as torch.distributed.checkpoint shards (`sharded/`, every rank its own) beside the usual scheduler, RNG, sampler
and trainer state; the final folder is the same HF folder as DDP's, written by rank 0 from the weights every
rank helped gather (`gather_full_state`). The same data order, loss scaling, clipping and optimizer: FSDP trains
what DDP trains, to float rounding (tests/integration/test_fsdp.py).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import Trainer
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

from codi.infra.config import ConfigError
from codi.training.fsdp import (SHARDED_DIR, full_state_dict, load_sharded_model, load_sharded_optimizer,
                                save_sharded, shard_model)

if TYPE_CHECKING:
    from codi.schemas.train import TrainConfig
    from codi.training.weights import Weights


class ResumableLengthGroupedSampler(LengthGroupedSampler):
    """HF's LengthGroupedSampler (the same draws, so the same order as before), plus what a checkpoint needs to
    draw the same orders again.

    An epoch's order is drawn when its iterator starts, from the sampler's `generator` (accelerate gives it one
    under N processes and keeps it across epochs) or else from torch's global CPU RNG (one process).
    `state(at_epoch_end)` is what the checkpoint holds; `restore(state)` applies it to the next iterator, the
    first of the resumed run: inside an epoch, that epoch's order drawn again from the state it was drawn from;
    at an epoch's end, the next epoch's order from the generator's saved state, or from the global RNG, which the
    Trainer restores from the checkpoint itself."""

    def __init__(self, batch_size: int, lengths: list[int]):
        super().__init__(batch_size, lengths=lengths)
        self._draw_state: torch.Tensor | None = None      # the state the current epoch's order was drawn from
        self._restored: dict[str, Any] | None = None

    def state(self, at_epoch_end: bool) -> dict[str, Any] | None:
        if self._draw_state is None:
            return None
        return {"draw_state": None if at_epoch_end else self._draw_state,
                "generator_state": self.generator.get_state() if self.generator is not None else None}

    def restore(self, state: dict[str, Any]) -> None:
        self._restored = state

    def __iter__(self):
        restored, self._restored = self._restored, None
        if restored is not None and restored["draw_state"] is not None:
            self._draw_state = restored["draw_state"]
            source = torch.Generator()
            source.set_state(self._draw_state)
            indices = get_length_grouped_indices(self.lengths, self.batch_size, generator=source)
            if self.generator is not None:  # it goes on from where the uninterrupted run's was after this draw
                self.generator.set_state(source.get_state())
        else:
            if restored is not None and restored["generator_state"] is not None and self.generator is not None:
                self.generator.set_state(restored["generator_state"])
            self._draw_state = self.generator.get_state() if self.generator is not None else torch.get_rng_state()
            indices = get_length_grouped_indices(self.lengths, self.batch_size, generator=self.generator)
        return iter(indices)


class LengthGroupedTrainer(Trainer):
    """A Trainer whose train sampler groups examples of similar length (prompt + trace tokens).

    The cache knows every example's length without touching its token buffers (`CacheDataset.lengths`); HF's
    own group_by_length only knows `datasets.Dataset` columns or items with `input_ids`."""

    fsdp_layer_groups = True  # under FSDP, each decoder layer its own group (codi.training.fsdp.shard_model)

    def __init__(self, *args: Any, section: TrainConfig, weights: Weights, record: dict[str, Any] | None = None,
                 **kwargs: Any):
        """`section`: the stage's params section (group_by_length; a subclass reads its own options there);
        `weights`: full or LoRA, what the folders hold (codi.training.weights); `record`: the params the run was
        trained with (a subclass writes it into its folders)."""
        super().__init__(*args, **kwargs)
        self.section, self.weights, self.record = section, weights, record or {}
        self.group_by_length = section.group_by_length
        self._grouped_sampler: ResumableLengthGroupedSampler | None = None
        self._resume_from: str | None = None
        self.fsdp = getattr(section, "strategy", "ddp") == "fsdp" and self.args.world_size > 1
        self._full_state: dict[str, torch.Tensor] | None = None
        if self.fsdp and self.is_fsdp_enabled:
            raise ConfigError("strategy = 'fsdp' under accelerate's own FSDP (configs/accelerate/fsdp.yaml): the stage "
                              "shards the model itself; launch it with torchrun or configs/accelerate/multi_gpu.yaml")
        if self.fsdp:
            groups = shard_model(self.model, self.args.device.type, layer_groups=self.fsdp_layer_groups)
            # The model reduces its own gradients: the Trainer must not wrap it in DDP nor move it again (its
            # path for a model sharded at load time, which this one is to it).
            self.is_distributed_loading_by_transformers = True
            if self.args.process_index == 0:
                what = "each decoder layer, then the rest" if self.fsdp_layer_groups else "the whole model"
                print(f"FSDP2: {sum(p.numel() for p in self.model.parameters()):,} parameters in {groups} "
                      f"group(s) ({what}), sharded over {self.args.world_size} processes", flush=True)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        self._resume_from = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _sampler_state_file(self, checkpoint: str | Path) -> Path:
        """One per rank, named like HF's RNG files: every rank draws its order from its own RNG."""
        rank = self.args.process_index
        return Path(checkpoint) / ("sampler_state.pth" if self.args.world_size <= 1 else f"sampler_state_{rank}.pth")

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        # The Trainer sets state.epoch to epoch + steps done / steps in the epoch: a whole number at an epoch's end.
        at_epoch_end = float(self.state.epoch or 0).is_integer()
        if self._grouped_sampler is not None and (state := self._grouped_sampler.state(at_epoch_end)) is not None:
            torch.save({**state, "epoch": self.state.epoch}, self._sampler_state_file(output_dir))
        # Every rank's RNG and sampler files are on disk before rank 0 writes trainer_state.json, the file whose
        # presence marks a checkpoint complete (codi.training.checkpoints).
        self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """No reduce-scatter until the last micro-batch of a step (the analogue of DDP's no_sync)."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not (self.fsdp and _internal_call):
            return super().save_model(output_dir, _internal_call)
        # A checkpoint under FSDP: every rank writes its shard of the model and the optimizer state.
        output_dir = output_dir or self.args.output_dir
        save_sharded(Path(output_dir) / SHARDED_DIR, self.model, self.optimizer)
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.fsdp:
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:  # the optimizer is in the shards already; the schedule is every rank's
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self.fsdp:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_sharded_model(Path(resume_from_checkpoint) / SHARDED_DIR, self.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self.fsdp or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_sharded_optimizer(Path(checkpoint) / SHARDED_DIR, self.model, self.optimizer)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))

    def _load_best_model(self) -> None:
        if not self.fsdp:
            return super()._load_best_model()
        load_sharded_model(Path(self.state.best_model_checkpoint) / SHARDED_DIR, self.model)

    def gather_full_state(self) -> None:
        """Every rank calls it before rank 0 writes the final folder: under FSDP, the all-gather of the weights
        (rank 0 keeps them on CPU); nothing otherwise."""
        if self.fsdp:
            self._full_state = full_state_dict(self.model)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if self.fsdp and state_dict is None:  # the final folder: the gathered weights, written as DDP's are
            state_dict = self._full_state
        super()._save(output_dir, state_dict)

    def save_final(self, folder: str | Path) -> None:
        """The stage's final model folder (codi.training.loop): HF format, as a checkpoint holds it (under LoRA the
        merged model, with the adapter in adapter/)."""
        self.weights.write_hf_folder(self, folder)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weights = inputs.pop("loss_weights", None)
        weighted = weights is not None and model.training
        # The Trainer reads this after each call: the model's own loss is scaled for gradient accumulation
        # (num_items_in_batch), and so is the weighted one when the Trainer hands it the step's total weight
        # (get_batch_samples); without it, it is this micro-batch's mean, which the Trainer must scale.
        self.loss_is_scaled_for_ga = (num_items_in_batch is not None) if weighted else None
        if not weighted:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs["labels"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"))
        logits = outputs.logits[:, :-1].float()                                  # (B, T-1, V): predicts t+1
        target, w = labels[:, 1:], weights[:, 1:].to(logits.device)
        ce = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="none")   # (B, T-1)
        w = torch.where(target == -100, torch.zeros_like(w), w)
        if num_items_in_batch is None:
            loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
        else:  # DDP averages the ranks' gradients: times the number of processes, as HF does for the plain CE
            loss = (ce * w).sum() * self.accelerator.num_processes / num_items_in_batch.clamp(min=1e-9)
        return (loss, outputs) if return_outputs else loss

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batches and "loss_weights" in batches[0]:  # the weighted loss's denominator: the step's total weight
            total = sum(torch.where(b["labels"][:, 1:] == -100, 0.0, b["loss_weights"][:, 1:].float()).sum()
                        for b in batches)
            num_items = self.accelerator.reduce(total.to(device), reduction="sum")
        return batches, num_items

    def _get_train_sampler(self, train_dataset=None):
        ds = train_dataset if train_dataset is not None else self.train_dataset
        if not self.group_by_length or not hasattr(ds, "lengths"):
            return super()._get_train_sampler(train_dataset)
        # Grouped by the global batch (every rank builds the same order, and accelerate gives rank r the
        # per-device batches r, r + world, ...): each optimizer step sees the same examples on 1 process or N.
        args = self.args
        sampler = ResumableLengthGroupedSampler(
            args.train_batch_size * args.gradient_accumulation_steps * args.world_size, lengths=ds.lengths)
        if self._resume_from is not None:
            f = self._sampler_state_file(self._resume_from)
            if f.is_file():
                sampler.restore(torch.load(f, weights_only=True))
            else:
                warnings.warn(f"{f} missing: after this epoch, the resumed run's data order may differ from an "
                              "uninterrupted run's")
        self._grouped_sampler = sampler
        return sampler
