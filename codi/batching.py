"""Batches for the HF-Trainer stages: right-padded input ids and loss-masked labels.

    collate = CausalLMCollator(pad_id, target="trace")    # sft: CE on the trace tokens only
    collate = CausalLMCollator(pad_id, target="answer")   # sft_direct: CE on the answer tokens only
    batch = collate([cache_example, ...])                 # {"input_ids", "labels"} (+ "attention_mask")

Prompt positions and padding carry label -100 (IGNORE_INDEX), so they never contribute to the loss.
Padding is on the right, so under the causal mask no real token ever attends to a pad: the loss is
the same with or without an attention mask (a test proves it), and without one sdpa keeps its causal
fast path (benchmarks/bench_train.py measures it against the masked path on the embedded default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class CausalLMCollator:
    pad_id: int
    target: Literal["trace", "answer"] = "trace"
    attention_mask: bool = False  # only needed by models that are not causal-only

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        key = "trace_ids" if self.target == "trace" else "answer_ids"
        seqs = [(ex["prompt_ids"], ex[key]) for ex in examples]
        width = max(len(p) + len(t) for p, t in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)     # (B, T)
        labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)      # (B, T)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)                     # (B, T)
        for b, (p, t) in enumerate(seqs):
            n = len(p) + len(t)
            input_ids[b, :n] = torch.tensor(p + t)
            labels[b, len(p):n] = torch.tensor(t)
            mask[b, :n] = 1
        batch = {"input_ids": input_ids, "labels": labels}
        if self.attention_mask:
            batch["attention_mask"] = mask
        return batch
