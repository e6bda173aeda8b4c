"""The compression frontier (research VI): retention against compression, a point per experiment and a line per rung.

    python -m experiments.ladder collect --prefix r6 --head --out docs/research6.json   # the finished r6-* experiments
    python -m experiments.frontier --data docs/research6.json --plot plots/frontier.png  # table (stdout) and plot
    python -m experiments.frontier --data docs/research6.json docs/research5_ramp.json --groups 'r6-*' r5-ramp

Each experiment is a row of `experiments.ladder collect` (its split's retention and compression with their
intervals, the constant-latent ablation, the wall speedup, and where the wrong latent answers first left the true
trace). Rows are grouped by seed group (`<name>-s<seed>`): the table gives each group's mean ± sd over its seeds
and the worst seed; the plot draws every seed as a point and the group means joined by compression, one line per
rung (the committed default's rung, then any other the rows ran). `--groups` keeps the seed groups that match one of
its shell patterns (fnmatch), so that a point measured elsewhere (research V's adopted recipe) joins the curve.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from experiments.seeds import group_rows, predictions_reader, seed_summary, split_seed

TARGET = {"compression": 3.0, "retention": 0.9}  # issue 35's moonshot on the default rung


def _first(cell: list | None) -> float | None:
    return None if not cell else cell[0]


def point(members: list[dict[str, Any]], split: str) -> dict[str, Any]:
    """One seed group's figures on `split`: means, sd and worst seed of retention, the means of the rest."""
    def values(key: str) -> list[float]:
        return [v for m in members if (v := _first(m.get(split, {}).get(key))) is not None]

    ret = values("retention")
    errors: dict[str, int] = defaultdict(int)
    for m in members:
        for kind, count in (m.get("latent_first_error") or {}).items():
            errors[kind] += count
    return {
        "seeds": len(members),
        "experiments": [m["experiment"] for m in members],
        "rung": members[0].get("rung"),
        "params_diff": members[0].get("params_diff", {}),
        "compression": statistics.mean(values("compression")) if values("compression") else None,
        "retention": statistics.mean(ret) if ret else None,
        "retention_sd": statistics.stdev(ret) if len(ret) > 1 else None,
        "retention_worst": min(ret) if ret else None,
        "retention_each": ret,
        "latent": statistics.mean(values("latent")) if values("latent") else None,
        "explicit": statistics.mean(values("explicit")) if values("explicit") else None,
        "direct": statistics.mean(values("direct")) if values("direct") else None,
        "constant_latents": statistics.mean(values("constant_latents")) if values("constant_latents") else None,
        "speedup": statistics.mean(values("speedup")) if values("speedup") else None,
        "carry_gain": all(m.get(split, {}).get("latents_carry_gain") for m in members),
        "first_error": dict(errors),
    }


def pooled_retention(rows: list[dict[str, Any]], split: str = "test", predictions=None) -> dict[str, list | None]:
    """{seed group: [lo, hi]} of its retention's pooled paired interval over seeds (experiments.seeds.pooled_interval:
    problems resampled alike in every seed), from the predictions in the DVC cache; None where they are missing."""
    summary = seed_summary(rows, predictions if predictions is not None else predictions_reader())
    out: dict[str, list | None] = {}
    for group, entry in summary.items():
        pooled = (entry.get(split) or {}).get("pooled") or {}
        cell = pooled.get("retention")
        out[group] = None if not cell or cell[1] is None else [cell[1], cell[2]]
    return out


def frontier(rows: list[dict[str, Any]], split: str = "test",
             pooled: dict[str, list | None] | None = None) -> dict[str, dict[str, Any]]:
    """{seed group: point}, by compression; `pooled` ({group: [lo, hi]}, `pooled_retention`) adds each point's
    pooled interval of retention."""
    points = {g: point(ms, split) | {"retention_ci": (pooled or {}).get(g)} for g, ms in group_rows(rows).items()}
    return dict(sorted(points.items(), key=lambda kv: (kv[1]["compression"] or 0)))


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def markdown(points: dict[str, dict[str, Any]]) -> str:
    lines = ["| point (experiments) | seeds | compression | retention mean ± sd (worst) | pooled 95% CI | latent | "
             "constant latents | direct | speedup | latent errors, first departure (action / value / grammar / none) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for group, p in points.items():
        sd = "" if p["retention_sd"] is None else f" ± {p['retention_sd']:.2f}"
        ret = "-" if p["retention"] is None else f"{p['retention']:.2f}{sd} ({p['retention_worst']:.2f})"
        fe = p["first_error"]
        errors = " / ".join(str(fe.get(k, 0)) for k in ("action", "value", "grammar", "none"))
        comp = "-" if p["compression"] is None else f"{p['compression']:.2f}x"
        speed = "-" if p["speedup"] is None else f"{p['speedup']:.2f}x"
        ci = p.get("retention_ci")
        ci = "-" if not ci else f"[{ci[0]:.2f}, {ci[1]:.2f}]"
        lines.append(f"| {group} ({', '.join(p['experiments'])}) | {p['seeds']} | {comp} | {ret} | {ci} | {_pct(p['latent'])} | "
                     f"{_pct(p['constant_latents'])} | {_pct(p['direct'])} | {speed} | {errors} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], points: dict[str, dict[str, Any]], path: Path, split: str = "test") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_rung: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for group, p in points.items():
        by_rung[p["rung"] or "default"].append(p | {"group": group})
    for rung, ps in by_rung.items():
        ps = [p for p in ps if p["compression"] is not None and p["retention"] is not None]
        ps.sort(key=lambda p: p["compression"])
        line, = ax.plot([p["compression"] for p in ps], [p["retention"] for p in ps], "-", label=f"{rung} (mean)")
        for p in ps:
            ax.scatter([p["compression"]] * len(p["retention_each"]), p["retention_each"], color=line.get_color(),
                       s=18, alpha=0.7)
            ax.annotate(p["group"], (p["compression"], p["retention"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
    ax.axhline(TARGET["retention"], color="grey", ls=":", lw=1)
    ax.axvline(TARGET["compression"], color="grey", ls=":", lw=1)
    ax.set_xlabel(f"compression (explicit / latent positions, {split})")
    ax.set_ylabel(f"retention (latent / explicit accuracy, {split})")
    ax.set_title("The compression frontier: every seed a point")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.frontier", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, nargs="+", required=True, help="collected rows (experiments.ladder collect)")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--split", default="test", choices=("val", "test"))
    ap.add_argument("--groups", nargs="+", metavar="PATTERN",
                    help="keep only the seed groups matching one of these shell patterns (default: every row)")
    args = ap.parse_args(argv)
    rows = [r for path in args.data for r in json.loads(path.read_text())]
    if args.groups:
        rows = [r for r in rows if any(fnmatch.fnmatchcase(split_seed(r["experiment"])[0], g)
                                       for g in args.groups)]
        if not rows:
            ap.error(f"--groups {' '.join(args.groups)}: no row of {', '.join(map(str, args.data))} matches")
    points = frontier(rows, args.split, pooled_retention(rows, args.split))
    print(markdown(points))
    if args.plot:
        plot(rows, points, args.plot, args.split)
        print(f"plot -> {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
