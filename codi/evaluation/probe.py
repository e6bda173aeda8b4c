"""What the latent blocks carry: the latent probe and the constant-latent ablation of the evaluate stage.

    blocks = collect_blocks(codi_model, examples, batch_size=32)   # one row per LINE frame with an assigned value
    lens = logit_lens(blocks, head_weight, value_tokens)           # each latent position through the tied head
    probe = fit_linear_probe(train_blocks)                         # multinomial logistic regression on a block
    report = probe_report(train_blocks, {"val": val_blocks, "test": test_blocks}, head_weight)
    carried = ablation_summary(latent_rows, ablated_rows, direct_rows, boot)   # what the latents themselves carry

Two questions, kept apart (research IV, docs/RESULTS.md):
- Is the value computed? A block stands for LINE frame s, whose locals hold the value the previous line assigned
  (codi.data.values). The probe reads the block's post-norm outputs (at latent_start and at each latent) with every
  text token teacher-forced, so block s is frame s: (a) the logit lens puts each position through the tied head,
  argmax over the value tokens; (b) a linear probe, fit on train blocks, is scored on held-out blocks against the
  majority class. Decodable well above the majority = computed.
- Is it read? The ablation decodes with every latent input replaced by one constant vector (the mean of the
  latent inputs decoding fed): what the latents carry is what that loses. The latents carry the gain when the
  ablated accuracy keeps at most half of latent's lead over direct: (ablated - direct) <= 0.5 * (latent - direct).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from codi.data.values import AssignedValue

# A value is "computed" in a block when the linear probe beats the majority class by this much (absolute).
DECODABLE_MARGIN = 0.10


@dataclass
class ProbeBlocks:
    """Latent blocks with a value to find: states [N, P, H] (P = latent_steps + 1 positions: latent_start, then
    each latent), the value's first token [N], its kind, the frame index (0-based LINE frame) and problem."""

    states: np.ndarray
    labels: np.ndarray
    kinds: list[str] = field(default_factory=list)
    frame_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    problems: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.labels)


def collect_blocks(codi_model, examples: Sequence[dict[str, Any]], slots: Sequence[Sequence[AssignedValue | None]],
                   batch_size: int, progress: str | None = None) -> ProbeBlocks:
    """The blocks of `examples` (codi-contract dicts with `problem_id`) that stand for a LINE frame with an
    assigned value (`slots`, codi.data.values.assigned_values per example), from CodiModel.block_states. A block of
    several LINE frames (codi.frames_per_block) is probed for its first frame's value (frame j's slot is latent
    latent_steps - frames_per_block + j, and the probe reads every position of the block)."""
    states, labels, kinds, index, problems = [], [], [], [], []
    starts = range(0, len(examples), batch_size)
    if progress:
        from tqdm.auto import tqdm
        starts = tqdm(starts, desc=progress, unit="batch")
    for s in starts:
        chunk = examples[s:s + batch_size]
        plans = codi_model.plans(chunk)
        for ex, plan, ex_slots, blocks in zip(chunk, plans, slots[s:s + batch_size], codi_model.block_states(chunk)):
            for k, block in enumerate(blocks):
                # block k stands for LINE frame k, or (codi.frames_per_block) for a run of frames: the first one's value
                # (codi.latent_call: value_pos counts the call frame first; `slots` holds the LINE frames only)
                frame = plan.value_index(k, 0) - plan.call_frames
                slot = ex_slots[frame] if 0 <= frame < len(ex_slots) else None
                if slot is None:
                    continue
                states.append(block.numpy())
                labels.append(ex["trace_ids"][slot.pos])
                kinds.append(slot.kind)
                index.append(frame)
                problems.append(ex["problem_id"])
    if not states:
        return ProbeBlocks(np.zeros((0, 0, 0), dtype=np.float32), np.zeros(0, dtype=np.int64))
    return ProbeBlocks(np.stack(states).astype(np.float32), np.array(labels, dtype=np.int64), kinds,
                       np.array(index, dtype=np.int64), problems)


