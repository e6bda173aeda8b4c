"""Batches for the HF-Trainer stages: right-padded input ids and loss-masked labels.

    collate = CausalLMCollator(pad_id, target="trace")    # sft: CE on the trace tokens only
    collate = CausalLMCollator(pad_id, target="answer")   # sft_direct: CE on the answer tokens only
    batch = collate([cache_example, ...])                 # {"input_ids", "labels"} (+ "attention_mask")
    CausalLMCollator(pad_id, "trace", computed_weight=4.0, ids=token_ids(tok))   # + "loss_weights" (B, T)

Prompt positions and padding carry label -100 (IGNORE_INDEX), so they never contribute to the loss.
Padding is on the right, so under the causal mask no real token ever attends to a pad: the loss is
the same with or without an attention mask (a test proves it), and without one sdpa keeps its causal
fast path (benchmarks/bench_train.py measures it against the masked path on the embedded default).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Literal

import torch

from codi.tracing.tokens import TraceTokenIds

IGNORE_INDEX = -100


def computed_mask(trace: list[int], ids: TraceTokenIds) -> list[bool]:
    """True at the tokens a trace computes rather than copies: the locals tokens of a LINE frame that the frame
    before it does not have (a computed value, a new variable), and every return/exception VALUE. Everything
    else in a full-locals frame is a copy. The frame before is the previous CALL or LINE frame in the trace
    (another scope's, after a nested call: more tokens count as computed, none fewer)."""
    mask = [False] * len(trace)
    prev: list[int] | None = None
    start = None
    in_value = False
    for t, tok in enumerate(trace):
        if tok == ids.arg_sep:
            in_value = True
        elif tok == ids.frame_sep:
            in_value = False
        elif in_value:
            mask[t] = True
        if tok in (ids.call_sep, ids.line_sep):
            start = t + 1
        elif tok == ids.action_sep and start is not None:
            cur = trace[start:t]
            if trace[start - 1] == ids.line_sep and prev is not None:
                copied = set()
                for block in difflib.SequenceMatcher(None, prev, cur, autojunk=False).get_matching_blocks():
                    copied.update(range(block.b, block.b + block.size))
                for k in range(len(cur)):
                    mask[start + k] = k not in copied
            prev, start = cur, None
    return mask


@dataclass(frozen=True)
class CausalLMCollator:
    pad_id: int
    target: Literal["trace", "answer"] = "trace"
    attention_mask: bool = False  # only needed by models that are not causal-only
    computed_weight: float = 1.0  # loss weight of the computed tokens (computed_mask); 1 = plain CE
    ids: TraceTokenIds | None = None  # the trace tokens, needed when computed_weight != 1

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
        if self.computed_weight != 1.0 and self.target == "trace":
            if self.ids is None:
                raise ValueError("CausalLMCollator: computed_weight needs the trace token ids (ids=token_ids(tok))")
            weights = torch.ones((len(seqs), width), dtype=torch.float32)   # (B, T)
            for b, (p, t) in enumerate(seqs):
                computed = torch.tensor(computed_mask(list(t), self.ids), dtype=torch.bool)
                weights[b, len(p):len(p) + len(t)][computed] = self.computed_weight
            batch["loss_weights"] = weights
        return batch
