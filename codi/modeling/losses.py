"""Loss pieces of the codi model, all per example (the reference averages within an example first).

    ce = token_ce(hidden, head, targets)                  # [N] per-token CE (fp32)
    per_ex = per_example_mean(ce, example_index, n)       # [n]
    kd = kd_hidden_per_example(s, t, example_index, n)    # smooth L1, mean over layers x anchors x hidden
    kd = kd_hidden_per_example(s, t, example_index, n, scale=teacher_std(t))   # codi.kd_norm: teacher_std
    kd = kd_logit_per_example(s_logits, t_logits, T, example_index, n)  # KL batchmean x T^2

Losses are computed in float32 whatever the model dtype (the reference computes them in the model's
dtype; in fp32 the two are the same, in bf16 ours is the more precise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# Logit elements materialized at once; above this, CE runs in row chunks whose logits are recomputed
# in backward (a 150k vocabulary x thousands of positions would otherwise hold gigabytes).
CE_CHUNK_ELEMENTS = 1 << 26


def _ce_rows(hidden: torch.Tensor, weight_holder: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    logits = weight_holder(hidden).float()  # [n, V]
    return F.cross_entropy(logits, targets, reduction="none")


def token_ce(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy of head(hidden) [N, V] against targets [N]: [N] float32."""
    vocab = head.weight.shape[0]
    rows = max(1, CE_CHUNK_ELEMENTS // vocab)
    if hidden.shape[0] <= rows:
        return _ce_rows(hidden, head, targets)
    parts = [checkpoint(_ce_rows, hidden[a:a + rows], head, targets[a:a + rows], use_reentrant=False)
             for a in range(0, hidden.shape[0], rows)]
    return torch.cat(parts)


def per_example_sum(values: torch.Tensor, example: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of values [N] grouped by example index [N] -> [n]."""
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, example, values)


def per_example_mean(values: torch.Tensor, example: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of values [N] within each example -> [n]; an example that owns no value gets 0."""
    counts = torch.bincount(example, minlength=n).to(values.dtype)
    return per_example_sum(values, example, n) / counts.clamp(min=1)


# A teacher layer whose anchors all hold the same vector has std 0; the floor keeps its KD term finite.
STD_FLOOR = 1e-6


def teacher_std(t: torch.Tensor) -> torch.Tensor:
    """codi.kd_norm = teacher_std: per KD layer, the standard deviation (unbiased) of the detached teacher
    hidden states over every element of the micro-batch's KD anchors, t [A, L, H] -> [L] (A anchors: all
    examples' kept anchors on this process; H hidden units). CODI's public code divides each layer's smooth-L1
    term by `ref_selected.std()`, the same population. Floored at STD_FLOOR."""
    flat = t.detach().float().transpose(0, 1).reshape(t.shape[1], -1)  # [L, A*H]
    return flat.std(dim=1).clamp(min=STD_FLOOR)


def kd_hidden_per_example(s: torch.Tensor, t: torch.Tensor, example: torch.Tensor, n: int,
                          scale: torch.Tensor | None = None) -> torch.Tensor:
    """Smooth L1 between student s and teacher t [A, L, H] (anchors x layers x hidden), averaged over all
    of an example's elements -> [n]; with `scale` [L], layer l's elements are divided by scale[l] first."""
    el = F.smooth_l1_loss(s.float(), t.float().detach(), reduction="none")  # [A, L, H]
    if scale is not None:
        el = el / scale.to(el)[None, :, None]
    return per_example_mean(el.sum(dim=(1, 2)), example, n) / (s.shape[1] * s.shape[2])


def kd_logit_per_example(s_logits: torch.Tensor, t_logits: torch.Tensor, temp: float,
                         example: torch.Tensor, n: int) -> torch.Tensor:
    """KL(teacher || student) of temperature-softened logits [A, V], batchmean over an example's anchors,
    times T^2 -> [n]."""
    log_p = F.log_softmax(s_logits.float() / temp, dim=-1)
    q = F.softmax(t_logits.float().detach() / temp, dim=-1)
    kl = F.kl_div(log_p, q, reduction="none").sum(-1)  # [A]
    return per_example_mean(kl, example, n) * (temp * temp)
