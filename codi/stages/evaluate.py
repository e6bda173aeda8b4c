"""Stage `evaluate`: explicit-trace vs latent vs no-trace decoding on held-out problems.

    python -m codi evaluate [--sft models/sft --codi models/codi --direct models/sft_direct]

For each example of the configured splits (default: test), each mode decodes greedily with a KV
cache (codi.decoding): `explicit` = the sft model writes the whole trace, `latent` = the codi model
writes the trace with a latent block in place of every LINE frame's locals, `direct` = the
sft_direct baseline writes only the answer. With `evaluate.constrain_actions` (default) the
explicit and latent decoders write each action as one of the program's lines (codi.decoding: the
model picks the line; it cannot misspell it). Scores (codi.metrics): output accuracy, trace fidelity,
positions and time per example; retention, compression and speedup of latent over explicit.

Writes `metrics/eval.json` (compact, DVC metrics: `dvc exp show`), `metrics/eval_by_source.json`,
`metrics/eval.md` (the table, also printed), `data/eval/predictions.parquet` (one row per example per
mode) and `plots/eval/` (csv for `dvc plots`, PNGs for people).
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from codi.config import ConfigError, Params
from codi.data import CacheDataset
from codi.metrics import score_example, summarize
from codi.training import set_threads, write_json
from codi.tracing.format import parse_trace

MODE_MODEL = {"explicit": "sft", "latent": "codi", "direct": "sft_direct"}
SUMMARY_KEYS = ("n", "output_accuracy", "trace_exact_match", "action_accuracy", "locals_accuracy",
                "mean_positions", "mean_time_s")


def load_examples(cache_dir: Path, splits: list[str], limit: int) -> list[dict[str, Any]]:
    rows = []
    for split in splits:
        ds = CacheDataset(cache_dir / f"{split}.arrow", limit=limit)
        answers, traces, programs = ds.column("answer"), ds.column("trace_text"), ds.column("program")
        for k in range(len(ds)):
            ex = ds[k]
            rows.append({"split": split, "id": ex["sample_id"], "source": ex["source"], "program": programs[k],
                         "prompt_ids": ex["prompt_ids"], "truth": answers[k], "frames": parse_trace(traces[k])})
    return rows


def load_mode_model(mode: str, paths: dict[str, Path]):
    """(model, tokenizer, projector, latent_steps) for a mode; a missing folder is a clear error."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = paths[MODE_MODEL[mode]]
    if not (path / "config.json").is_file():
        raise ConfigError(f"evaluate.modes includes {mode!r}, but {path} holds no model (run its stage first)")
    if mode == "latent":
        from codi.modeling import load_codi_model
        loaded = load_codi_model(path, dtype=torch.float32)
        return loaded.model, loaded.tokenizer, loaded.projector, loaded.config.latent_steps
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path), None, 0


def run(params: Params, cache_dir: Path, sft: Path, codi: Path, direct: Path, metrics_dir: Path,
        predictions: Path, plots: Path) -> int:
    from codi.decoding import iter_decode, program_action_lines

    cfg = params.evaluate
    set_threads(cfg.torch_threads)
    examples = load_examples(cache_dir, cfg.splits, cfg.max_examples)
    if not examples:
        raise ConfigError(f"evaluate.splits = {cfg.splits}: no examples in {cache_dir} for these splits")
    paths = {"sft": sft, "codi": codi, "sft_direct": direct}
    rows, generated = [], []
    for mode in cfg.modes:
        model, tok, projector, latent_steps = load_mode_model(mode, paths)
        t0 = time.time()
        lines = ([program_action_lines(tok, e["program"]) for e in examples]
                 if cfg.constrain_actions and mode != "direct" else None)
        results = list(iter_decode(mode, model, tok, [e["prompt_ids"] for e in examples], projector=projector,
                                   latent_steps=latent_steps or 1, max_new_tokens=cfg.max_new_tokens,
                                   max_frames=cfg.max_frames, batch_size=cfg.batch_size, progress=True,
                                   action_lines=lines))
        for ex, res in zip(examples, results):
            row = score_example(res, ex["frames"], truth=ex["truth"], source=ex["source"], example_id=ex["id"])
            row["split"] = ex["split"]
            rows.append(row)
            generated.append(res.text)
        acc = sum(r["correct"] for r in rows[-len(examples):]) / len(examples)
        print(f"evaluate {mode}: {len(examples)} examples in {time.time() - t0:.1f}s, output accuracy {acc:.3f}")

    overall, per_source = summarize(rows)
    write_json(metrics_dir / "eval.json", compact(overall))
    write_json(metrics_dir / "eval_by_source.json", {s: compact(v) for s, v in per_source.items()})
    write_predictions(rows, generated, predictions)
    write_plots(overall, per_source, plots)
    report = markdown_report(overall, per_source, cfg.splits)
    (metrics_dir / "eval.md").write_text(report)
    print(report)
    return 0


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
