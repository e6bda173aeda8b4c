"""The evaluate stage's wall time in one process against several (`evaluate.processes`), with the figures compared.

    python benchmarks/bench_evaluate.py                            # the committed models and cache, 1 vs 2 processes
    python benchmarks/bench_evaluate.py --processes 1 2 --max-examples 100
    python benchmarks/bench_evaluate.py --baseline 155b3dc --processes 2   # an earlier commit's stage first, as it shipped

`--baseline REV` runs the stage first with the code and params.yaml of git revision REV (a temporary `git worktree`),
on the same models and cache, as the row everything is compared with: the stage before and after a change, in one
run.

Each setting runs the whole stage (`python -m codi evaluate`, as `dvc repro` does: process start, model loads, every
mode's decoding, the ablation, the probe, the reports) on the same models and cache, into a folder of its own, with
params.yaml's `evaluate` section except `processes` (and `max_examples` when given). It prints each setting's wall
time, its ratio to the first setting's, whether every figure it wrote equals the first setting's (the metrics
JSONs and the predictions, leaving out what a clock measured), and the test split's wall speedup as each setting
measured it: with several processes each mode is timed while the other units load the machine. Run it on an
otherwise idle machine: the settings run one after another.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("eval.json", "eval_by_split.json", "eval_by_source.json", "eval_by_difficulty.json")


def without_times(data):
    """A metrics tree without what a clock measured (each mode's time, the wall speedup and its interval)."""
    if isinstance(data, dict):
        return {k: without_times(v) for k, v in data.items() if "time" not in k and not k.startswith("speedup")}
    return [without_times(v) for v in data] if isinstance(data, list) else data


def run_stage(params: dict, processes: int | None, max_examples: int | None, out: Path, code: Path = ROOT) -> float:
    """The stage's wall time (s), its outputs in `out`; `code`: the checkout whose stage runs (on ROOT's models and
    cache); `processes` None keeps params' own."""
    if processes is not None:
        params = {**params, "evaluate": {**params["evaluate"], "processes": processes}}
    if max_examples is not None:
        params["evaluate"]["max_examples"] = max_examples
    out.mkdir(parents=True)
    (out / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    cmd = [sys.executable, "-m", "codi", "--params", str(out / "params.yaml"), "evaluate", "--cache",
           str(ROOT / "data/cache"), "--sft", str(ROOT / "models/sft"), "--codi", str(ROOT / "models/codi"), "--direct",
           str(ROOT / "models/sft_direct"), "--metrics", str(out / "metrics"), "--predictions",
           str(out / "predictions.parquet"), "--plots", str(out / "plots")]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=code, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def figures(out: Path) -> tuple[dict, pd.DataFrame]:
    metrics = {name: without_times(json.loads((out / "metrics" / name).read_text())) for name in METRICS}
    predictions = pd.read_parquet(out / "predictions.parquet")
    return metrics, predictions[[c for c in predictions.columns if "time" not in c]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="settings; the first is the baseline")
    parser.add_argument("--max-examples", type=int, help="examples per split (default: params.yaml's)")
    parser.add_argument("--baseline", metavar="REV", help="first run the stage of this git revision, as it shipped")
    args = parser.parse_args(argv)
    params = yaml.safe_load(args.params.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        if args.baseline:
            tree = Path(tmp) / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.baseline], cwd=ROOT, check=True,
                           capture_output=True)
            try:
                old = yaml.safe_load((tree / "params.yaml").read_text())
                n_old = old["evaluate"].get("processes", 1)
                label = f"{args.baseline} (its params: processes {n_old})"
                print(f"evaluate as of {label} ...", flush=True)
                out = Path(tmp) / "base"
                rows.append((label, out, run_stage(old, None, args.max_examples, out, code=tree), figures(out)))
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        for n in args.processes:
            out = Path(tmp) / f"p{n}"
            print(f"evaluate with evaluate.processes {n} ...", flush=True)
            rows.append((f"this checkout, processes {n}", out, run_stage(params, n, args.max_examples, out), figures(out)))
        base_seconds, (base_metrics, base_predictions) = rows[0][2], rows[0][3]
        print("| stage | wall s | vs the first | every figure equal to the first's | wall speedup "
              "latent vs explicit (test; val) |")
        print("|---|---|---|---|---|")
        for label, out, seconds, (metrics, predictions) in rows:
            same = metrics == base_metrics and predictions.equals(base_predictions)
            by_split = json.loads((out / "metrics" / "eval_by_split.json").read_text())
            speedups = "; ".join(f"{by_split[s]['all'].get('speedup')}x" for s in ("test", "val") if s in by_split)
            print(f"| {label} | {seconds:.1f} | {seconds / base_seconds:.2f}x | {'yes' if same else 'NO'} | {speedups} |")


if __name__ == "__main__":
    main()
