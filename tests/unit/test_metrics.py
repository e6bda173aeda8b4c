"""codi.evaluation.metrics on hand-made predictions: per-example scores and their aggregation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from codi.evaluation.metrics import (
    Bootstrap,
    action_accuracy,
    cross_mode,
    latent_diagnostics,
    locals_accuracy,
    mode_stats,
    per_difficulty,
    score_example,
    summarize,
    truth_answer,
)
from codi.tracing.format import Frame

TRUTH = [
    Frame("call", "def f(a):\n", locals='{"a": "1"}'),
    Frame("line", "    b = a + 1\n", locals='{"a": ".."}'),
    Frame("line", "    return b\n", locals='{"a": "..", "b": "2"}'),
    Frame("return", "    return b\n", value='"2"'),
]


@dataclass
class Pred:
    mode: str
    frames: list[Frame] = field(default_factory=list)
    answer: str | None = None
    error: str = ""
    stop: str = "entry_exit"
    positions: int = 10
    time_s: float = 1.0
    latent_blocks: int = 0
    latent_lines: bool = False
    frames_per_block: int = 1


def _latent(frames):
    return [Frame(f.kind, f.source_line, locals=None) if f.kind == "line" else f for f in frames]


def _latent_frames(frames):
    """The frame unit's view (codi.latent_unit frame): a latent LINE frame has neither locals nor line."""
    return [Frame(f.kind, None, locals=None) if f.kind == "line" else f for f in frames]


def test_frame_unit_predictions_score_the_answer_and_no_actions():
    row = score_example(Pred("latent", _latent_frames(TRUTH), "2", latent_lines=True), TRUTH)
    assert row["correct"] and row["first_error"] is None
    assert row["trace_exact"] is None and row["action_accuracy"] is None and row["locals_accuracy"] is None
    too_few = _latent_frames(TRUTH[:2]) + [TRUTH[3]]  # a LINE frame missing: the kinds part at frame 2
    assert score_example(Pred("latent", too_few, "2", latent_lines=True), TRUTH)["first_error"] == "action"
    wrong_exit = Frame("return", TRUTH[3].source_line, value='"3"')
    wrong = score_example(Pred("latent", _latent_frames(TRUTH[:3]) + [wrong_exit], "3", latent_lines=True), TRUTH)
    assert (wrong["correct"], wrong["first_error"]) == (False, "value")
    # codi.frames_per_block 2: one latent frame stands for both LINE frames; only the others are compared
    block = [TRUTH[0], Frame("line", None), TRUTH[3]]
    assert score_example(Pred("latent", block, "2", latent_lines=True, frames_per_block=2), TRUTH)["first_error"] is None
    no_exit = score_example(Pred("latent", block[:2], None, error="no entry return frame", latent_lines=True,
                                 frames_per_block=2), TRUTH)
    assert no_exit["first_error"] == "grammar"


def test_truth_answer():
    assert truth_answer(TRUTH) == "2"
    with pytest.raises(ValueError, match="no entry return"):
        truth_answer(TRUTH[:3])


def test_perfect_explicit_prediction():
    row = score_example(Pred("explicit", list(TRUTH), "2"), TRUTH, source="s", example_id="e1")
    assert row["correct"] and row["reason"] == "" and row["trace_exact"]
    assert (row["action_accuracy"], row["locals_accuracy"]) == (1.0, 1.0)
    assert (row["id"], row["source"], row["predicted"], row["truth"]) == ("e1", "s", "2", "2")
    json.dumps(row)


def test_locals_key_order_free_and_dotdot_as_written():
    swapped = Frame("line", "    return b\n", locals='{"b": "2", "a": ".."}')
    spelled = Frame("line", "    b = a + 1\n", locals='{"a": "1"}')  # the value, where the truth says ".."
    pred = [TRUTH[0], spelled, swapped, TRUTH[3]]
    assert locals_accuracy(pred, TRUTH) == pytest.approx(2 / 3)


def test_partial_trace_fidelity():
    pred = [TRUTH[0], Frame("line", "    b = a - 1\n", locals='{"a": ".."}'), TRUTH[2]]  # wrong line, no return
    assert action_accuracy(pred, TRUTH) == 0.5
    assert locals_accuracy(pred, TRUTH) == 1.0  # locals judged per index, the kind matching
    assert action_accuracy(list(TRUTH) + [TRUTH[1]], TRUTH) == 1.0  # extra frames are not credited or charged
    row = score_example(Pred("explicit", pred, None, error="no entry return frame (stopped by eos)"), TRUTH)
    assert not row["correct"] and row["reason"].startswith("no entry return") and row["trace_exact"] is False


def test_wrong_and_malformed_and_type_strict():
    assert score_example(Pred("explicit", list(TRUTH), "3"), TRUTH)["reason"] == "wrong answer"
    assert not score_example(Pred("direct", [], "2.0"), TRUTH)["correct"]  # 2 != 2.0
    # A malformed generation is wrong even when its answer text happens to be right.
    row = score_example(Pred("latent", [], "2", error="malformed: frame 1: latent block followed by '{'"), TRUTH)
    assert not row["correct"] and row["reason"].startswith("malformed")


def test_mode_specific_measures():
    lat = score_example(Pred("latent", _latent(TRUTH), "2"), TRUTH)
    assert lat["correct"] and lat["trace_exact"] and lat["action_accuracy"] == 1.0 and lat["locals_accuracy"] is None
    direct = score_example(Pred("direct", [], "2"), TRUTH)
    assert direct["correct"] and direct["trace_exact"] is None and direct["action_accuracy"] is None
    assert score_example(Pred("direct", [], "0"), TRUTH, truth="0")["correct"]  # explicit truth wins


