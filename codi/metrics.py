"""Evaluation metrics: per-example scores and their aggregation per mode and source. Pure functions.

    from codi.metrics import score_example, summarize
    row = score_example(result, truth_frames, source="synthetic")   # result: codi.decoding.DecodeResult
    top, per_source = summarize(rows)        # plain dicts, ready for json.dump
    top == {"explicit": {"n": ..., "output_accuracy": ...}, "latent": {...}, "direct": {...},
            "retention": 0.9, "compression": 3.1, "speedup": 2.2}

Per example (`score_example`):
- `correct`: the generation is well-formed and its answer matches the truth (codi.answers: literal
  values type-strictly, else exact text); `reason` says why not ("malformed: ...", "no entry
  return/exception frame ...", "wrong answer").
- trace fidelity (explicit, latent): `trace_exact` = the executed (kind, source line) sequence
  (`codi.tracing.format.actions`) equals the truth's; `action_accuracy` = share of truth frames whose
  action the prediction has at the same index.
- `locals_accuracy` (explicit only; latent frames have no locals): share of the truth's LINE and CALL
  frames whose prediction at the same index is the same kind with the same locals object ({name: repr},
  `..` compared as written, key order free).
- cost: `positions` (tokens + latents generated) and `time_s`.
A measure that does not apply to the mode is None and is left out of its mean.

Cross-mode: retention = latent output accuracy / explicit output accuracy (None when explicit is 0),
compression = explicit mean positions / latent mean positions, speedup = explicit mean time / latent
mean time (the CODI paper reports 3.1x compression and 2.7x speedup over explicit CoT).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

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
    """Score one decoded example against its true trace (and answer, default: the trace's exit VALUE)."""
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


def _mean(values: Iterable[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def mode_stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means over the rows of one mode (a measure none of them has is None)."""
    return {
        "n": len(rows),
        "output_accuracy": _mean(r["correct"] for r in rows),
        "trace_exact_match": _mean(r["trace_exact"] for r in rows),
        "action_accuracy": _mean(r["action_accuracy"] for r in rows),
        "locals_accuracy": _mean(r["locals_accuracy"] for r in rows),
        "mean_positions": _mean(r["positions"] for r in rows),
        "mean_time_s": _mean(r["time_s"] for r in rows),
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def cross_mode(by_mode: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """retention, compression and speedup of latent over explicit decoding (None where undefined)."""
    e, lat = by_mode.get("explicit"), by_mode.get("latent")
    if e is None or lat is None:
        return {"retention": None, "compression": None, "speedup": None}
    return {
        "retention": _ratio(lat["output_accuracy"], e["output_accuracy"]),
        "compression": _ratio(e["mean_positions"], lat["mean_positions"]),
        "speedup": _ratio(e["mean_time_s"], lat["mean_time_s"]),
    }


def _by_mode(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    modes: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        modes.setdefault(r["mode"], []).append(r)
    out: dict[str, Any] = {m: mode_stats(rs) for m, rs in modes.items()}
    out.update(cross_mode(out))
    return out


def summarize(rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(overall, per_source): overall = {mode: stats, retention, compression, speedup};
    per_source = {source: the same shape over that source's rows}. Rows come from `score_example`."""
    if not rows:
        raise ValueError("no scored examples to summarize")
    sources: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        sources.setdefault(r["source"], []).append(r)
    return _by_mode(rows), {s: _by_mode(rs) for s, rs in sorted(sources.items())}
