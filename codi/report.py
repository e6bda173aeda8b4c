"""The evaluation's reports, pure functions of the scored rows and their summaries: the DVC metrics
shape, the per-example predictions table, the plots (CSV for `dvc plots`, PNG for people) and the
markdown table.

    from codi.report import compact, markdown_report, write_plots, write_predictions
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SUMMARY_KEYS = ("n", "output_accuracy", "trace_exact_match", "action_accuracy", "locals_accuracy",
                "mean_positions", "mean_time_s")


def _round(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def compact(summary: dict[str, Any]) -> dict[str, Any]:
    """The DVC metrics shape: per mode a few numbers (time in ms), then the cross-mode ratios."""
    out: dict[str, Any] = {}
    for mode, stats in summary.items():
        if isinstance(stats, dict):
            out[mode] = {k: _round(stats[k] * 1000 if k == "mean_time_s" and stats[k] is not None else stats[k])
                         for k in SUMMARY_KEYS if stats.get(k) is not None}
            if "mean_time_s" in out[mode]:
                out[mode]["mean_time_ms"] = out[mode].pop("mean_time_s")
        elif stats is not None:
            out[mode] = _round(stats)
    return out


def write_predictions(rows: list[dict[str, Any]], generated: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([{**r, "generated": g} for r, g in zip(rows, generated)])
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(path)


def write_plots(overall: dict[str, Any], per_source: dict[str, Any], plots: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots.mkdir(parents=True, exist_ok=True)
    modes = [m for m, v in overall.items() if isinstance(v, dict)]
    groups = [("all", overall)] + list(per_source.items())
    with open(plots / "accuracy.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "source", "accuracy", "n"])
        for name, summ in groups:
            for m in modes:
                if m in summ:
                    w.writerow([m, name, f"{summ[m]['output_accuracy']:.4f}", summ[m]["n"]])
    with open(plots / "accuracy_vs_positions.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "source", "positions", "accuracy"])
        for name, summ in groups:
            for m in modes:
                if m in summ:
                    w.writerow([m, name, f"{summ[m]['mean_positions']:.2f}", f"{summ[m]['output_accuracy']:.4f}"])

    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * len(groups) * len(modes)))
    labels, values, colors = [], [], []
    palette = {"explicit": "#4c72b0", "latent": "#dd8452", "direct": "#55a868"}
    for name, summ in groups:
        for m in modes:
            if m in summ:
                labels.append(f"{name} / {m} (n={summ[m]['n']})")
                values.append(summ[m]["output_accuracy"])
                colors.append(palette.get(m, "gray"))
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("output accuracy")
    ax.set_title("output accuracy by source and decoding mode")
    fig.tight_layout()
    fig.savefig(plots / "accuracy.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, summ in groups:
        for m in modes:
            if m in summ:
                x, y = summ[m]["mean_positions"], summ[m]["output_accuracy"]
                ax.scatter(x, y, color=palette.get(m, "gray"), marker="o" if name == "all" else "x")
                ax.annotate(f"{m} ({name})", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("generated positions per example (tokens + latents)")
    ax.set_ylabel("output accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("accuracy vs cost")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(plots / "accuracy_vs_positions.png", dpi=110)
    plt.close(fig)


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:.1%}" if pct else (f"{v:.1f}" if isinstance(v, float) else str(v))


def markdown_report(overall: dict[str, Any], per_source: dict[str, Any], splits: list[str]) -> str:
    modes = [m for m, v in overall.items() if isinstance(v, dict)]
    lines = [f"## Evaluation on {', '.join(splits)}", "",
             "| mode | n | output acc | trace exact | action acc | locals acc | positions/ex | ms/ex |",
             "|---|---|---|---|---|---|---|---|"]
    for m in modes:
        s = overall[m]
        lines.append(f"| {m} | {s['n']} | {_fmt(s['output_accuracy'], True)} | {_fmt(s['trace_exact_match'], True)} | "
                     f"{_fmt(s['action_accuracy'], True)} | {_fmt(s['locals_accuracy'], True)} | "
                     f"{_fmt(s['mean_positions'])} | {_fmt(s['mean_time_s'] * 1000 if s['mean_time_s'] is not None else None)} |")
    ratios = [f"{k} {overall[k]:.2f}" + ("x" if k != "retention" else "") for k in ("retention", "compression", "speedup")
              if overall.get(k) is not None]
    if ratios:
        lines += ["", "Latent vs explicit: " + ", ".join(ratios) + " (retention = latent accuracy / explicit accuracy)."]
    lines += ["", "| source | " + " | ".join(f"{m} acc" for m in modes) + " |", "|---|" + "---|" * len(modes)]
    for src, summ in per_source.items():
        lines.append(f"| {src} | " + " | ".join(
            f"{_fmt(summ[m]['output_accuracy'], True)} (n={summ[m]['n']})" if m in summ else "-" for m in modes) + " |")
    return "\n".join(lines) + "\n"
