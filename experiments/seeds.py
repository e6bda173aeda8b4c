"""Seeds as an axis of the experiment tools: seeded experiment names, the spread of a figure over seeds, and one
interval pooled over seeds from the per-problem outcomes.

    python -m experiments.ladder queue copy mix5 --seeds 0 1 2           # ladder-copy-s0 ... with -S codi.seed=<seed>
    python -m experiments.ladder queue --default --seeds 0 1 2 3 4 --prefix r5-base --set codi.max_steps=3200
    python -m experiments.ladder collect --prefix r5-base --head --out docs/r5.json   # rows gain seed_group, seed
    python -m experiments.ladder report --data docs/r5.json --seeds-json docs/r5_seeds.json   # + the seed table

    from experiments.seeds import seed_summary, pooled_interval, split_seed
    split_seed("r5-base-s3")                 # ("r5-base", 3); split_seed("ladder-copy") -> ("ladder-copy", None)
    summary = seed_summary(rows, predictions_reader(ROOT))   # {group: {split: {figure: spread, "pooled": ...}}}

A seeded experiment is named `<name>-s<seed>` and sets every seed key to the seed; the experiments of one name
without the suffix (its seed group) differ in their seeds only. One seed's accuracy on the 270-odd test problems
moves 3-6 points with the seed alone (docs/RESULTS.md, the ablation), so a change is read from the spread over
seeds (mean, sd, the worst seed) and from the pooled interval: a percentile bootstrap over problems in which a
drawn problem brings its outcomes in every seed (each seed decodes the same test problems), the statistic being
the mean over seeds of the accuracy (of latent / explicit per seed for retention). It is paired across seeds and
across modes; over one seed it is the evaluate stage's own interval (codi.evaluation.metrics.bootstrap_intervals).

The per-problem outcomes are the evaluate stage's predictions (data/eval/predictions.parquet: one row per example
and mode with its split, source, problem_id and correct). It is a DVC output, so an experiment's git ref holds only
its md5 (dvc.lock, stages.evaluate.outs); the file is read from the DVC cache. Where it is missing (another
machine, `dvc gc`) the pooled interval is None, with the reason, and the spread is still given.
"""

from __future__ import annotations

import hashlib
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from codi.evaluation.metrics import Bootstrap, _interval
from codi.infra.config import ConfigError, params_from_dict, read_yaml, set_dotted

ROOT = Path(__file__).resolve().parents[1]
# codi's seed: the codi stage alone retrains, the sft models (and the data) stay the committed ones. Add
# `sft.seed sft_direct.seed` for a change that retrains sft too, or the spread leaves out the sft seed's share.
DEFAULT_SEED_KEYS = ("codi.seed",)
PREDICTIONS = "data/eval/predictions.parquet"  # the evaluate stage's per-example outcomes (dvc.yaml)
SUFFIX = re.compile(r"(?P<group>.+)-s(?P<seed>0|[1-9][0-9]*)")  # canonical numbers only: -s01 is no seed
# a ladder row's figures: each mode's accuracy, the latent-vs-explicit ratios, what the latents carry
FIGURES = ("explicit", "latent", "direct", "retention", "compression", "speedup", "constant_latents", "kept_share")
POOLED_MODES = ("explicit", "latent", "direct")  # the modes the predictions hold (constant latents are not written)


# ------------------------------------------------------------------------------------------ names
def seeded_name(name: str, seed: int | None) -> str:
    """`<name>-s<seed>`; `name` itself without a seed."""
    return name if seed is None else f"{name}-s{seed}"


def split_seed(name: str) -> tuple[str, int | None]:
    """(seed group, seed) of an experiment name: ("r5-base", 3) for "r5-base-s3", (name, None) without a suffix."""
    m = SUFFIX.fullmatch(name)
    return (m["group"], int(m["seed"])) if m else (name, None)


def seed_overrides(seed_keys: Sequence[str], seed: int | None) -> dict[str, int]:
    """The `-S` overrides of one seed: every seed key set to it ({} without a seed)."""
    return {} if seed is None else {key: seed for key in seed_keys}


