"""Evaluation metrics: per-example scores (`score_example`) and their means per mode and source (`summarize`).

    from codi.evaluation.metrics import score_example, summarize
    row = score_example(result, truth_frames, source="synthetic")   # result: codi.evaluation.decoding.DecodeResult
    overall, per_source = summarize(rows)   # {mode: {n, output_accuracy, ...}, retention, compression, speedup}

A measure that does not apply to a mode (trace fidelity for direct, locals for latent) is None and is
left out of its mean. retention = latent / explicit output accuracy; compression and speedup = explicit /
latent mean positions and mean time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pandas as pd

from codi.data.answers import compare_answers
from codi.schemas.modes import TRACED_MODES
from codi.tracing.format import Frame, actions, entry_exit


class Prediction(Protocol):
    """What scoring reads from a decoded example (codi.evaluation.decoding.DecodeResult has it all)."""

    mode: str
    frames: list[Frame]
    answer: str | None
    error: str
    stop: str
    positions: int
    time_s: float
    latent_blocks: int
    latent_lines: bool  # the latent LINE frames' lines are latent too (codi.latent_unit frame): no actions to score
    frames_per_block: int  # LINE frames one latent block stands for (a block parses as one frame)


def truth_answer(frames: Sequence[Frame]) -> str:
    """The true answer: the VALUE of the entry call's exit frame."""
    exit_frame = entry_exit(list(frames))
    if exit_frame is None:
        raise ValueError("truth trace has no entry return frame: it cannot be scored "
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


ERROR_KINDS = ("action", "locals", "value", "grammar")


def first_error(pred: Prediction, truth_frames: Sequence[Frame]) -> str | None:
    """Where the prediction first departs from the true trace, or None if it never does:
    `action` (a frame of another kind or source line, or a frame missing or too many; a latent LINE frame of the
    frame unit has no line to compare, only its kind), `locals` (the right line with other locals; latent LINE
    frames have none to compare; a block of several LINE frames, codi.frames_per_block, leaves their number unknown,
    so then only the other frames are compared, in order), `value` (a return/exception frame with
    another VALUE; for `direct`, a wrong answer), `grammar` (the generation stops being a trace or answer)."""
    if pred.mode == "direct":
        if pred.error:
            return "grammar"
        return None if pred.answer is not None and compare_answers(pred.answer, truth_answer(truth_frames)).correct \
            else "value"
    if pred.latent_lines and pred.frames_per_block > 1:
        pred_frames = [f for f in pred.frames if f.kind != "line"]
        truth_frames = [f for f in truth_frames if f.kind != "line"]
    else:
        pred_frames = pred.frames
    for p, t in zip(pred_frames, truth_frames):
        if p.kind != t.kind or (p.source_line is not None and p.source_line != t.source_line):
            return "action"
        if t.kind in ("line", "call") and p.locals is not None and _locals_obj(p) != _locals_obj(t):
            return "locals"
        if t.kind in ("return", "exception") and not compare_answers(p.value_repr(), t.value_repr()).correct:
            return "value"
    if pred.error:  # every parsed frame was right; then the text stopped being a trace
        return "grammar"
    return None if len(pred_frames) == len(truth_frames) else "action"


def score_example(pred: Prediction, truth_frames: Sequence[Frame], *, truth: str | None = None,
                  source: str = "", example_id: str = "", problem_id: str = "", difficulty: int = 0) -> dict[str, Any]:
    """Score one decoded example against its true trace (and answer, default: the trace's exit VALUE).

    `correct`: well-formed and the answer matches the truth (codi.data.answers: literal values type-strictly, else
    exact text); `reason` says why not ("malformed: ...", "no entry return frame ...", "wrong answer").
    Explicit and latent: `trace_exact` (the (kind, line) sequence equals the truth's) and `action_accuracy`; None
    when the prediction's lines are latent (`latent_lines`, the frame unit).
    Explicit: `locals_accuracy`. Cost: `positions` (tokens + latents generated) and `time_s`. `first_error`: the
    kind of the first departure from the true trace (`first_error`). `problem_id` groups the bootstrap;
    `difficulty` (the source's level, 0 = ungraded) groups `per_difficulty`.
    """
    truth = truth if truth is not None else truth_answer(truth_frames)
    if pred.error:
        correct, reason = False, pred.error
    else:
        correct = compare_answers(pred.answer, truth).correct
        reason = "" if correct else "wrong answer"
    traced = pred.mode in TRACED_MODES and not pred.latent_lines
    return {
        "id": example_id,
        "problem_id": problem_id or example_id,
        "source": source,
        "difficulty": difficulty,
        "mode": pred.mode,
        "correct": correct,
        "reason": reason,
        "first_error": first_error(pred, truth_frames),
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


@dataclass(frozen=True)
class Bootstrap:
    """Percentile bootstrap over problems (every call of a drawn problem comes along); a fixed seed."""

    samples: int
    seed: int
    level: float = 0.95


def scores_frame(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """The scored rows as a table: mode, source, problem, first error and the measures as float (None -> NaN)."""
    frame = pd.DataFrame.from_records(list(rows), columns=["mode", "source", "problem_id", "first_error",
                                                           *MEASURES.values()])
    frame["difficulty"] = [int(r.get("difficulty", 0)) for r in rows]
    return frame.astype({c: "float64" for c in MEASURES.values()})


def _stats(frame: pd.DataFrame) -> dict[str, Any]:
    means = frame[list(MEASURES.values())].mean()  # NaN (a measure that does not apply) is skipped
    wrong = frame.loc[frame["correct"] == 0, "first_error"].fillna("none")  # a wrong answer over a right trace: none
    return {"n": len(frame), **{k: None if pd.isna(means[c]) else float(means[c]) for k, c in MEASURES.items()},
            "first_error": {k: int((wrong == k).sum()) for k in (*ERROR_KINDS, "none") if (wrong == k).any()}}


def _interval(values: np.ndarray, level: float) -> list[float] | None:
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def bootstrap_intervals(frame: pd.DataFrame, boot: Bootstrap) -> dict[str, Any]:
    """{mode: {output_accuracy: [lo, hi]}, retention/compression/speedup: [lo, hi]}: every mode and ratio is
    computed on the same resampled problems (a paired bootstrap), so the ratios' intervals are paired too."""
    problems = np.array(sorted(frame["problem_id"].unique()))
    draws = np.random.default_rng(boot.seed).integers(0, len(problems), size=(boot.samples, len(problems)))
    pos = {p: k for k, p in enumerate(problems)}
    means: dict[str, dict[str, np.ndarray]] = {}
    for mode, g in frame.groupby("mode", sort=False):
        k = g["problem_id"].map(pos).to_numpy()
        count = np.bincount(k, minlength=len(problems))[draws].sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            means[str(mode)] = {col: np.bincount(k, weights=g[col].fillna(0).to_numpy(), minlength=len(problems))[draws]
                                .sum(1) / count for col in ("correct", "positions", "time_s")}
    out: dict[str, Any] = {m: {"output_accuracy": _interval(v["correct"], boot.level)} for m, v in means.items()}
    if "explicit" in means and "latent" in means:
        e, lat = means["explicit"], means["latent"]
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios = {"retention": lat["correct"] / e["correct"], "compression": e["positions"] / lat["positions"],
                      "speedup": e["time_s"] / lat["time_s"]}
        out.update({k: _interval(v, boot.level) for k, v in ratios.items()})
    return out


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


def _by_mode(frame: pd.DataFrame, boot: Bootstrap | None) -> dict[str, Any]:
    out: dict[str, Any] = {str(m): _stats(g) for m, g in frame.groupby("mode", sort=False)}  # modes in run order
    out.update(cross_mode(out))
    if boot is not None:
        ci = bootstrap_intervals(frame, boot)
        for mode in (m for m in out if isinstance(out[m], dict)):
            out[mode]["output_accuracy_ci"] = ci[mode]["output_accuracy"]
        for ratio in ("retention", "compression", "speedup"):
            out[f"{ratio}_ci"] = ci.get(ratio) if out.get(ratio) is not None else None
    return out


def summarize(rows: Sequence[dict[str, Any]], bootstrap: Bootstrap | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(overall, per_source): overall = {mode: stats, retention, compression, speedup} (with `*_ci` intervals
    when `bootstrap` is given); per_source = {source: the same shape over that source's rows}, sources sorted."""
    if not rows:
        raise ValueError("no scored examples to summarize")
    frame = scores_frame(rows)
    return _by_mode(frame, bootstrap), {str(s): _by_mode(g, bootstrap) for s, g in frame.groupby("source")}


def latent_diagnostics(forced_rows: Sequence[dict[str, Any]], norms: Sequence[float], cosines: Sequence[float],
                       embedding_norm: float, boot: Bootstrap) -> dict[str, Any]:
    """What the latent mode loses, beyond its accuracy:
    - forced_actions_accuracy: output accuracy of the latent decoder with every action line teacher-forced
      (`forced_rows`, scored latent rows): above the plain latent accuracy by what wrong lines cost, below
      the explicit accuracy by what the latents lose of the state;
    - latent_norm against embedding_norm: mean L2 norm of the latent input vectors (`norms`, one per example that
      fed latents) against the mean norm of the token embedding rows: latents far off the embedding scale are out
      of distribution;
    - latent_block_cosine: mean cosine similarity between an example's latent blocks (`cosines`; SIM-CoT's collapse
      signature: near 1 when every block holds the same vector)."""
    frame = scores_frame(forced_rows)
    ci = bootstrap_intervals(frame, boot).get("latent", {}).get("output_accuracy")
    acc = float(frame["correct"].mean())
    out: dict[str, Any] = {"forced_actions_accuracy": round(acc, 4)}
    if ci is not None:
        out["forced_actions_accuracy_lo"], out["forced_actions_accuracy_hi"] = (round(v, 4) for v in ci)
    out["latent_norm"] = round(float(np.mean(norms)), 4) if norms else None
    out["embedding_norm"] = round(float(embedding_norm), 4)
    out["latent_block_cosine"] = round(float(np.mean(cosines)), 4) if cosines else None
    return out


def per_difficulty(rows: Sequence[dict[str, Any]], bootstrap: Bootstrap | None = None) -> dict[str, Any]:
    """{level: summary of that level's rows} over the graded rows (difficulty > 0; ungraded sources such as
    HumanEval are left out), levels ascending as strings ("1", "2", ...); {} when no row is graded."""
    frame = scores_frame(rows)
    graded = frame[frame["difficulty"] > 0]
    return {str(d): _by_mode(g, bootstrap) for d, g in graded.groupby("difficulty")}
