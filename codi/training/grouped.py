"""The HF Trainer of the training stages, with length-grouped train batches and an optional token-weighted loss.

    LengthGroupedTrainer(model=..., args=..., train_dataset=CacheDataset(...), group_by_length=True, ...)

A batch with `loss_weights` (codi.batching, `computed_weight`) trains on sum(w * CE) / sum(w) over its target
tokens; validation always reports the plain CE, so val losses compare across weightings.
"""

from __future__ import annotations

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

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weights = inputs.pop("loss_weights", None)
        # The Trainer reads this after each call: the model's own loss is scaled for gradient accumulation
        # (num_items_in_batch), the weighted one below is a per-micro-batch mean that the Trainer must scale.
        self.loss_is_scaled_for_ga = None if weights is None or not model.training else False
        if weights is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs["labels"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"))
        logits = outputs.logits[:, :-1].float()                                  # (B, T-1, V): predicts t+1
        target, w = labels[:, 1:], weights[:, 1:].to(logits.device)
        ce = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="none")   # (B, T-1)
        w = torch.where(target == -100, torch.zeros_like(w), w)
        loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
        return (loss, outputs) if return_outputs else loss

    def _get_train_sampler(self, train_dataset=None):
        ds = train_dataset if train_dataset is not None else self.train_dataset
        if not self.group_by_length or not hasattr(ds, "lengths"):
            return super()._get_train_sampler(train_dataset)
        return LengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                    lengths=ds.lengths)