def logit_lens(blocks: ProbeBlocks, head_weight: torch.Tensor, value_tokens: Sequence[int]) -> np.ndarray:
    """Predicted value token of every block at every position [N, P]: the position's state through the tied
    head (head_weight [V, H]), argmax over `value_tokens` only."""
    if not len(blocks):
        return np.zeros((0, 0), dtype=np.int64)
    vocab = torch.tensor(sorted(value_tokens), dtype=torch.long)
    with torch.no_grad():
        logits = torch.from_numpy(blocks.states) @ head_weight.detach().float()[vocab].T  # [N, P, |values|]
    return vocab[logits.argmax(-1)].numpy()


@dataclass
class LinearProbe:
    """Multinomial logistic regression on a block's flattened, standardised states."""

    classes: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    weight: torch.Tensor
    bias: torch.Tensor

    def predict(self, blocks: ProbeBlocks) -> np.ndarray:
        if not len(blocks):
            return np.zeros(0, dtype=np.int64)
        x = torch.from_numpy((blocks.states.reshape(len(blocks), -1) - self.mean) / self.std)
        with torch.no_grad():
            return self.classes[(x @ self.weight.T + self.bias).argmax(-1).numpy()]


def fit_linear_probe(train: ProbeBlocks, l2: float = 1e-3, iterations: int = 200, seed: int = 0) -> LinearProbe:
    """Fit by full-batch L-BFGS (deterministic for a given input): cross-entropy + l2 * |W|^2 over the classes
    that occur in `train`."""
    if not len(train):
        raise ValueError("fit_linear_probe: no train blocks with an assigned value")
    x = train.states.reshape(len(train), -1).astype(np.float64)
    mean, std = x.mean(0), x.std(0) + 1e-6
    classes = np.unique(train.labels)
    y = torch.from_numpy(np.searchsorted(classes, train.labels))
    xt = torch.from_numpy((x - mean) / std).float()
    gen = torch.Generator().manual_seed(seed)
    weight = (0.01 * torch.randn(len(classes), xt.shape[1], generator=gen)).requires_grad_(True)
    bias = torch.zeros(len(classes), requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(xt @ weight.T + bias, y) + l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return LinearProbe(classes, mean.astype(np.float32), std.astype(np.float32), weight.detach(), bias.detach())


def _acc(pred: np.ndarray, truth: np.ndarray) -> float | None:
    return round(float((pred == truth).mean()), 4) if len(truth) else None


def _breakdown(pred: np.ndarray, blocks: ProbeBlocks) -> dict[str, Any]:
    kinds = np.array(blocks.kinds)
    out: dict[str, Any] = {"all": _acc(pred, blocks.labels)}
    for kind in ("copy", "computed"):
        sel = kinds == kind
        out[kind] = _acc(pred[sel], blocks.labels[sel])
    out["by_frame"] = {str(int(k) + 1): _acc(pred[blocks.frame_index == k], blocks.labels[blocks.frame_index == k])
                       for k in np.unique(blocks.frame_index)}
    return out


def probe_report(train: ProbeBlocks, held_out: dict[str, ProbeBlocks], head_weight: torch.Tensor) -> dict[str, Any]:
    """Per held-out split: blocks, kinds, the majority class's accuracy (the train majority), the linear probe's
    and the logit lens's (at every position), each overall, per kind (copy / computed) and per frame index."""
    probe = fit_linear_probe(train)
    majority = Counter(train.labels.tolist()).most_common(1)[0][0]
    value_tokens = set(train.labels.tolist())
    out: dict[str, Any] = {"train_blocks": len(train), "value_classes": len(probe.classes)}
    for split, blocks in held_out.items():
        if not len(blocks):
            continue
        lens = logit_lens(blocks, head_weight, value_tokens)
        out[split] = {
            "blocks": len(blocks), "kinds": dict(Counter(blocks.kinds)),
            "majority": _breakdown(np.full(len(blocks), majority), blocks),
            "linear": _breakdown(probe.predict(blocks), blocks),
            "lens": {f"position_{p}": _breakdown(lens[:, p], blocks) for p in range(lens.shape[1])},
        }
    return out


def ablation_summary(latent: Sequence[dict[str, Any]], ablated: Sequence[dict[str, Any]],
                     direct: Sequence[dict[str, Any]] | None, samples: int, seed: int, level: float) -> dict[str, Any]:
    """Latent accuracy with every latent input one constant vector, beside latent (and direct), on the same
    examples (scored rows with `id`, `problem_id`, `correct`): the accuracies, the gap latent - ablated, and the
    share of latent's lead over direct that the ablation keeps, (ablated - direct) / (latent - direct), each with a
    paired percentile bootstrap over problems."""
    ids = [r["id"] for r in latent]
    if [r["id"] for r in ablated] != ids or (direct is not None and [r["id"] for r in direct] != ids):
        raise ValueError("ablation_summary: the modes' rows must be the same examples in the same order")
    problems = sorted({r["problem_id"] for r in latent})
    pos = {p: k for k, p in enumerate(problems)}
    k = np.array([pos[r["problem_id"]] for r in latent])
    cols = {"latent": latent, "ablated": ablated, **({"direct": direct} if direct is not None else {})}
    draws = np.random.default_rng(seed).integers(0, len(problems), size=(samples, len(problems)))
    count = np.bincount(k, minlength=len(problems))[draws].sum(1)
    means = {m: np.bincount(k, weights=np.array([float(r["correct"]) for r in rows]), minlength=len(problems))[draws]
             .sum(1) / count for m, rows in cols.items()}
    point = {m: float(np.mean([float(r["correct"]) for r in rows])) for m, rows in cols.items()}
    tail = 100 * (1 - level) / 2

    def ci(values: np.ndarray) -> list[float] | None:
        values = values[np.isfinite(values)]
        return [round(float(np.percentile(values, tail)), 4), round(float(np.percentile(values, 100 - tail)), 4)] \
            if len(values) else None

    out: dict[str, Any] = {"n": len(latent), "latent_accuracy": round(point["latent"], 4),
                           "ablated_accuracy": round(point["ablated"], 4), "ablated_accuracy_ci": ci(means["ablated"]),
                           "carried": round(point["latent"] - point["ablated"], 4),
                           "carried_ci": ci(means["latent"] - means["ablated"])}
    if direct is not None:
        lead = point["latent"] - point["direct"]
        out["direct_accuracy"] = round(point["direct"], 4)
        with np.errstate(invalid="ignore", divide="ignore"):
            kept = (means["ablated"] - means["direct"]) / (means["latent"] - means["direct"])
        out["kept_share"] = round((point["ablated"] - point["direct"]) / lead, 4) if lead else None
        out["kept_share_ci"] = ci(kept)
        # the acceptance rule: the latents carry the gain when the ablation keeps at most half of latent's lead
        out["latents_carry_gain"] = bool(lead > 0 and point["ablated"] - point["direct"] <= 0.5 * lead)
    return out


def diagnosis(probe_split: dict[str, Any] | None, ablation: dict[str, Any] | None) -> str:
    """One line that tells "not computed" from "computed but not read" (module docstring)."""
    parts = []
    if probe_split is not None:
        lin, maj = probe_split["linear"]["all"], probe_split["majority"]["all"]
        computed = lin is not None and maj is not None and lin - maj >= DECODABLE_MARGIN
        parts.append(f"value {'decodable' if computed else 'not decodable'} from the blocks "
                     f"(linear probe {lin:.1%} vs majority {maj:.1%})")
    if ablation is not None:
        read = ablation.get("latents_carry_gain")
        parts.append(f"constant latents {ablation['ablated_accuracy']:.1%} vs latent {ablation['latent_accuracy']:.1%}"
                     + ("" if read is None else f": the latents {'carry' if read else 'do not carry'} latent's gain"))
    return "; ".join(parts)
