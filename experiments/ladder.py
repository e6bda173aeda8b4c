"""The task ladder: named rungs of the synthetic task, each one `dvc exp` of the whole pipeline.

    python -m experiments.ladder list                           # the rungs (configs/ladder.yaml) and their overrides
    python -m experiments.ladder queue copy maxmin ...          # dvc exp run --queue -n ladder-<rung> -S ... per rung
    python -m experiments.ladder queue chain5 --set sft.max_steps=7200 --prefix budget   # the same with more overrides
    dvc queue start -j 1                                 # one experiment at a time on a small machine
    python -m experiments.ladder collect --head --out docs/ladder.json   # the finished ladder-* experiments + HEAD
    python -m experiments.ladder report --data docs/ladder.json --plot plots/ladder.png   # markdown table + plot
    python -m experiments.ladder report --data docs/r5.json --curves plots/r5_curves.png  # codi curves per seed

Seeds (experiments/seeds.py): `--seeds` queues one experiment per rung and seed, `<prefix>-<rung>-s<seed>`, each
with every `--seed-keys` key set to the seed (default `codi.seed`: enough for a change to codi alone, whose sft
models stay the committed ones; add `sft.seed sft_direct.seed` where the change retrains sft too). `--default`
queues the committed default itself (no rung) once per seed, named `<prefix>-s<seed>` (with rungs named too, those
as well):

    python -m experiments.ladder queue copy mix5 --seeds 0 1 2          # ladder-copy-s0 .. ladder-mix5-s2
    python -m experiments.ladder queue mix5 --seeds 0 1 --seed-keys codi.seed sft.seed sft_direct.seed
    python -m experiments.ladder queue --default --seeds 0 1 2 3 4 --prefix r5-base --set codi.max_steps=3200
    python -m experiments.ladder collect --prefix r5-base --out docs/r5.json
    python -m experiments.ladder report --data docs/r5.json --seeds-json docs/r5_seeds.json

`collect` gives each row its `seed_group` (the name without `-s<N>`), `seed` (N or None) and the md5 of its
predictions (dvc.lock); `report` adds, where a group holds several seeds, the seed table: mean ± sd (worst..best
seed) and the interval pooled over seeds and problems (experiments/seeds.py says how it is drawn).

A rung is a set of `params.yaml` overrides (dotted keys, as `dvc exp run -S` takes them), nearly always of
`extract.synthetic`: the operations per line, the dependent steps per call, the value range. Everything else
stays at the committed default, so a rung's row measures the task, not the recipe. `collect` reads each
experiment's committed outputs from its git ref (refs/exps/...): the per-split evaluation
(metrics/eval_by_split.json: chosen on val, reported on test) and the task's size (metrics/precompute.json).
The rungs and what they measured: docs/RESULTS.md, "Research III".
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from codi.infra.config import ConfigError, flatten, params_from_dict, read_yaml, set_dotted, yaml_value
from codi.schemas.modes import MODES
from experiments.dvc_exp import exp_run_args, experiment_refs, read_at, set_args
from experiments.seeds import (
    CURVES,
    DEFAULT_SEED_KEYS,
    check_seeds,
    group_rows,
    has_seeds,
    parse_tsv,
    plot_seed_curves,
    predictions_md5,
    predictions_reader,
    seed_overrides,
    seed_summary,
    seed_table,
    seeded_name,
    split_seed,
)

ROOT = Path(__file__).resolve().parents[1]
RUNGS_FILE = ROOT / "configs" / "ladder.yaml"
SOURCE = "synthetic"  # the ladder is a ladder of the synthetic task


@dataclass(frozen=True)
class Rung:
    """One rung: its name, what it asks of the model, and the params it sets."""

    name: str
    doc: str
    overrides: dict[str, Any]


def load_rungs(path: Path = RUNGS_FILE, params_path: Path = ROOT / "params.yaml") -> list[Rung]:
    """The rungs of `path`, in order; each rung's overrides must make a valid params file (checked here, so a
    typo fails before anything is queued)."""
    raw = read_yaml(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("rungs"), list):
        raise ConfigError(f"{path}: expected a mapping with a list `rungs`")
    params = read_yaml(params_path)
    rungs, seen = [], set()
    for k, item in enumerate(raw["rungs"]):
        where = f"{path}: rungs[{k}]"
        if not isinstance(item, dict) or set(item) != {"name", "doc", "set"}:
            raise ConfigError(f"{where}: expected exactly the keys name, doc, set")
        name, doc, overrides = item["name"], item["doc"], item["set"]
        if not isinstance(name, str) or not name.replace("-", "").replace("_", "").isalnum() or name in seen:
            raise ConfigError(f"{where}: name {name!r}: expected a new name of letters, digits, - and _")
        if not isinstance(overrides, dict):
            raise ConfigError(f"{where} ({name}): set: expected a mapping of dotted params keys")
        try:
            params_from_dict(set_dotted(params, overrides), source=f"{path} rung {name}")
        except KeyError as e:
            raise ConfigError(f"{where} ({name}): set: unknown params key {e.args[0]}") from None
        seen.add(name)
        rungs.append(Rung(name, " ".join(str(doc).split()), dict(overrides)))
    return rungs


def experiment_name(prefix: str, rung: Rung | None, seed: int | None = None) -> str:
    """`<prefix>-<rung>`, `<prefix>` for the committed default (rung None); `-s<seed>` after it with a seed."""
    return seeded_name(prefix if rung is None else f"{prefix}-{rung.name}", seed)


def queue_command(rung: Rung | None, extra: dict[str, Any], prefix: str = "ladder", seed: int | None = None,
                  seed_keys: Sequence[str] = DEFAULT_SEED_KEYS) -> list[str]:
    """`dvc exp run --queue -n <name> -S ...` (`experiment_name`): the rung's overrides (none for the committed
    default, rung None), then `extra`, then with `seed` every seed key set to it."""
    overrides = {**(rung.overrides if rung else {}), **extra, **seed_overrides(seed_keys, seed)}
    return ["dvc", *exp_run_args(overrides, experiment_name(prefix, rung, seed), queue=True)]


def queue_commands(rungs: list[Rung | None], extra: dict[str, Any], prefix: str = "ladder",
                   seeds: list[int] | None = None, seed_keys: Sequence[str] = DEFAULT_SEED_KEYS,
                   params_path: Path = ROOT / "params.yaml") -> list[list[str]]:
    """Every command of one `queue`: per rung (None: the committed default), one per seed (or one without
    `seeds`); the seeds and seed keys are checked against `params_path` first (check_seeds), so nothing is
    queued when a key is wrong."""
    if seeds:
        check_seeds(seeds, seed_keys, read_yaml(params_path), extra)
    return [queue_command(rung, extra, prefix, seed, seed_keys) for rung in rungs for seed in (seeds or [None])]


# ------------------------------------------------------------------------------------------ results
def rung_row(name: str, params: dict[str, Any], by_split: dict[str, Any], precompute: dict[str, Any],
             timings: dict[str, float], base_params: dict[str, Any], evaluation: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """One experiment's ladder row: its params diff against `base_params`, per split (val, test) each mode's
    synthetic accuracy with its interval and the latent-vs-explicit ratios, and the task's size per call; with
    `evaluation` (metrics/eval.json), per split what the latents carry (codi.evaluation.probe): the constant-latent
    ablation
    (accuracy with interval, the share of latent's lead over direct it keeps, whether the latents carry the gain)
    and the probe (majority class, linear probe overall / copy / computed). Over all sources of the split."""
    flat, base = flatten(params), flatten(base_params)
    row: dict[str, Any] = {"experiment": name,
                           "params_diff": {k: v for k, v in flat.items() if base.get(k) != v and k in base}}
    for split in ("val", "test"):
        s = by_split.get(split, {}).get(SOURCE)
        if not s:
            continue
        out: dict[str, Any] = {}
        for mode in MODES:
            if isinstance(s.get(mode), dict):
                m = s[mode]
                out[mode] = [m["output_accuracy"], m.get("output_accuracy_lo"), m.get("output_accuracy_hi"), m["n"]]
        for ratio in ("retention", "compression", "speedup"):
            if s.get(ratio) is not None:
                out[ratio] = [s[ratio], s.get(f"{ratio}_lo"), s.get(f"{ratio}_hi")]
        ablation = (evaluation or {}).get("latent_ablation", {}).get(split)
        if ablation:
            out["constant_latents"] = [ablation["ablated_accuracy"], *(ablation.get("ablated_accuracy_ci") or [None, None])]
            out["kept_share"] = [ablation.get("kept_share"), *(ablation.get("kept_share_ci") or [None, None])]
            out["latents_carry_gain"] = ablation.get("latents_carry_gain")
        probe = (evaluation or {}).get("latent_probe", {}).get(split)
        if probe:
            out["probe"] = {"blocks": probe["blocks"], "majority": probe["majority"]["all"],
                            **{f"linear_{k}": probe["linear"][k] for k in ("all", "copy", "computed")},
                            "lens_best": max(v["all"] or 0 for v in probe["lens"].values())}
        row[split] = out
    latent = (evaluation or {}).get("latent") or {}
    if latent.get("first_error") is not None:  # where the wrong latent answers first left the true trace (all splits)
        row["latent_first_error"] = dict(latent["first_error"])
        row["latent_n"] = latent.get("n")
    size = precompute.get("tokens_by_source", {}).get(SOURCE, {})
    row["line_frames"] = size.get("mean_line_frames")
    row["computed_values"] = size.get("mean_computed_values")
    row["tokens"] = size.get("mean_total")
    row["seconds"] = timings
    return row


def rung_of(params: dict[str, Any], rungs: list[Rung]) -> str | None:
    """The first rung whose every override `params` holds, or None: which rung an experiment ran."""
    flat = flatten(params)
    for rung in rungs:
        if all(flat.get(key) == value for key, value in rung.overrides.items()):
            return rung.name
    return None


def _git_show(ref: str, path: str, cwd: Path) -> str:
    """File `path` as committed at `ref`, as text; CalledProcessError if it is not there."""
    return subprocess.run(["git", "show", f"{ref}:{path}"], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _lock_at(ref: str, cwd: Path) -> dict[str, Any]:
    """dvc.lock as committed at `ref` (YAML; read_at reads .yaml and JSON only)."""
    return yaml.safe_load(_git_show(ref, "dvc.lock", cwd)) or {}


def collect(prefix: str = "ladder", cwd: Path = ROOT, head: bool = False,
            rungs: list[Rung] | None = None) -> list[dict[str, Any]]:
    """The rows of every finished `prefix-*` experiment, and with `head` the committed default's (git HEAD,
    named `main`), each with the rung it ran, its seed group and seed (`-s<N>`: experiments.seeds.split_seed) and
    its predictions' md5 (dvc.lock; None if not there); in ladder order (`rungs`), then by group and seed."""
    base_params = read_yaml(cwd / "params.yaml")
    refs = sorted(experiment_refs(prefix, cwd).items())
    if head:
        refs.append(("main", "HEAD"))
    rungs = load_rungs() if rungs is None else rungs
    rows = []
    for name, ref in refs:
        timings = {}
        for stage in ("sft", "sft_direct", "codi"):
            try:
                timings[stage] = read_at(ref, f"metrics/{stage}.json", cwd).get("train_runtime_s")
            except subprocess.CalledProcessError:
                pass
        try:  # what the latents carry: written by evaluate since research IV
            evaluation = read_at(ref, "metrics/eval.json", cwd)
        except subprocess.CalledProcessError:
            evaluation = None
        try:  # the per-problem outcomes are a DVC output: the ref holds their md5, the DVC cache the file
            md5 = predictions_md5(_lock_at(ref, cwd))
        except subprocess.CalledProcessError:
            md5 = None
        curves = {}
        for name_ in CURVES:  # the codi stage's curves, committed with the experiment (dvclive plots)
            try:
                curves[name_] = parse_tsv(_git_show(ref, f"dvclive/codi/plots/metrics/{name_}.tsv", cwd))
            except subprocess.CalledProcessError:
                pass
        params = read_at(ref, "params.yaml", cwd)
        row = rung_row(name, params, read_at(ref, "metrics/eval_by_split.json", cwd),
                       read_at(ref, "metrics/precompute.json", cwd), timings, base_params, evaluation)
        group, seed = split_seed(name)
        rows.append(row | {"rung": rung_of(params, rungs), "seed_group": group, "seed": seed, "predictions_md5": md5,
                           "curves": curves})
    order = {r.name: k for k, r in enumerate(rungs)}
    # by group, then seed as a number (s2 before s10); a row without a seed is its own group, sorted by its name
    return sorted(rows, key=lambda r: (order.get(r["rung"], len(order)), r["seed_group"], r["seed"] or 0))


