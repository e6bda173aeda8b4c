"""The one writer of an evaluation's reports (codi.evaluation.core.Evaluation -> files).

    from codi.evaluation.writer import write_reports
    text = write_reports(result, cfg, Path("metrics"), Path("data/eval/predictions.parquet"), Path("plots/eval"))

It writes eval.json (compact overall, the latent diagnostics, ablation, probe and diagnosis), eval_by_source.json,
eval_by_difficulty.json, eval_by_split.json and eval.md in the metrics folder, the predictions parquet and the plots
(codi.evaluation.report makes each of them), and returns eval.md's text.
"""

from __future__ import annotations

from pathlib import Path

from codi.evaluation.core import Evaluation
from codi.evaluation.report import (
    compact,
    markdown_report,
    probe_markdown,
    write_plots,
    write_predictions,
    write_probe_plot,
)
from codi.infra.files import write_json, write_text
from codi.schemas.evaluate import EvaluateConfig


def write_reports(evaluation: Evaluation, cfg: EvaluateConfig, metrics_dir: Path, predictions: Path, plots: Path
                  ) -> str:
    """Every report of `evaluation` (the metrics JSONs and eval.md in `metrics_dir`, the predictions parquet, the
    plots); returns eval.md's text."""
    ev = evaluation
    write_json(metrics_dir / "eval.json", compact(ev.overall)
               | ({"latent_diagnostics": ev.diagnostics} if ev.diagnostics else {})
               | ({"latent_ablation": ev.ablation} if ev.ablation else {})
               | ({"latent_probe": ev.probe} if ev.probe else {})
               | ({"latent_diagnosis": ev.diagnoses} if ev.diagnoses else {}))
    write_json(metrics_dir / "eval_by_source.json", {s: compact(v) for s, v in ev.per_source.items()})
    write_json(metrics_dir / "eval_by_difficulty.json", {d: compact(v) for d, v in ev.by_level.items()})
    write_json(metrics_dir / "eval_by_split.json", ev.by_split)
    write_predictions(ev.rows, ev.generated, predictions)
    write_plots(ev.overall, ev.per_source, plots)
    write_probe_plot(ev.probe, plots, why_none="" if cfg.probe_train_examples and "latent" in cfg.modes else
                     "evaluate.probe_train_examples = 0 or no latent mode")
    report = markdown_report(ev.overall, ev.per_source, ev.splits, ev.by_level, ev.diagnostics, ev.by_split)
    if ev.probe or ev.ablation:
        report += "\n".join(probe_markdown(ev.probe, ev.ablation, ev.diagnoses)) + "\n"
    write_text(metrics_dir / "eval.md", report)
    return report
