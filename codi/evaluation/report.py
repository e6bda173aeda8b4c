"""The evaluation's reports, pure functions of the scored rows and their summaries (codi.evaluation.metrics.summarize).

    from codi.evaluation.report import compact, markdown_report, write_plots, write_predictions
    write_plots(overall, per_source, Path("plots/eval"))

codi.evaluation.writer.write_reports puts them together for one evaluation.

write_plots writes, for `dvc plots` (drawn by the templates in .dvc/plots/, named in dvc.yaml) and as PNGs:
accuracy.csv (mode, accuracy, n: one row per mode, all examples), accuracy_by_source.csv (source, mode,
accuracy, n) and accuracy_vs_positions.csv (mode, source, positions, accuracy with its 95% interval
accuracy_lo/accuracy_hi, n; source "all" = all examples).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pandas as pd

from codi.infra.files import atomic_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SUMMARY_KEYS = ("n", "output_accuracy", "trace_exact_match", "action_accuracy", "locals_accuracy",
                "mean_positions", "mean_time_s")
ALL = "all"  # the source name of the rows over all examples
PALETTE = {"explicit": "#4c72b0", "latent": "#dd8452", "direct": "#55a868"}
PLOT_FILES = ("accuracy.csv", "accuracy_by_source.csv", "accuracy_vs_positions.csv",
              "accuracy.png", "accuracy_by_source.png", "accuracy_vs_positions.png")


def _round(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def _with_interval(out: dict[str, Any], key: str, value: Any, interval: list[float] | None) -> None:
    out[key] = _round(value)
    if interval is not None:  # `dvc exp show` columns: key, key_lo, key_hi
        out[f"{key}_lo"], out[f"{key}_hi"] = (_round(v) for v in interval)


def compact(summary: dict[str, Any]) -> dict[str, Any]:
    """The DVC metrics shape: per mode a few numbers (time in ms; 95% intervals as `_lo`/`_hi`; the first-error
    counts of the wrong answers), then the cross-mode ratios with their intervals."""
    out: dict[str, Any] = {}
    for mode, stats in summary.items():
        if isinstance(stats, dict):
            m: dict[str, Any] = {}
            for k in SUMMARY_KEYS:
                if stats.get(k) is None:
                    continue
                if k == "mean_time_s":
                    m["mean_time_ms"] = _round(stats[k] * 1000)
                else:
                    _with_interval(m, k, stats[k], stats.get(f"{k}_ci"))
            if stats.get("first_error"):
                m["first_error"] = dict(stats["first_error"])
            out[mode] = m
        elif stats is not None and not mode.endswith("_ci"):
            _with_interval(out, mode, stats, summary.get(f"{mode}_ci"))
    return out


def write_predictions(rows: list[dict[str, Any]], generated: list[str], path: Path) -> None:
    """One row per example per mode: the scored row and the generated text."""
    with atomic_path(path) as tmp:
        pd.DataFrame(rows).assign(generated=generated).to_parquet(tmp, compression="zstd", index=False)


def summary_table(overall: dict[str, Any], per_source: dict[str, Any]) -> pd.DataFrame:
    """Long form of the summaries: one row per (source, mode), source "all" first, then the stats' columns.
    Takes summarize's dicts or their compact() form (the committed metrics/eval*.json)."""
    records = [{"source": source, "mode": mode, **stats}
               for source, summary in {ALL: overall, **per_source}.items()
               for mode, stats in summary.items() if isinstance(stats, dict)]  # skip the cross-mode ratios
    return pd.DataFrame.from_records(records)