def check_seeds(seeds: Sequence[int], seed_keys: Sequence[str], params: dict[str, Any],
                extra: Mapping[str, Any] | None = None) -> None:
    """ConfigError unless each seed is given once and is >= 0, every seed key is a params key that takes every
    seed (the params file with it set is valid), and no `--set` override sets a seed key too; checked before
    anything is queued."""
    if len(set(seeds)) != len(seeds) or any(seed < 0 for seed in seeds):  # -s-1 would name no seed
        raise ConfigError(f"--seeds {' '.join(map(str, seeds))}: each seed once, a whole number >= 0")
    if not seed_keys:
        raise ConfigError("--seed-keys: name at least one params key")
    clash = [key for key in seed_keys if key in (extra or {})]
    if clash:
        raise ConfigError(f"--set {clash[0]}: a seed key; --seeds sets it")
    for key in seed_keys:
        for seed in seeds:
            try:
                params_from_dict(set_dotted(params, {key: seed}), source=f"--seed-keys {key} = {seed}")
            except KeyError:
                raise ConfigError(f"--seed-keys {key}: not a params key (params.yaml)") from None


# ------------------------------------------------------------------------------------------ spread over seeds
def spread(values: Mapping[str, float]) -> dict[str, Any]:
    """Mean, sample sd (ddof=1; None for one seed), min (the worst seed of an accuracy), max and n_seeds of
    {seed: value}, with every seed's value."""
    xs = list(values.values())
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else None,
            "min": min(xs), "max": max(xs), "n_seeds": len(xs), "seeds": dict(values)}


def seed_key(row: Mapping[str, Any]) -> str:
    """A row's key in its group's {seed: value}: the seed as text, or the experiment's name where it has none."""
    seed = _seed_of(row)[1]
    return row["experiment"] if seed is None else str(seed)


def _seed_of(row: Mapping[str, Any]) -> tuple[str, int | None]:
    if "seed_group" in row:
        return row["seed_group"], row.get("seed")
    return split_seed(row["experiment"])  # rows collected before seeds were an axis