def _rows():
    rows = []
    # source a: explicit 2/2 right (20 positions, 2 s), latent 1/2 (5 positions, 0.5 s), direct 0/2.
    for k in range(2):
        rows.append(score_example(Pred("explicit", list(TRUTH), "2", positions=20, time_s=2.0), TRUTH, source="a"))
        rows.append(score_example(Pred("latent", _latent(TRUTH), "2" if k else "9", positions=5, time_s=0.5), TRUTH, source="a"))
        rows.append(score_example(Pred("direct", [], "7", positions=3, time_s=0.1), TRUTH, source="a"))
    # source b: explicit wrong and cut short, latent right.
    rows.append(score_example(Pred("explicit", TRUTH[:2], None, error="no entry return", positions=40, time_s=4.0),
                              TRUTH, source="b"))
    rows.append(score_example(Pred("latent", _latent(TRUTH), "2", positions=10, time_s=1.0), TRUTH, source="b"))
    return rows


def test_summarize_overall_and_per_source():
    top, per_source = summarize(_rows())
    e, lat, d = top["explicit"], top["latent"], top["direct"]
    assert (e["n"], lat["n"], d["n"]) == (3, 3, 2)
    assert e["output_accuracy"] == pytest.approx(2 / 3) and lat["output_accuracy"] == pytest.approx(2 / 3)
    assert e["trace_exact_match"] == pytest.approx(2 / 3) and e["action_accuracy"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert e["locals_accuracy"] == pytest.approx((1 + 1 + 2 / 3) / 3)
    assert lat["locals_accuracy"] is None and d["trace_exact_match"] is None and d["output_accuracy"] == 0.0
    assert e["mean_positions"] == pytest.approx(80 / 3) and lat["mean_positions"] == pytest.approx(20 / 3)
    assert top["retention"] == pytest.approx(1.0)
    assert top["compression"] == pytest.approx(4.0)
    assert top["speedup"] == pytest.approx((8 / 3) / (2 / 3))
    assert set(per_source) == {"a", "b"}
    assert per_source["a"]["retention"] == pytest.approx(0.5) and per_source["a"]["compression"] == pytest.approx(4.0)
    assert per_source["b"]["retention"] is None  # explicit accuracy 0 there
    assert "direct" not in per_source["b"]
    json.dumps(top)
    json.dumps(per_source)
    assert set(top) == {"explicit", "latent", "direct", "retention", "compression", "speedup"}


def test_per_difficulty_groups_graded_rows_by_level_and_leaves_ungraded_out():
    right = Pred("explicit", list(TRUTH), "2")
    wrong = Pred("explicit", list(TRUTH), "3")
    rows = ([score_example(right, TRUTH, source="synthetic", example_id=f"l1/{k}", difficulty=1) for k in range(3)]
            + [score_example(wrong, TRUTH, source="synthetic", example_id="l1/3", difficulty=1)]
            + [score_example(wrong, TRUTH, source="synthetic", example_id=f"l2/{k}", difficulty=2) for k in range(2)]
            + [score_example(right, TRUTH, source="humaneval", example_id="he/0")])  # ungraded: difficulty 0
    assert [r["difficulty"] for r in rows] == [1, 1, 1, 1, 2, 2, 0]
    levels = per_difficulty(rows, Bootstrap(200, 0))
    assert list(levels) == ["1", "2"]
    assert levels["1"]["explicit"]["n"] == 4 and levels["1"]["explicit"]["output_accuracy"] == pytest.approx(0.75)
    assert levels["2"]["explicit"]["output_accuracy"] == 0.0 and levels["2"]["explicit"]["output_accuracy_ci"] == [0.0, 0.0]
    assert per_difficulty([rows[-1]]) == {}  # nothing graded


def test_latent_diagnostics():
    right = Pred("latent", _latent(TRUTH), "2")
    rows = [score_example(right, TRUTH, example_id=f"e{k}") for k in range(3)] + \
        [score_example(Pred("latent", _latent(TRUTH), "9"), TRUTH, example_id="e3")]
    d = latent_diagnostics(rows, [2.0, 4.0], [0.5], 1.0, Bootstrap(300, 0))
    assert d["forced_actions_accuracy"] == 0.75 and 0.0 <= d["forced_actions_accuracy_lo"] <= 0.75 <= d["forced_actions_accuracy_hi"]
    assert (d["latent_norm"], d["embedding_norm"], d["latent_block_cosine"]) == (3.0, 1.0, 0.5)
    json.dumps(d)


def test_cross_mode_needs_both_modes():
    assert cross_mode({"direct": mode_stats(_rows()[2:3])}) == {"retention": None, "compression": None, "speedup": None}
    with pytest.raises(ValueError, match="no scored examples"):
        summarize([])


def test_empty_truth_rejected():
    with pytest.raises(ValueError, match="empty truth"):
        action_accuracy(TRUTH, [])
    assert locals_accuracy(TRUTH, [TRUTH[3]]) is None


def test_summarize_keeps_run_order_of_modes_sorts_sources_and_gives_plain_numbers():
    top, per_source = summarize(list(reversed(_rows())))  # source b's latent row comes first
    assert list(top)[:3] == ["latent", "explicit", "direct"] and list(per_source) == ["a", "b"]
    assert type(top["latent"]["n"]) is int and type(top["latent"]["output_accuracy"]) is float
    assert mode_stats([])["n"] == 0 and mode_stats([])["output_accuracy"] is None
