"""The eval plots as DVC renders them: `dvc plots show --json` on a temporary DVC project holding
.dvc/plots/, dvc.yaml's eval plot entries and the files codi.evaluation.report.write_plots writes (built by
tools/render_plots.make_project, as the manual render check builds it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from codi.evaluation.report import compact, write_plots, write_probe_plot

ROOT = Path(__file__).resolve().parents[2]
MODES = ["explicit", "latent", "direct"]


def _stats(n: int, acc: float, positions: float) -> dict[str, Any]:
    return {"n": n, "output_accuracy": acc, "trace_exact_match": None, "action_accuracy": None,
            "locals_accuracy": None, "mean_positions": positions, "mean_time_s": 0.01}


# per source values that differ from the overall ones, so that a stacked or summed bar would show
PER_SOURCE = {
    "humaneval": {"explicit": _stats(3, 0.0, 510.5478), "latent": _stats(3, 1 / 3, 431.9391),
                  "direct": _stats(3, 0.0, 4.9826), "retention": None, "compression": 1.18, "speedup": 1.08},
    "synthetic": {"explicit": _stats(6, 2 / 6, 146.4019), "latent": _stats(6, 1 / 6, 88.7685),
                  "direct": _stats(6, 1 / 6, 5.713), "retention": 0.5, "compression": 1.65, "speedup": 1.5},
}
OVERALL = {"explicit": {**_stats(9, 2 / 9, 267.78), "output_accuracy_ci": [0.05, 0.5]}, "latent": _stats(9, 2 / 9, 203.16),
           "direct": _stats(9, 1 / 9, 5.47), "retention": 1.0, "compression": 1.32, "speedup": 1.2}


def _render_plots_module() -> Any:
    spec = importlib.util.spec_from_file_location("render_plots", ROOT / "tools/render_plots.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("eval_plots")
    write_plots(OVERALL, PER_SOURCE, tmp / "written")
    write_probe_plot(None, tmp / "written", why_none="a test without a latent model")
    project = _render_plots_module().make_project(tmp / "project", tmp / "written")
    done = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "--json", "-o", str(tmp / "out")],
                          cwd=project, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _vega(rendered: dict[str, Any], plot_id: str) -> dict[str, Any]:
    [item] = rendered["data"][plot_id]
    assert item["type"] == "vega" and item["content"]["description"].startswith("codi-trace"), item  # our template
    return item["content"]


def test_eval_plots_render_without_errors(rendered: dict[str, Any]) -> None:
    assert "errors" not in rendered
    assert set(rendered["data"]) == {f"plots/eval/{name}" for name in (
        "accuracy.csv", "accuracy_by_source.csv", "accuracy_vs_positions.csv",
        "accuracy.png", "accuracy_by_source.png", "accuracy_vs_positions.png", "latent_probe.png")}


def test_accuracy_plot_is_one_bar_per_mode_at_its_eval_json_value(rendered: dict[str, Any]) -> None:
    plot = _vega(rendered, "plots/eval/accuracy.csv")
    values = plot["data"]["values"]
    assert [v["mode"] for v in values] == MODES  # one datum per bar: nothing to stack
    eval_json = compact(OVERALL)
    assert {v["mode"]: float(v["accuracy"]) for v in values} == {m: eval_json[m]["output_accuracy"] for m in MODES}
    x, y = plot["encoding"]["x"], plot["encoding"]["y"]
    assert (x["field"], y["field"]) == ("accuracy", "mode") and "aggregate" not in x
    assert plot["encoding"]["yOffset"]["field"] == "rev"  # revisions (dvc plots diff) side by side, not stacked


def test_per_source_plot_groups_the_modes_of_each_source(rendered: dict[str, Any]) -> None:
    plot = _vega(rendered, "plots/eval/accuracy_by_source.csv")
    got = {(v["source"], v["mode"]): float(v["accuracy"]) for v in plot["data"]["values"]}
    assert got == {(s, m): round(PER_SOURCE[s][m]["output_accuracy"], 4) for s in PER_SOURCE for m in MODES}
    assert len(plot["data"]["values"]) == len(got)
    assert plot["encoding"]["x"]["field"] == "source" and plot["encoding"]["xOffset"]["field"] == "dvc_group"
    assert plot["layer"][0]["encoding"]["color"]["field"] == "mode"


def test_scatter_points_say_their_mode_and_source(rendered: dict[str, Any]) -> None:
    plot = _vega(rendered, "plots/eval/accuracy_vs_positions.csv")
    summaries = {"all": OVERALL, **PER_SOURCE}
    got = {(v["mode"], v["source"]): (float(v["positions"]), float(v["accuracy"])) for v in plot["data"]["values"]}
    assert got == {(m, s): (round(summaries[s][m]["mean_positions"], 2), round(summaries[s][m]["output_accuracy"], 4))
                   for s in summaries for m in MODES}
    assert plot["facet"]["column"]["field"] == "source"  # one panel per source
    bars, points, *labels = plot["spec"]["layer"]
    assert points["encoding"]["color"]["field"] == "mode"
    # each point's 95% interval as a vertical rule from accuracy_lo to accuracy_hi
    assert bars["mark"]["type"] == "rule" and (bars["encoding"]["y"]["field"], bars["encoding"]["y2"]["field"]) == (
        "accuracy_lo", "accuracy_hi")
    spans = {(v["mode"], v["source"]): (float(v["accuracy_lo"]), float(v["accuracy_hi"])) for v in plot["data"]["values"]}
    assert spans[("explicit", "all")] == (0.05, 0.5)
    assert spans[("latent", "synthetic")] == (round(1 / 6, 4), round(1 / 6, 4))  # no interval: the point
    assert all(layer["encoding"]["text"]["field"] == "dvc_label" for layer in labels) and len(labels) == 2
    assert any("datum.mode" in t.get("calculate", "") and t["as"] == "dvc_label" for t in plot["transform"])