def group_rows(rows: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """{seed group: its rows by seed}, groups in the rows' order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_seed_of(row)[0], []).append(row)
    for members in groups.values():
        members.sort(key=lambda r: (_seed_of(r)[1] is None, _seed_of(r)[1] or 0, r["experiment"]))
    return groups


# ------------------------------------------------------------------------------------------ pooled interval
def outcomes(predictions: pd.DataFrame, split: str, source: str) -> pd.DataFrame:
    """The (mode, problem_id, correct) rows of one split and source of an evaluation's predictions."""
    pick = (predictions["split"] == split) & (predictions["source"] == source)
    return predictions.loc[pick, ["mode", "problem_id", "correct"]].reset_index(drop=True)


def pooled_interval(by_seed: Mapping[str, pd.DataFrame], boot: Bootstrap) -> dict[str, Any]:
    """The pooled paired bootstrap over problems of {seed: (mode, problem_id, correct) rows}: every resample
    draws problems with replacement and takes each drawn problem's rows in every seed and mode; the statistic is
    the mean over seeds of each mode's accuracy, and of latent / explicit (retention) per seed. {mode or
    "retention": [point, lo, hi], n_problems, n_seeds, resamples, bootstrap_seed, level}. ValueError when the
    seeds' problems differ (they must have decoded the same split) or no mode is in every seed."""
    if not by_seed:
        raise ValueError("no seeds")
    problem_sets = {seed: frozenset(t["problem_id"]) for seed, t in by_seed.items()}
    problems = sorted(next(iter(problem_sets.values())))
    if not problems:
        raise ValueError("no problems of this split and source in the predictions")
    if any(p != frozenset(problems) for p in problem_sets.values()):
        raise ValueError("the seeds did not decode the same problems")
    modes = [m for m in POOLED_MODES if all((t["mode"] == m).any() for t in by_seed.values())]
    if not modes:
        raise ValueError("no mode in every seed")
    # the draws of codi.evaluation.metrics.bootstrap_intervals (same problems order, same generator): over one
    # seed the pooled interval is the evaluate stage's own
    draws = np.random.default_rng(boot.seed).integers(0, len(problems), size=(boot.samples, len(problems)))
    pos = {p: k for k, p in enumerate(problems)}
    point: dict[str, list[float]] = {m: [] for m in modes}
    resampled: dict[str, list[np.ndarray]] = {m: [] for m in modes}
    for table in by_seed.values():
        for mode in modes:
            g = table[table["mode"] == mode]
            k = g["problem_id"].map(pos).to_numpy()
            correct = g["correct"].astype(float).to_numpy()
            count = np.bincount(k, minlength=len(problems))[draws].sum(1)
            with np.errstate(invalid="ignore", divide="ignore"):
                resampled[mode].append(np.bincount(k, weights=correct, minlength=len(problems))[draws].sum(1) / count)
            point[mode].append(float(correct.mean()))
    out: dict[str, Any] = {"n_problems": len(problems), "n_seeds": len(by_seed), "resamples": boot.samples,
                           "bootstrap_seed": boot.seed, "level": boot.level}
    for mode in modes:
        out[mode] = [float(np.mean(point[mode])), *(_interval(np.mean(resampled[mode], axis=0), boot.level)
                                                   or [None, None])]
    if "explicit" in modes and "latent" in modes:
        with np.errstate(invalid="ignore", divide="ignore"):  # a resample with explicit at 0: NaN, left out
            per_seed = [lat / e for lat, e in zip(resampled["latent"], resampled["explicit"])]
        ratios = [lat / e for lat, e in zip(point["latent"], point["explicit"]) if e]
        out["retention"] = [float(np.mean(ratios)) if len(ratios) == len(by_seed) else None,
                            *(_interval(np.mean(per_seed, axis=0), boot.level) or [None, None])]
    return out


def evaluation_bootstrap(params_path: Path = ROOT / "params.yaml") -> Bootstrap:
    """The evaluate stage's bootstrap (evaluate.bootstrap_samples, bootstrap_seed, ci_level of `params_path`), so
    the pooled interval is drawn as each experiment's own."""
    ev = read_yaml(params_path)["evaluate"]
    return Bootstrap(int(ev["bootstrap_samples"]), int(ev["bootstrap_seed"]), float(ev["ci_level"]))


# ------------------------------------------------------------------------------------------ summary
PredictionsReader = Callable[[Mapping[str, Any]], "pd.DataFrame | None"]


def seed_summary(rows: Sequence[dict[str, Any]], predictions: PredictionsReader | None = None,
                 boot: Bootstrap | None = None, source: str = "synthetic") -> dict[str, Any]:
    """Per seed group of the ladder rows (`collect`): the experiments, seeds and rung, and per split (val, test)
    each figure's spread over the seeds (`spread`, from the rows) and `pooled`: the pooled interval
    (`pooled_interval`) of the predictions that `predictions(row)` returns (None: not found), or None with
    `pooled_unavailable` saying why. `boot`: default the evaluate stage's (`evaluation_bootstrap`). The pooled
    interval is over `source`'s problems of the split, as the rows' figures are (the ladder's one source)."""
    boot = boot or evaluation_bootstrap()
    tables: dict[str, pd.DataFrame | None] = {}

    def table(row: Mapping[str, Any]) -> pd.DataFrame | None:
        if row["experiment"] not in tables:  # read once, used per split
            tables[row["experiment"]] = predictions(row) if predictions else None
        return tables[row["experiment"]]

    out: dict[str, Any] = {}
    for group, members in group_rows(rows).items():
        entry: dict[str, Any] = {"experiments": [r["experiment"] for r in members],
                                 "seeds": [_seed_of(r)[1] for r in members], "n_seeds": len(members),
                                 "rung": members[0].get("rung")}
        for split in ("val", "test"):
            if not any(r.get(split) for r in members):
                continue
            figures: dict[str, Any] = {}
            for fig in FIGURES:
                values = {seed_key(r): r[split][fig][0] for r in members
                          if (r.get(split) or {}).get(fig) and r[split][fig][0] is not None}
                if values:
                    figures[fig] = spread(values)
            missing = [r["experiment"] for r in members if table(r) is None]
            if missing:
                figures["pooled"] = None
                figures["pooled_unavailable"] = (f"no predictions for {', '.join(missing)} (no md5 collected, or "
                                                 f"{PREDICTIONS} not in the DVC cache or unreadable)")
            else:
                try:
                    figures["pooled"] = pooled_interval(
                        {seed_key(r): outcomes(t, split, source) for r in members if (t := table(r)) is not None}, boot)
                except (ValueError, KeyError) as e:  # KeyError: a predictions file without a column we read
                    figures["pooled"] = None
                    figures["pooled_unavailable"] = f"{split}: {e}"
            entry[split] = figures
        out[group] = entry
    return out


# ------------------------------------------------------------------------------------------ predictions on disk
def predictions_md5(lock: Mapping[str, Any]) -> str | None:
    """The md5 of the evaluate stage's predictions in a dvc.lock, or None."""
    for out in (((lock or {}).get("stages") or {}).get("evaluate") or {}).get("outs") or []:
        if out.get("path") == PREDICTIONS:
            return out.get("md5")
    return None


def dvc_cache_dir(root: Path = ROOT) -> Path:
    """The repository's DVC cache: `[cache] dir` of .dvc/config.local or .dvc/config (relative to .dvc/), else
    .dvc/cache; read here because the tools never run `dvc`."""
    for name in ("config.local", "config"):
        path = root / ".dvc" / name
        section = ""
        for line in path.read_text().splitlines() if path.is_file() else []:
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]").strip()
            elif section == "cache" and line.partition("=")[0].strip() == "dir":
                return (root / ".dvc" / line.partition("=")[2].strip().strip("'\"")).resolve()
    return root / ".dvc" / "cache"


