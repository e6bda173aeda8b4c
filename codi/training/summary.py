"""A training stage's end-of-stage report: metrics from the Trainer's log history, a loss PNG, and for codi with a
reconstruction decoder `recon_probe`, which runs the trained model on val examples.

    summary = sft_summary(run.history, steps=..., examples=..., seconds=..., tokens=..., unigram=...)
    codi_summary(run.history, ...); save_loss_png(run.history, ("loss", "eval_loss"), "plots/sft/loss.png", "sft")
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def unigram_loss(train_targets: Iterable[Sequence[int]], val_targets: Iterable[Sequence[int]], vocab_size: int) -> float:
    """Cross-entropy (nats/token) on the val targets of an add-one unigram model of the train targets: the
    floor of a model that ignores context."""
    counts: Counter[int] = Counter()
    for t in train_targets:
        counts.update(t)
    total = sum(counts.values()) + vocab_size
    n, nll = 0, 0.0
    for t in val_targets:
        for tok in t:
            nll -= math.log((counts[tok] + 1) / total)
            n += 1
    return nll / max(n, 1)


def _r(v: float | None, digits: int = 5) -> float | None:
    return round(v, digits) if v is not None else None


def _last(history: Sequence[dict[str, Any]], key: str) -> float | None:
    vals = [h[key] for h in history if key in h]
    return vals[-1] if vals else None


def sft_summary(history: Sequence[dict[str, Any]], *, steps: int, examples: int, seconds: float, tokens: int,
                unigram: float | None, best_val_loss: float | None = None) -> dict[str, Any]:
    """metrics/<sft|sft_direct>.json. `best_val_loss` (keep = best) replaces the last validation loss."""
    val = best_val_loss if best_val_loss is not None else _last(history, "eval_loss")
    return {
        "train_loss": _r(_last(history, "loss")),
        "val_loss": _r(val),
        "unigram_val_loss": _r(unigram),
        "steps": steps,
        "examples": examples,
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),  # non-padding tokens of this session
        "train_runtime_s": round(seconds, 1),
    }


def codi_summary(history: Sequence[dict[str, Any]], *, steps: int, seconds: float, examples_per_step: int,
                 steps_this_session: int) -> dict[str, Any]:
    """metrics/codi.json: sub-losses at the first and last training log, the last validation."""
    train_logs = [h for h in history if "student_loss" in h and "loss" in h]
    evals = [h for h in history if "eval_loss" in h]
    last_eval = evals[-1] if evals else {}
    first, last = (train_logs[0], train_logs[-1]) if train_logs else ({}, {})
    return {
        "student_loss_first": first.get("student_loss"),
        "student_loss_last": last.get("student_loss"),
        "teacher_loss_last": last.get("teacher_loss"),
        "kd_loss_last": last.get("kd_loss"),
        **({"recon_loss_last": last["recon_loss"]} if "recon_loss" in last else {}),
        "val_loss": _r(last_eval.get("eval_loss")),
        "val_student_loss": _r(last_eval.get("eval_student_loss")),
        "val_latent_accuracy": _r(last_eval.get("eval_latent_accuracy")),
        "steps": steps,
        "examples_per_s": round(steps_this_session * examples_per_step / max(seconds, 1e-9), 2),
        "train_runtime_s": round(seconds, 1),
    }


def recon_probe(model: Any, dataset: Any, batch_size: int) -> dict[str, float]:
    """The held-out reconstruction probe (codi.recon_weight > 0): over every LINE frame of `dataset`, the share
    whose locals the reconstruction decoder writes back exactly from the frame's latents, and the share of
    truth tokens its greedy output matches position by position."""
    exact = tokens = right = frames = 0
    for s in range(0, len(dataset), batch_size):
        batch = [dataset[k] for k in range(s, min(s + batch_size, len(dataset)))]
        for pred, truth in model.reconstruct(batch):
            frames += 1
            exact += pred == truth
            tokens += len(truth)
            right += sum(p == t for p, t in zip(pred, truth))
    return {"val_recon_exact_match": _r(exact / max(frames, 1)), "val_recon_token_accuracy": _r(right / max(tokens, 1)),
            "val_recon_frames": frames}


def save_loss_png(history: Sequence[dict[str, Any]], keys: Sequence[str], png: Path, title: str) -> None:
    """The loss curves of `keys` against the step, for people (DVC's own plots come from dvclive)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in keys:
        pts = [(h["step"], h[k]) for h in history if "step" in h and h.get(k) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, markersize=3, label=k)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
