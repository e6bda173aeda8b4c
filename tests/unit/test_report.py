"""codi.evaluation.report on hand-made summaries: the DVC metrics shape, the plot tables and files, predictions, markdown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest

from codi.evaluation.report import (
    PLOT_FILES,
    compact,
    markdown_report,
    plot_tables,
    summary_table,
    write_plots,
    write_predictions,
)


def _stats(n: int, acc: float, positions: float, time_s: float, trace: float | None = None,
           locals_: float | None = None) -> dict[str, Any]:
    return {"n": n, "output_accuracy": acc, "trace_exact_match": trace, "action_accuracy": trace,
            "locals_accuracy": locals_, "mean_positions": positions, "mean_time_s": time_s}


OVERALL = {"explicit": _stats(4, 0.5, 200.123, 0.0651234, 0.75, 0.6), "latent": _stats(4, 0.25, 100.0, 0.05, 0.5),
           "direct": _stats(4, 0.125, 5.5547, 0.004), "retention": 0.5, "compression": 2.00123, "speedup": 1.30246}
PER_SOURCE = {
    "humaneval": {"explicit": _stats(1, 0.0, 500.0, 0.2, 0.0, 0.0), "latent": _stats(1, 0.0, 400.0, 0.2, 0.0),
                  "retention": None, "compression": 1.25, "speedup": 1.0},
    "synthetic": {"explicit": _stats(3, 2 / 3, 100.164, 0.02, 1.0, 0.8), "latent": _stats(3, 1 / 3, 0.0, 0.01, 2 / 3),
                  "direct": _stats(4, 0.125, 5.5547, 0.004), "retention": 0.5, "compression": None, "speedup": 2.0},
}


def test_compact_is_the_dvc_metrics_shape() -> None:
    out = compact(OVERALL)
    assert out["explicit"] == {"n": 4, "output_accuracy": 0.5, "trace_exact_match": 0.75, "action_accuracy": 0.75,
                               "locals_accuracy": 0.6, "mean_positions": 200.123, "mean_time_ms": 65.1234}
    assert out["direct"] == {"n": 4, "output_accuracy": 0.125, "mean_positions": 5.5547, "mean_time_ms": 4.0}
    assert (out["retention"], out["compression"], out["speedup"]) == (0.5, 2.0012, 1.3025)
    assert "retention" not in compact(PER_SOURCE["humaneval"])  # None is left out
    json.dumps(out)


def test_summary_table_is_long_form_with_all_first() -> None:
    t = summary_table(OVERALL, PER_SOURCE)
    assert list(zip(t["source"], t["mode"])) == [
        ("all", "explicit"), ("all", "latent"), ("all", "direct"), ("humaneval", "explicit"), ("humaneval", "latent"),
        ("synthetic", "explicit"), ("synthetic", "latent"), ("synthetic", "direct")]
    assert t.loc[7, "mean_positions"] == 5.5547 and pd.isna(t.loc[2, "trace_exact_match"])


def test_plot_tables_one_row_per_mode_then_per_source() -> None:
    tables = plot_tables(OVERALL, PER_SOURCE)
    acc = tables["accuracy.csv"]
    assert list(acc.columns) == ["mode", "accuracy", "n"]
    assert acc.to_dict("records") == [{"mode": "explicit", "accuracy": 0.5, "n": 4},
                                      {"mode": "latent", "accuracy": 0.25, "n": 4},
                                      {"mode": "direct", "accuracy": 0.125, "n": 4}]
    by_source = tables["accuracy_by_source.csv"]
    assert list(by_source.columns) == ["source", "mode", "accuracy", "n"]
    assert list(zip(by_source["source"], by_source["mode"], by_source["accuracy"])) == [
        ("humaneval", "explicit", 0.0), ("humaneval", "latent", 0.0), ("synthetic", "explicit", 0.6667),
        ("synthetic", "latent", 0.3333), ("synthetic", "direct", 0.125)]
    cost = tables["accuracy_vs_positions.csv"]
    assert list(cost.columns) == ["mode", "source", "positions", "accuracy", "accuracy_lo", "accuracy_hi", "n"]
    assert len(cost) == 8 and cost.iloc[0].to_dict() == {"mode": "explicit", "source": "all", "positions": 200.12,
                                                         "accuracy": 0.5, "accuracy_lo": 0.5, "accuracy_hi": 0.5,
                                                         "n": 4}  # no interval given: the point itself


def test_plot_tables_read_the_committed_compact_form() -> None:
    tables = plot_tables(compact(OVERALL), {s: compact(v) for s, v in PER_SOURCE.items()})
    assert tables["accuracy.csv"]["accuracy"].tolist() == [0.5, 0.25, 0.125]
    assert tables["accuracy_vs_positions.csv"]["positions"].tolist()[:3] == [200.12, 100.0, 5.55]


def test_accuracy_vs_positions_carries_each_interval_in_either_form() -> None:
    with_ci = {**OVERALL, "explicit": {**OVERALL["explicit"], "output_accuracy_ci": [0.31234, 0.7]}}
    for overall in (with_ci, compact(with_ci)):  # summarize's `_ci` list, or the committed `_lo`/`_hi`
        cost = plot_tables(overall, PER_SOURCE)["accuracy_vs_positions.csv"]
        first, second = cost.iloc[0], cost.iloc[1]
        assert (first["accuracy_lo"], first["accuracy"], first["accuracy_hi"]) == (0.3123, 0.5, 0.7)
        assert second["accuracy_lo"] == second["accuracy_hi"] == second["accuracy"]  # none given


def test_write_plots_writes_csv_and_png(tmp_path: Path) -> None:
    write_plots(OVERALL, PER_SOURCE, tmp_path / "plots")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(PLOT_FILES)  # no temporary left
    assert (tmp_path / "plots/accuracy.csv").read_text() == (
        "mode,accuracy,n\nexplicit,0.5,4\nlatent,0.25,4\ndirect,0.125,4\n")
    assert (tmp_path / "plots/accuracy_by_source.csv").read_text().splitlines()[:2] == [
        "source,mode,accuracy,n", "humaneval,explicit,0.0,1"]
    for name in PLOT_FILES:
        if name.endswith(".png"):
            assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_predictions_keeps_the_row_columns(tmp_path: Path) -> None:
    rows = [{"id": "a", "mode": "explicit", "correct": True, "predicted": "2", "trace_exact": True,
             "locals_accuracy": 0.5, "positions": 10},
            {"id": "b", "mode": "direct", "correct": False, "predicted": None, "trace_exact": None,
             "locals_accuracy": None, "positions": 3}]
    path = tmp_path / "eval/predictions.parquet"
    write_predictions(rows, ["<gen a>", "<gen b>"], path)
    table = pq.read_table(path)
    assert table.column_names == [*rows[0], "generated"]
    assert table.to_pylist() == [{**r, "generated": g} for r, g in zip(rows, ["<gen a>", "<gen b>"])]
    assert [p.name for p in path.parent.iterdir()] == ["predictions.parquet"]
    with pytest.raises(ValueError):
        write_predictions(rows, ["only one"], path)


def test_markdown_report_states_the_latent_diagnostics() -> None:
    d = {"forced_actions_accuracy": 0.5, "forced_actions_accuracy_lo": 0.25, "forced_actions_accuracy_hi": 0.75,
         "latent_norm": 9.81, "embedding_norm": 1.23, "latent_block_cosine": 0.4}
    text = markdown_report(OVERALL, PER_SOURCE, ["test"], None, d)
    assert ("Latent diagnostics: with every action line teacher-forced, output accuracy 50.0% [25.0, 75.0]; latent "
            "norm 9.8 vs token embedding norm 1.2; mean cosine between latent blocks 0.40.") in text
    assert "Latent diagnostics" not in markdown_report(OVERALL, PER_SOURCE, ["test"])


def test_markdown_report_shows_difficulty_levels_only_when_there_are_several() -> None:
    one = {"1": {"explicit": {**_stats(3, 2 / 3, 100.0, 0.02), "output_accuracy_ci": [0.3333, 1.0]}}}
    assert "difficulty" not in markdown_report(OVERALL, PER_SOURCE, ["test"], one)
    two = {**one, "2": {"explicit": _stats(2, 0.5, 300.0, 0.05)}}
    text = markdown_report(OVERALL, PER_SOURCE, ["test"], two)
    assert text.endswith("""Accuracy per difficulty level of the graded sources:

| difficulty | explicit acc [95% CI] |
|---|---|
| 1 | 66.7% [33.3, 100.0] (n=3) |
| 2 | 50.0% (n=2) |
""")


def test_markdown_report() -> None:
    assert markdown_report(OVERALL, PER_SOURCE, ["test", "val"]) == """\
## Evaluation on test, val

| mode | n | output acc | trace exact | action acc | locals acc | positions/ex | ms/ex |
|---|---|---|---|---|---|---|---|
| explicit | 4 | 50.0% | 75.0% | 75.0% | 60.0% | 200.1 | 65.1 |
| latent | 4 | 25.0% | 50.0% | 50.0% | - | 100.0 | 50.0 |
| direct | 4 | 12.5% | - | - | - | 5.6 | 4.0 |

Latent vs explicit: retention 0.50, compression 2.00x, speedup 1.30x (retention = latent accuracy / explicit accuracy).

| source | explicit acc | latent acc | direct acc |
|---|---|---|---|
| humaneval | 0.0% (n=1) | 0.0% (n=1) | - |
| synthetic | 66.7% (n=3) | 33.3% (n=3) | 12.5% (n=4) |
"""