def cached_file(md5: str, root: Path = ROOT) -> Path | None:
    """The file of `md5` in the DVC cache (DVC 3: files/md5/ab/cdef..., DVC 2: ab/cdef...), or the workspace's
    predictions if they have that md5 (the committed default's), or None."""
    cache = dvc_cache_dir(root)
    for path in (cache / "files" / "md5" / md5[:2] / md5[2:], cache / md5[:2] / md5[2:]):
        if path.is_file():
            return path
    here = root / PREDICTIONS
    if here.is_file() and hashlib.md5(here.read_bytes()).hexdigest() == md5:  # noqa: S324 - DVC's content hash
        return here
    return None


def predictions_reader(root: Path = ROOT) -> PredictionsReader:
    """A reader for `seed_summary`: a row's predictions (by its `predictions_md5`) from `root`'s DVC cache, or
    None where the row has no md5 or the cache lacks the file."""
    def read(row: Mapping[str, Any]) -> pd.DataFrame | None:
        path = cached_file(row["predictions_md5"], root) if row.get("predictions_md5") else None
        if path is None:
            return None
        try:
            return pd.read_parquet(path, columns=["mode", "split", "source", "problem_id", "correct"])
        except (OSError, ValueError, KeyError):  # a damaged file or another layout: no interval, never a crash
            return None
    return read


# ------------------------------------------------------------------------------------------ report
def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _cell(s: dict[str, Any] | None, pooled: list | None, percent: bool) -> str:
    """`mean ± sd (min..max) [pooled lo, hi]`: accuracies in % (sd in points), ratios as they are."""
    if not s:
        return "-"
    f = (lambda v: f"{100 * v:.1f}") if percent else (lambda v: f"{v:.2f}")  # noqa: E731
    text = f"{f(s['mean'])}{'%' if percent else ''}" + (f" ± {f(s['sd'])}" if s["sd"] is not None else "")
    text += f" ({f(s['min'])}..{f(s['max'])})"
    if pooled and pooled[1] is not None:
        text += f" [{f(pooled[1])}, {f(pooled[2])}]"
    return text


