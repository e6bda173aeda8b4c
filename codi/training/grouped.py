"""The HF Trainer of the training stages, with length-grouped train batches and an optional token-weighted loss.

    LengthGroupedTrainer(model=..., args=..., train_dataset=CacheDataset(...), group_by_length=True, ...)

A batch with `loss_weights` (codi.batching, `computed_weight`) trains on sum(w * CE) / sum(w) over the target
tokens of the whole optimizer step (every micro-batch, every rank: the weighted analogue of HF's
num_items_in_batch), so 1 process and N with the same global batch train alike; validation always reports the
plain CE, so val losses compare across weightings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Trainer
from transformers.trainer_pt_utils import LengthGroupedSampler


class LengthGroupedTrainer(Trainer):
    """A Trainer whose train sampler groups examples of similar length (prompt + trace tokens).

    The cache knows every example's length without touching its token buffers (`CacheDataset.lengths`); HF's
    own group_by_length only knows `datasets.Dataset` columns or items with `input_ids`."""

    def __init__(self, *args: Any, group_by_length: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group_by_length = group_by_length

    def save_final(self, folder: str | Path) -> None:
        """The stage's final model folder (codi.training.loop): HF format, as a checkpoint holds it."""
        self.save_model(str(folder))

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
        return LengthGroupedSampler(args.train_batch_size * args.gradient_accumulation_steps * args.world_size,
                                    lengths=ds.lengths)