# ------------------------------------------------------------------------------------------ report
def _acc(cell: list | None) -> str:
    if not cell:
        return "-"
    value, lo, hi = cell[:3]
    return f"{100 * value:.1f}%" + (f" [{100 * lo:.1f}, {100 * hi:.1f}]" if lo is not None else "")


def _ratio(cell: list | None, unit: str = "") -> str:
    if not cell:
        return "-"
    value, lo, hi = cell
    return f"{value:.2f}{unit}" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None else "")


def markdown_table(rows: list[dict[str, Any]], split: str = "test") -> str:
    """The ladder table on `split`: per experiment the three modes' synthetic accuracy with 95% intervals,
    retention and compression, the task's size (LINE frames, computed values, tokens per example), and the
    params diff beyond the task (the rung's own knobs, `extract.synthetic.*`, are named by the rung)."""
    head = ["experiment", "rung", *MODES, "retention", "compression", "line frames/call",
            "computed values/call", "tokens/ex", "sft s", "other params diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = r.get(split, {})
        cells = [r["experiment"], r.get("rung") or "-", *(_acc(s.get(m)) for m in MODES), _ratio(s.get("retention")),
                 _ratio(s.get("compression"), "x"), _num(r["line_frames"]), _num(r["computed_values"]),
                 _num(r["tokens"], 0), _num(r["seconds"].get("sft"), 0), _other_diff(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def carried_table(rows: list[dict[str, Any]], split: str = "test") -> str:
    """What the latents carry on `split` (rows collected since research IV): latent beside constant latents and
    direct, the share of latent's lead the constant keeps (<= 0.5: the latents carry the gain), the probe's
    linear reading of the assigned value (all, copy, computed) against the majority class, and the logit lens's
    best position; all sources of the split."""
    head = ["experiment", "latent", "constant latents", "direct", "lead kept by constant", "latents carry the gain",
            "probe linear (copy / computed)", "majority", "logit lens best", "other params diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = r.get(split, {})
        if "constant_latents" not in s:
            continue
        p = s.get("probe") or {}
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        probe = (f"{pct(p.get('linear_all'))} ({pct(p.get('linear_copy'))} / {pct(p.get('linear_computed'))})"
                 if p else "-")
        cells = [r["experiment"], _acc(s.get("latent")), _acc(s.get("constant_latents")), _acc(s.get("direct")),
                 _ratio(s.get("kept_share")) if s.get("kept_share", [None])[0] is not None else "-",
                 "yes" if s.get("latents_carry_gain") else "no", probe, pct(p.get("majority")),
                 pct(p.get("lens_best")), _other_diff(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _other_diff(row: dict[str, Any]) -> str:
    other = {k: v for k, v in row["params_diff"].items() if not k.startswith("extract.synthetic.")}
    return ", ".join(f"`{k}={v}`" for k, v in other.items()) or "-"


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _label(row: dict[str, Any]) -> str:
    name = row["experiment"].removeprefix("ladder-")
    return name if name == row.get("rung") else f"{name} ({row.get('rung') or 'no rung'})"


def plot(rows: list[dict[str, Any]], path: Path, split: str = "test") -> None:
    """The ladder: each mode's synthetic accuracy per rung on `split`, with its 95% interval as an error bar."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from codi.evaluation.report import PALETTE
    from codi.infra.files import atomic_path

    fig, ax = plt.subplots(figsize=(max(6.5, 1.6 + 1.15 * len(rows)), 4.2))  # wide enough for the title
    width = 0.8 / len(MODES)
    for k, mode in enumerate(MODES):
        xs, ys, err = [], [], [[], []]
        for i, r in enumerate(rows):
            cell = r.get(split, {}).get(mode)
            if not cell:
                continue
            value, lo, hi = cell[:3]
            xs.append(i + (k - (len(MODES) - 1) / 2) * width)
            ys.append(value)
            err[0].append(value - (lo if lo is not None else value))
            err[1].append((hi if hi is not None else value) - value)
        ax.bar(xs, ys, width, yerr=err, capsize=2, color=PALETTE[mode], label=mode, error_kw={"elinewidth": 0.8})
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows], rotation=20, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel(f"output accuracy, synthetic {split}")
    ax.set_title("the task ladder: accuracy per rung (95% bootstrap intervals)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def _parse_set(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value")
        out[key] = yaml_value(value)  # as DVC reads `-S` values (YAML 1.2: 1e-3 is a float)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.ladder", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the rungs and their overrides")
    q = sub.add_parser("queue", help="queue one dvc experiment per rung (and seed)")
    q.add_argument("rungs", nargs="*", help="rung names (default: all; with --default: only those named)")
    q.add_argument("--default", action="store_true",
                   help="queue the committed default (no rung's overrides) too, one per seed: <prefix>-s<seed>")
    q.add_argument("--set", action="append", default=[], help="another override for every rung (key=value)")
    q.add_argument("--prefix", default="ladder", help="experiment names: <prefix>-<rung>[-s<seed>]")
    q.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                   help="one experiment per rung and seed, <prefix>-<rung>-s<seed>, every seed key set to it")
    q.add_argument("--seed-keys", nargs="+", metavar="KEY",
                   help=f"the params keys --seeds sets (default: {' '.join(DEFAULT_SEED_KEYS)}; "
                        "add sft.seed sft_direct.seed where sft retrains too)")
    q.add_argument("--dry-run", action="store_true", help="print the commands only")
    c = sub.add_parser("collect", help="results of the finished experiments as JSON")
    c.add_argument("--prefix", default="ladder")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--head", action="store_true", help="add the committed default (git HEAD) as the row `main`")
    r = sub.add_parser("report", help="markdown table (stdout) and plot from collected results")
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--plot", type=Path)
    r.add_argument("--split", default="test", choices=("val", "test"))
    r.add_argument("--seeds-json", type=Path, help="write the seed summary (experiments.seeds.seed_summary) here")
    r.add_argument("--curves", type=Path, help="plot each experiment's codi training curves (value CE, value KD, "
                   "val latent accuracy) here, a line per seed")
    args = ap.parse_args(argv)
    try:
        if args.command == "list":
            for rung in load_rungs():
                print(f"{rung.name}: {rung.doc}\n    {shlex.join(set_args(rung.overrides))}")
        elif args.command == "queue":
            rungs = {r.name: r for r in load_rungs()}
            unknown = [n for n in args.rungs if n not in rungs]
            if unknown:
                raise ConfigError(f"{RUNGS_FILE}: no rung {unknown[0]!r} (rungs: {', '.join(rungs)})")
            if args.seed_keys and not args.seeds:
                raise ConfigError("--seed-keys: the keys --seeds sets; give --seeds too")
            if args.default and not args.seeds:  # a lone `<prefix>` is no `<prefix>-*` that collect would find
                raise ConfigError("--default: queues the committed default once per seed; give --seeds")
            extra = _parse_set(args.set)
            chosen: list[Rung | None] = [None] if args.default else []
            chosen += [rungs[n] for n in args.rungs or ([] if args.default else list(rungs))]
            cmds = queue_commands(chosen, extra, args.prefix, args.seeds, args.seed_keys or DEFAULT_SEED_KEYS)
            for cmd in cmds:  # every command is built (and its seeds checked) before the first is queued
                print(shlex.join(cmd))  # a shell can run it as printed (flow-style values hold spaces)
                if not args.dry_run:
                    subprocess.run(cmd, cwd=ROOT, check=True)
        elif args.command == "collect":
            rows = collect(args.prefix, head=args.head)
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
            print(f"{len(rows)} experiments -> {args.out}")
        else:
            rows = json.loads(args.data.read_text())
            print(markdown_table(rows, args.split))
            if any("constant_latents" in r.get(args.split, {}) for r in rows):
                print("\nWhat the latents carry:\n")
                print(carried_table(rows, args.split))
            if args.plot:
                plot(rows, args.plot, args.split)
            if args.curves:
                plot_seed_curves(rows, args.curves)
            if args.seeds_json or any(len(members) > 1 for members in group_rows(rows).values()):
                summary = seed_summary(rows, predictions_reader(ROOT), source=SOURCE)
                if has_seeds(summary):
                    print(f"\nSeeds ({args.split}): mean ± sd over seeds (worst..best seed) [the evaluation's bootstrap "
                          "interval, pooled over seeds and problems]:\n")
                    print(seed_table(summary, args.split))
                if args.seeds_json:
                    args.seeds_json.write_text(json.dumps(summary, indent=1) + "\n")
                    print(f"\nseed summary of {len(summary)} groups -> {args.seeds_json}", file=sys.stderr)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