def seed_table(summary: dict[str, Any], split: str = "test") -> str:
    """Markdown: per seed group of more than one seed, latent accuracy, retention, constant latents and direct as
    `mean ± sd (min..max) [pooled interval]` with n seeds, then one line per group with every seed's latent."""
    head = ["group", "seeds", "latent", "retention", "constant latents", "direct", "pooled over"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    per_seed = []
    for group, entry in summary.items():
        s = entry.get(split)
        if entry["n_seeds"] < 2 or not s:
            continue
        pooled = s.get("pooled") or {}
        over = f"{pooled['n_problems']} problems" if pooled else "unavailable"
        lines.append("| " + " | ".join([
            group, str(entry["n_seeds"]), _cell(s.get("latent"), pooled.get("latent"), True),
            _cell(s.get("retention"), pooled.get("retention"), False), _cell(s.get("constant_latents"), None, True),
            _cell(s.get("direct"), pooled.get("direct"), True), over]) + " |")
        latent = (s.get("latent") or {}).get("seeds", {})
        per_seed.append(f"- {group} latent per seed: "
                        + (", ".join(f"{'s' + k if k.isdigit() else k} {_pct(v)}" for k, v in latent.items()) or "-")
                        + ("" if pooled else f" (pooled interval unavailable: {s.get('pooled_unavailable')})"))
    return "\n".join(lines + [""] + per_seed)


def has_seeds(summary: dict[str, Any]) -> bool:
    """Whether any group holds more than one seed (the report's seed table is then printed)."""
    return any(entry["n_seeds"] > 1 for entry in summary.values())


# ------------------------------------------------------------------------------------------ curves
# The codi stage's curves that tell a slow draw from a fast one (dvclive/codi/plots/metrics/<kind>/<name>.tsv):
# the value CE and value KD in training, the latent decoder's accuracy on val at each evaluation.
CURVES = ("train/value_loss", "train/value_kd_loss", "train/kd_loss", "eval/latent_accuracy", "eval/value_loss")


def parse_tsv(text: str) -> list[list[float]]:
    """A dvclive plot file (`step<TAB>value` with a header) as [[step, value], ...]."""
    rows = [line.split("\t") for line in text.strip().splitlines()[1:] if line.strip()]
    return [[float(step), float(value)] for step, value in rows]


def curve_at(curves: Mapping[str, list[list[float]]], name: str, step: float) -> float | None:
    """The value of curve `name` at the last logged step <= `step` (None if none is)."""
    points = [v for s, v in curves.get(name, []) if s <= step]
    return points[-1] if points else None


def plot_seed_curves(rows: Sequence[dict[str, Any]], path: Path, names: Sequence[str] = CURVES[:2] + CURVES[3:4]
                     ) -> None:
    """One panel per curve (`names`), one line per experiment (its seed group's colour, one shade per seed): the
    codi runs' training curves side by side, to see whether draws differ in speed or in where they land."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from codi.infra.files import atomic_path

    rows = [r for r in rows if r.get("curves")]
    groups = sorted({r["seed_group"] for r in rows})
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.0))
    for ax, name in zip(np.atleast_1d(axes), names):
        for r in rows:
            pts = r["curves"].get(name) or []
            if not pts:
                continue
            # one group: a colour per seed; several: a colour per group, the seeds in one style each
            seed = r.get("seed") or 0
            colour = cmap(seed % 10) if len(groups) == 1 else cmap(groups.index(r["seed_group"]) % 10)
            style = "-" if len(groups) == 1 else ("-", "--", ":", "-.")[seed % 4]
            label = f"{r['seed_group']} s{r['seed']}" if r.get("seed") is not None else r["experiment"]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colour, alpha=0.8, lw=1.1, label=label,
                    marker="o" if name.startswith("eval/") else None, ms=3)
        ax.set_title(name)
        ax.set_xlabel("codi step")
        if "loss" in name:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[-1].legend(fontsize=6, ncol=2, loc="lower right")
    fig.suptitle("codi training curves per seed")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
