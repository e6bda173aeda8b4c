"""Evaluation metrics: per-example scores (`score_example`) and their means per mode and source (`summarize`).

    from codi.metrics import score_example, summarize
    row = score_example(result, truth_frames, source="synthetic")   # result: codi.decoding.DecodeResult
    overall, per_source = summarize(rows)   # {mode: {n, output_accuracy, ...}, retention, compression, speedup}

A measure that does not apply to a mode (trace fidelity for direct, locals for latent) is None and is
left out of its mean. retention = latent / explicit output accuracy; compression and speedup = explicit /
latent mean positions and mean time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import pandas as pd

from codi.answers import compare_answers
from codi.tracing.format import Frame, actions, entry_exit


class Prediction(Protocol):
    """What scoring reads from a decoded example (codi.decoding.DecodeResult has it all)."""

    mode: str
    frames: list[Frame]
    answer: str | None
    error: str
    stop: str
    positions: int
    time_s: float
    latent_blocks: int


def truth_answer(frames: Sequence[Frame]) -> str:
    """The true answer: the VALUE of the entry call's exit frame."""
    exit_frame = entry_exit(list(frames))
    if exit_frame is None:
        raise ValueError("truth trace has no entry return/exception frame: it cannot be scored "
                         "(pass truth= explicitly or leave truncated traces out)")
    return exit_frame.value_repr()  # type: ignore[return-value]


def action_accuracy(predicted: Sequence[Frame], truth: Sequence[Frame]) -> float:
    """Share of truth frames whose (kind, line) the prediction has at the same index."""
    if not truth:
        raise ValueError("empty truth trace")
    p, t = actions(list(predicted)), actions(list(truth))
    return sum(1 for k, a in enumerate(t) if k < len(p) and p[k] == a) / len(t)


def _locals_obj(frame: Frame) -> Any:
    if frame.locals is None:
        return None
    try:
        return json.loads(frame.locals)
    except json.JSONDecodeError:
        return None


def locals_accuracy(predicted: Sequence[Frame], truth: Sequence[Frame]) -> float | None:
    """Share of the truth's LINE/CALL frames whose locals the prediction has at the same index; None if none."""
    idx = [k for k, f in enumerate(truth) if f.kind in ("line", "call")]
    if not idx:
        return None
    hits = 0
    for k in idx:
        if k < len(predicted) and predicted[k].kind == truth[k].kind:
            p = _locals_obj(predicted[k])
            hits += p is not None and p == _locals_obj(truth[k])
    return hits / len(idx)


def score_example(pred: Prediction, truth_frames: Sequence[Frame], *, truth: str | None = None,
                  source: str = "", example_id: str = "") -> dict[str, Any]:
    """Score one decoded example against its true trace (and answer, default: the trace's exit VALUE).

    `correct`: well-formed and the answer matches the truth (codi.answers: literal values type-strictly, else
    exact text); `reason` says why not ("malformed: ...", "no entry return/exception frame ...", "wrong answer").
    Explicit and latent: `trace_exact` (the (kind, line) sequence equals the truth's) and `action_accuracy`.
    Explicit: `locals_accuracy`. Cost: `positions` (tokens + latents generated) and `time_s`.
    """
    truth = truth if truth is not None else truth_answer(truth_frames)
    if pred.error:
        correct, reason = False, pred.error
    else:
        correct = compare_answers(pred.answer, truth).correct
        reason = "" if correct else "wrong answer"
    traced = pred.mode in ("explicit", "latent")
    return {
        "id": example_id,
        "source": source,
        "mode": pred.mode,
        "correct": correct,
        "reason": reason,
        "predicted": pred.answer,
        "truth": truth,
        "trace_exact": (actions(list(pred.frames)) == actions(list(truth_frames))) if traced else None,
        "action_accuracy": action_accuracy(pred.frames, truth_frames) if traced else None,
        "locals_accuracy": locals_accuracy(pred.frames, truth_frames) if pred.mode == "explicit" else None,
        "positions": pred.positions,
        "time_s": pred.time_s,
        "latent_blocks": pred.latent_blocks,
        "stop": pred.stop,
    }


# summary key -> the score_example column it is the mean of
MEASURES = {"output_accuracy": "correct", "trace_exact_match": "trace_exact", "action_accuracy": "action_accuracy",
            "locals_accuracy": "locals_accuracy", "mean_positions": "positions", "mean_time_s": "time_s"}


def scores_frame(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """The scored rows as a table: mode, source and the measures as float (None -> NaN, bool -> 0/1)."""
    frame = pd.DataFrame.from_records(list(rows), columns=["mode", "source", *MEASURES.values()])
    return frame.astype({c: "float64" for c in MEASURES.values()})


def _stats(frame: pd.DataFrame) -> dict[str, Any]:
    means = frame[list(MEASURES.values())].mean()  # NaN (a measure that does not apply) is skipped
    return {"n": len(frame), **{k: None if pd.isna(means[c]) else float(means[c]) for k, c in MEASURES.items()}}


def mode_stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means over the rows of one mode (a measure none of them has is None)."""
    return _stats(scores_frame(rows))


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def cross_mode(by_mode: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """retention, compression and speedup of latent over explicit decoding (None where undefined;
    the CODI paper reports 3.1x compression and 2.7x speedup over explicit CoT)."""
    e, lat = by_mode.get("explicit"), by_mode.get("latent")
    if e is None or lat is None:
        return {"retention": None, "compression": None, "speedup": None}
    return {
        "retention": _ratio(lat["output_accuracy"], e["output_accuracy"]),
        "compression": _ratio(e["mean_positions"], lat["mean_positions"]),
        "speedup": _ratio(e["mean_time_s"], lat["mean_time_s"]),
    }


def _by_mode(frame: pd.DataFrame) -> dict[str, Any]:
    out: dict[str, Any] = {str(m): _stats(g) for m, g in frame.groupby("mode", sort=False)}  # modes in run order
    out.update(cross_mode(out))
    return out


def summarize(rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(overall, per_source): overall = {mode: stats, retention, compression, speedup};
    per_source = {source: the same shape over that source's rows}, sources sorted. Rows come from `score_example`."""
    if not rows:
        raise ValueError("no scored examples to summarize")
    frame = scores_frame(rows)
    return _by_mode(frame), {str(s): _by_mode(g) for s, g in frame.groupby("source")}