def plot_tables(overall: dict[str, Any], per_source: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """The CSV files of write_plots, by file name."""
    t = (summary_table(overall, per_source)
         .rename(columns={"output_accuracy": "accuracy", "mean_positions": "positions"})
         .round({"accuracy": 4, "positions": 2}))
    # the 95% interval of each accuracy (summarize's `_ci` list, or compact's `_lo`/`_hi`); the point where none
    ci = t["output_accuracy_ci"] if "output_accuracy_ci" in t else pd.Series([None] * len(t), index=t.index)
    for k, side in enumerate(("lo", "hi")):
        given = t[f"output_accuracy_{side}"] if f"output_accuracy_{side}" in t else pd.Series(float("nan"), index=t.index)
        from_ci = ci.map(lambda c, k=k: c[k] if isinstance(c, (list, tuple)) else float("nan"))
        t[f"accuracy_{side}"] = given.fillna(from_ci).fillna(t["accuracy"]).astype(float).round(4)
    over_all = t["source"] == ALL
    return {
        "accuracy.csv": t.loc[over_all, ["mode", "accuracy", "n"]],
        "accuracy_by_source.csv": t.loc[~over_all, ["source", "mode", "accuracy", "n"]],
        "accuracy_vs_positions.csv": t[["mode", "source", "positions", "accuracy", "accuracy_lo", "accuracy_hi", "n"]],
    }


def write_plots(overall: dict[str, Any], per_source: dict[str, Any], plots: Path) -> None:
    """The PLOT_FILES into `plots`: the CSVs of plot_tables and a PNG of each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = plot_tables(overall, per_source)
    for name, table in tables.items():
        with atomic_path(plots / name) as tmp:
            table.to_csv(tmp, index=False)
    for name, draw in (("accuracy.png", _draw_accuracy), ("accuracy_by_source.png", _draw_by_source),
                       ("accuracy_vs_positions.png", _draw_vs_positions)):
        fig = draw(plt, tables[name.replace(".png", ".csv")])
        with atomic_path(plots / name) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)


def _color(mode: str) -> str:
    return PALETTE.get(mode, "gray")


def _draw_accuracy(plt: ModuleType, t: pd.DataFrame) -> Figure:
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.45 * len(t)))
    bars = ax.barh([f"{m} (n={n})" for m, n in zip(t["mode"], t["n"])], t["accuracy"], color=t["mode"].map(_color))
    ax.bar_label(bars, labels=[f"{a:.1%}" for a in t["accuracy"]], padding=3)
    ax.invert_yaxis()  # the first mode on top
    ax.set_xlim(0, 1)
    ax.set_xlabel("output accuracy")
    ax.set_title("output accuracy by decoding mode (all examples)")
    fig.tight_layout()
    return fig


def _draw_by_source(plt: ModuleType, t: pd.DataFrame) -> Figure:
    acc = t.pivot(index="source", columns="mode", values="accuracy").reindex(columns=t["mode"].unique())
    n = t.groupby("source")["n"].max()
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * max(len(acc), 1), 4))
    width = 0.8 / max(len(acc.columns), 1)
    for k, mode in enumerate(acc.columns):
        bars = ax.bar([i + (k - (len(acc.columns) - 1) / 2) * width for i in range(len(acc))], acc[mode],
                      width, label=mode, color=_color(mode))
        ax.bar_label(bars, labels=["" if pd.isna(a) else f"{a:.1%}" for a in acc[mode]], fontsize=7, padding=2)
    ax.set_xticks(range(len(acc)), [f"{s}\n(n={n[s]})" for s in acc.index])
    ax.set_ylim(0, 1)
    ax.set_ylabel("output accuracy")
    ax.set_title("output accuracy by source and decoding mode")
    if len(acc.columns):
        ax.legend(title="mode")
    fig.tight_layout()
    return fig


def _draw_vs_positions(plt: ModuleType, t: pd.DataFrame) -> Figure:
    from matplotlib.ticker import PercentFormatter

    # one panel per source; labels alternate right/left of their points in order of positions, so that
    # two modes at about the same cost (humaneval: explicit and latent) do not write over each other
    sources = list(t["source"].unique())
    fig, axes = plt.subplots(1, len(sources), figsize=(1.5 + 3.4 * len(sources), 3.8), sharex=True, sharey=True,
                             squeeze=False)
    for ax, source in zip(axes[0], sources):
        points = t[t["source"] == source].sort_values("positions")
        for k, row in enumerate(points.itertuples()):
            ax.errorbar(row.positions, row.accuracy, yerr=[[row.accuracy - row.accuracy_lo], [row.accuracy_hi - row.accuracy]],
                        fmt="none", ecolor=_color(row.mode), elinewidth=1, capsize=3)  # the 95% interval
            ax.scatter(row.positions, row.accuracy, color=_color(row.mode), s=40, label=row.mode)
            ax.annotate(f"{row.mode} {row.accuracy:.1%}", (row.positions, row.accuracy), fontsize=7, va="center",
                        ha="left" if k % 2 == 0 else "right", xytext=(6 if k % 2 == 0 else -6, 0),
                        textcoords="offset points")
        ax.set_title(f"source: {source} (n={points['n'].max()})")
        ax.set_xscale("log")  # direct writes ~5 positions, the traces hundreds
        ax.set_xlabel("generated positions per example")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("output accuracy")
    axes[0][0].set_ylim(-0.02, min(1.02, 1.2 * float(t["accuracy"].max()) + 0.05))
    axes[0][0].set_xlim(1, 3 * float(t["positions"].max()))
    axes[0][0].yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    fig.suptitle("accuracy vs cost (tokens + latents generated; bars: 95% intervals)")
    fig.tight_layout()
    return fig


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return "-"
    return f"{v:.1%}" if pct else (f"{v:.1f}" if isinstance(v, float) else str(v))


def _with_ci(value: Any, interval: Any) -> str:
    if value is None:
        return "-"
    return _fmt(value, True) + (" [{:.1f}, {:.1f}]".format(100 * interval[0], 100 * interval[1]) if interval else "")


def _markdown_table(cells: pd.DataFrame) -> list[str]:
    return (["| " + " | ".join(map(str, cells.columns)) + " |", "|---|" + "---|" * (len(cells.columns) - 1)]
            + ["| " + " | ".join(map(str, row)) + " |" for row in cells.itertuples(index=False)])


def split_summaries(by_split: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """metrics/eval_by_split.json: {split: {"all": compact overall, source: compact per source}} from
    {split: summarize(rows of that split)}: where a result is chosen (val) apart from where it is reported (test)."""
    return {split: {ALL: compact(overall), **{src: compact(v) for src, v in per_source.items()}}
            for split, (overall, per_source) in by_split.items()}


def _split_table(by_split: dict[str, Any], modes: list[str]) -> list[str]:
    rows = [{"split": split, "source": source,
             **{f"{m} acc [95% CI]": _with_ci(s[m]["output_accuracy"], [s[m]["output_accuracy_lo"], s[m]["output_accuracy_hi"]]
                                              if "output_accuracy_lo" in s[m] else None) + f" (n={s[m]['n']})"
                for m in modes if isinstance(s.get(m), dict)},
             "retention": "-" if s.get("retention") is None else f"{s['retention']:.2f}" + (
                 f" [{s['retention_lo']:.2f}, {s['retention_hi']:.2f}]" if "retention_lo" in s else "")}
            for split, per_source in by_split.items() for source, s in per_source.items()
            if source != ALL or len(per_source) > 2]  # "all" only where a split holds several sources
    return _markdown_table(pd.DataFrame(rows))


def markdown_report(overall: dict[str, Any], per_source: dict[str, Any], splits: list[str],
                    per_difficulty: dict[str, Any] | None = None, diagnostics: dict[str, Any] | None = None,
                    by_split: dict[str, Any] | None = None) -> str:
    """The evaluation table per mode, the latent-vs-explicit ratios, the latent diagnostics
    (codi.evaluation.metrics.latent_diagnostics), the accuracy per source, per split and source (split_summaries) and,
    when several levels were evaluated, per difficulty level (codi.evaluation.metrics.per_difficulty), in markdown."""
    t = summary_table(overall, per_source).reindex(
        columns=["source", "mode", *SUMMARY_KEYS, "output_accuracy_ci", "first_error"]).astype(object)
    t = t.where(t.notna(), None)
    top = t[t["source"] == ALL]
    pct = {"trace exact": "trace_exact_match", "action acc": "action_accuracy", "locals acc": "locals_accuracy"}
    cells = pd.DataFrame({"mode": top["mode"], "n": top["n"],
                          ("output acc [95% CI]" if top["output_accuracy_ci"].notna().any() else "output acc"):
                              [_with_ci(a, ci) for a, ci in zip(top["output_accuracy"], top["output_accuracy_ci"])],
                          **{name: top[key].map(lambda v: _fmt(v, True)) for name, key in pct.items()},
                          "positions/ex": top["mean_positions"].map(_fmt),
                          "ms/ex": top["mean_time_s"].map(lambda v: _fmt(None if v is None else v * 1000))})
    lines = [f"## Evaluation on {', '.join(splits)}", "", *_markdown_table(cells)]
    ratios = [f"{k} {overall[k]:.2f}" + ("x" if k != "retention" else "")
              + (" [{:.2f}, {:.2f}]".format(*overall[f"{k}_ci"]) if overall.get(f"{k}_ci") else "")
              for k in ("retention", "compression", "speedup") if overall.get(k) is not None]
    if ratios:
        paired = "; [95% paired bootstrap interval over problems]" if overall.get("retention_ci") else ""
        lines += ["", "Latent vs explicit: " + ", ".join(ratios) + f" (retention = latent accuracy / explicit accuracy{paired})."]
    if diagnostics:
        d = diagnostics
        ci = ([d["forced_actions_accuracy_lo"], d["forced_actions_accuracy_hi"]]
              if "forced_actions_accuracy_lo" in d else None)
        lines += ["", f"Latent diagnostics: with every action line teacher-forced, output accuracy "
                      f"{_with_ci(d['forced_actions_accuracy'], ci)}; latent norm {_fmt(d['latent_norm'])} vs token "
                      f"embedding norm {_fmt(d['embedding_norm'])}; mean cosine between latent blocks "
                      f"{'-' if d['latent_block_cosine'] is None else format(d['latent_block_cosine'], '.2f')}."]
    errors = [(m, fe) for m, fe in zip(top["mode"], top["first_error"]) if fe]
    if errors:
        kinds = [k for k in ("action", "locals", "value", "grammar", "none") if any(k in fe for _, fe in errors)]
        lines += ["", "Wrong answers by the first place the generation departs from the true trace:", "",
                  *_markdown_table(pd.DataFrame([{"mode": m, **{k: fe.get(k, 0) for k in kinds}} for m, fe in errors]))]
    by_source = t[t["source"] != ALL]
    acc = (by_source.assign(cell=[f"{_fmt(a, True)} (n={n})" for a, n in zip(by_source["output_accuracy"], by_source["n"])])
           .pivot(index="source", columns="mode", values="cell")
           .reindex(index=list(per_source), columns=list(top["mode"])).fillna("-"))
    acc.columns = [f"{m} acc" for m in acc.columns]
    lines += ["", *_markdown_table(acc.rename_axis("source").reset_index())]
    if by_split and len(by_split) > 1:
        lines += ["", "Per split (choose on val, report on test):", "", *_split_table(by_split, list(top["mode"]))]
    if per_difficulty and len(per_difficulty) > 1:
        modes = list(top["mode"])
        rows = [{"difficulty": level, **{f"{m} acc [95% CI]": _with_ci(s[m]["output_accuracy"], s[m].get("output_accuracy_ci"))
                                         + f" (n={s[m]['n']})" for m in modes if isinstance(s.get(m), dict)}}
                for level, s in per_difficulty.items()]
        lines += ["", "Accuracy per difficulty level of the graded sources:", "", *_markdown_table(pd.DataFrame(rows))]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- what the latents carry (codi.evaluation.probe)
PROBE_PNG = "latent_probe.png"


def probe_markdown(probe: dict[str, Any] | None, ablation: dict[str, Any] | None,
                   diagnoses: dict[str, str] | None = None) -> list[str]:
    """The eval.md section "What the latents carry": the constant-latent ablation per split, the probe per split
    (majority, linear probe, logit lens at each position; overall, copy, computed) and a diagnosis line per split."""
    lines: list[str] = []
    if ablation:
        rows = []
        for split, a in ablation.items():
            row = {"split": split, "n": a["n"], "latent": _fmt(a["latent_accuracy"], True),
                   "constant latents [95% CI]": _with_ci(a["ablated_accuracy"], a.get("ablated_accuracy_ci")),
                   "carried = latent - constant [95% CI]": _with_ci(a["carried"], a.get("carried_ci"))}
            if "direct_accuracy" in a:
                row["direct"] = _fmt(a["direct_accuracy"], True)
                row["share of latent's lead kept by constant latents"] = (
                    "-" if a.get("kept_share") is None else
                    f"{a['kept_share']:.2f}" + (" [{:.2f}, {:.2f}]".format(*a["kept_share_ci"]) if a.get("kept_share_ci") else ""))
                row["latents carry the gain"] = "yes" if a.get("latents_carry_gain") else "no"
            rows.append(row)
        lines += ["", "### What the latents carry", "",
                  "Constant-latent ablation: every latent input replaced by the mean latent input (paired bootstrap "
                  "over problems); the latents carry the gain when constant latents keep at most half of latent's "
                  "lead over direct.", "", *_markdown_table(pd.DataFrame(rows))]
    if probe:
        rows = []
        for split, p in probe.items():
            if not isinstance(p, dict):
                continue
            readers = [("majority class", p["majority"]), ("linear probe", p["linear"]),
                       *[(f"logit lens, {k.replace('_', ' ')}", v) for k, v in p["lens"].items()]]
            for name, b in readers:
                rows.append({"split": split, "blocks": p["blocks"], "reader": name, "all": _fmt(b["all"], True),
                             "copy": _fmt(b["copy"], True), "computed": _fmt(b["computed"], True)})
        lines += ["", f"Latent probe: is the value the previous line assigned decodable from the block standing for "
                      f"its frame (every text token teacher-forced; linear probe fit on {probe['train_blocks']} train "
                      "blocks; positions: 0 = latent_start, then each latent)?", "", *_markdown_table(pd.DataFrame(rows))]
    for split, text in (diagnoses or {}).items():
        lines += ["", f"Diagnosis ({split}): {text}."]
    return lines


def write_probe_plot(probe: dict[str, Any] | None, plots: Path, why_none: str = "") -> None:
    """PROBE_PNG: per held-out split, accuracy by LINE frame index of the majority class, the linear probe and the
    logit lens's best position; without a probe, a figure that says why (`why_none`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = [s for s, p in (probe or {}).items() if isinstance(p, dict)]
    if not splits:
        fig, ax = plt.subplots(figsize=(6, 1.6))
        ax.axis("off")
        ax.text(0.5, 0.5, f"no latent probe: {why_none or 'no block held an assigned value'}", ha="center", va="center")
        with atomic_path(plots / PROBE_PNG) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
        return
    fig, axes = plt.subplots(1, max(1, len(splits)), figsize=(5.5 * max(1, len(splits)), 3.6), squeeze=False)
    for ax, split in zip(axes[0], splits):
        p = probe[split]
        best = max(p["lens"], key=lambda k: p["lens"][k]["all"] or 0)
        for label, b, style in (("majority class", p["majority"], ":"), ("linear probe", p["linear"], "-o"),
                                (f"logit lens ({best.replace('_', ' ')})", p["lens"][best], "--s")):
            frames = sorted(b["by_frame"], key=int)
            ax.plot([int(f) for f in frames], [b["by_frame"][f] for f in frames], style, label=label)
        ax.set_ylim(0, 1)
        ax.set_xlabel("LINE frame (1 = first)")
        ax.set_ylabel("value decoded from the block")
        ax.set_title(f"{split}: {p['blocks']} blocks")
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(plots / PROBE_PNG) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
