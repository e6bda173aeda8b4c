"""Evaluation statistics: the first-error classifier on hand-made traces, and the bootstrap intervals
over problems (known cases, a fixed seed, pairing across modes)."""

from __future__ import annotations

import json

import pytest

from codi.evaluation.metrics import Bootstrap, bootstrap_intervals, first_error, scores_frame, summarize
from codi.evaluation.report import compact, markdown_report
from codi.tracing.format import Frame
from tests.unit.test_metrics import Pred, _latent

BOOT = Bootstrap(samples=1000, seed=0, level=0.95)
NESTED = [
    Frame("call", "def f(a):\n", locals='{"a": "1"}'),
    Frame("line", "    b = g(a)\n", locals='{"a": ".."}'),
    Frame("call", "def g(x):\n", locals='{"x": "1"}'),
    Frame("line", "    return x * 3\n", locals='{"x": ".."}'),
    Frame("return", "    return x * 3\n", value='"3"'),
    Frame("line", "    return b\n", locals='{"a": "..", "b": "3"}'),
    Frame("return", "    return b\n", value='"3"'),
]


def replace(frames, k, **changes):
    f = frames[k]
    out = list(frames)
    out[k] = Frame(changes.get("kind", f.kind), changes.get("source_line", f.source_line),
                   changes.get("locals", f.locals), changes.get("value", f.value))
    return out


@pytest.mark.parametrize("frames, error, expected", [
    (NESTED, "", None),                                                         # the whole trace right
    (replace(NESTED, 3, source_line="    return x + 3\n"), "", "action"),      # another line
    (replace(NESTED, 2, kind="line"), "", "action"),                            # another kind of frame
    (NESTED[:5], "", "action"),                                                 # a frame missing (stopped early)
    (NESTED + [NESTED[-1]], "", "action"),                                      # a frame too many
    (replace(NESTED, 5, locals='{"a": "..", "b": "4"}'), "", "locals"),         # a wrong computed value
    (replace(replace(NESTED, 5, locals='{"a": "..", "b": "4"}'), 3, source_line="x\n"), "", "action"),  # the first wins
    (replace(NESTED, 4, value='"4"'), "", "value"),                             # a nested call returns another value
    (replace(NESTED, 6, value='"30"'), "", "value"),                            # the answer
    (NESTED[:4], "malformed: frame 5", "grammar"),                              # right so far, then not a trace
    (replace(NESTED, 1, locals='{"a": "2"}')[:3], "malformed: frame 3", "locals"),  # a wrong frame before the bad text
])
def test_first_error_kinds(frames, error, expected):
    answer = frames[-1].value_repr() if frames and frames[-1].kind == "return" else None
    assert first_error(Pred("explicit", frames, answer, error=error), NESTED) == expected


def test_first_error_of_latent_and_direct():
    latent = _latent(NESTED)
    assert first_error(Pred("latent", latent, "3"), NESTED) is None          # latent LINE frames have no locals
    assert first_error(Pred("latent", replace(latent, 2, locals='{"x": "2"}'), "3"), NESTED) == "locals"  # a call's
    assert first_error(Pred("direct", [], "3"), NESTED) is None
    assert first_error(Pred("direct", [], "4"), NESTED) == "value"
    assert first_error(Pred("direct", [], None, error="malformed answer"), NESTED) == "grammar"


def rows(mode: str, correct_by_problem: dict[str, list[bool]], positions: int = 10, time_s: float = 1.0):
    return [{"mode": mode, "source": "s", "problem_id": p, "first_error": None if c else "locals", "correct": c,
             "trace_exact": None, "action_accuracy": None, "locals_accuracy": None, "positions": positions,
             "time_s": time_s} for p, calls in correct_by_problem.items() for c in calls]


def test_all_correct_gives_one_one_and_none_correct_zero_zero():
    frame = scores_frame(rows("explicit", {f"p{i}": [True, True] for i in range(30)})
                         + rows("latent", {f"p{i}": [False, False] for i in range(30)}))
    ci = bootstrap_intervals(frame, BOOT)
    assert ci["explicit"]["output_accuracy"] == [1.0, 1.0]
    assert ci["latent"]["output_accuracy"] == [0.0, 0.0]
    assert ci["retention"] == [0.0, 0.0]


def test_a_fixed_sample_gives_a_fixed_interval_that_covers_the_estimate():
    outcome = {f"p{i}": [i % 3 == 0, i % 4 == 0] for i in range(40)}  # 14 + 10 of 80 right: 0.3
    frame = scores_frame(rows("explicit", outcome))
    ci = bootstrap_intervals(frame, BOOT)["explicit"]["output_accuracy"]
    assert ci == bootstrap_intervals(frame, BOOT)["explicit"]["output_accuracy"]   # the seed is fixed
    assert ci[0] < 0.3 < ci[1] and 0.1 < ci[1] - ci[0] < 0.3
    assert ci == pytest.approx([0.2, 0.4125], abs=1e-9)  # this seed's interval, pinned
    other = bootstrap_intervals(frame, Bootstrap(samples=1000, seed=1))["explicit"]["output_accuracy"]
    assert other != ci and abs(other[0] - ci[0]) < 0.05


def test_problems_are_resampled_whole_and_ratios_are_paired():
    # latent is right exactly where explicit is, on every problem: retention is 1 in every resample
    outcome = {f"p{i}": [i % 2 == 0, i % 5 == 0] for i in range(50)}
    frame = scores_frame(rows("explicit", outcome, positions=30, time_s=2.0) + rows("latent", outcome, positions=10))
    ci = bootstrap_intervals(frame, BOOT)
    assert ci["retention"] == [1.0, 1.0] and ci["compression"] == [3.0, 3.0] and ci["speedup"] == [2.0, 2.0]
    assert ci["explicit"]["output_accuracy"] == ci["latent"]["output_accuracy"]
    # two calls per problem, always the same outcome: the interval is wider than for 100 independent examples
    clustered = scores_frame(rows("explicit", {f"p{i}": [i % 2 == 0] * 2 for i in range(50)}))
    independent = scores_frame(rows("explicit", {f"p{i}": [i % 2 == 0] for i in range(100)}))
    width = lambda f: (lambda c: c[1] - c[0])(bootstrap_intervals(f, BOOT)["explicit"]["output_accuracy"])  # noqa: E731
    assert width(clustered) > 1.2 * width(independent)


def test_summary_metrics_and_report_carry_the_intervals_and_error_counts():
    outcome = {f"p{i}": [i % 3 == 0, True] for i in range(20)}
    data = rows("explicit", outcome, positions=30) + rows("latent", {p: [False, c] for p, (c, _) in outcome.items()})
    overall, per_source = summarize(data, BOOT)
    assert overall["explicit"]["output_accuracy_ci"][0] <= overall["explicit"]["output_accuracy"]
    assert overall["explicit"]["first_error"] == {"locals": 13}
    metrics = compact(overall)
    assert {"output_accuracy_lo", "output_accuracy_hi"} <= set(metrics["explicit"])
    assert {"retention", "retention_lo", "retention_hi", "compression_lo"} <= set(metrics)
    json.dumps(metrics)
    report = markdown_report(overall, per_source, ["test"])
    lo, hi = overall["explicit"]["output_accuracy_ci"]
    assert f"[{100 * lo:.1f}, {100 * hi:.1f}]" in report and "| explicit | 13 |" in report.replace("  ", " ")
    assert summarize(data, BOOT) == (overall, per_source)  # byte-identical reruns
