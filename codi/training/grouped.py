"""The HF Trainer of the training stages, with length-grouped train batches.

    LengthGroupedTrainer(model=..., args=..., train_dataset=CacheDataset(...), group_by_length=True, ...)
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer
from transformers.trainer_pt_utils import LengthGroupedSampler


class LengthGroupedTrainer(Trainer):
    """A Trainer whose train sampler groups examples of similar length (prompt + trace tokens).

    The cache knows every example's length without touching its token buffers (`CacheDataset.lengths`); HF's
    own group_by_length only knows `datasets.Dataset` columns or items with `input_ids`."""

    def __init__(self, *args: Any, group_by_length: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group_by_length = group_by_length

    def _get_train_sampler(self, train_dataset=None):
        ds = train_dataset if train_dataset is not None else self.train_dataset
        if not self.group_by_length or not hasattr(ds, "lengths"):
            return super()._get_train_sampler(train_dataset)
        return LengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                    lengths=ds.lengths)
