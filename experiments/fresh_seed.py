"""The committed models on a fresh draw of the same task: was the default chosen on the test split by accident?

    python -m experiments.fresh_seed --seed 1 --programs 2500 --out metrics/fresh_seed
        # -> eval.json, eval.md, fresh_seed.json, predictions.parquet (about 5 min)

Draws `--programs` new synthetic programs with the committed `extract.synthetic` params and generator seed
`--seed`, drops every program whose text is in the committed cache (train, val or test), traces the rest in the
sandbox (the extract stage's code and limits), encodes them with the committed models' tokenizer, and runs the
evaluation (codi.evaluation.core) on them as one `test` split. `fresh_seed.json` sets each mode's accuracy on the
fresh draw beside its committed synthetic-test interval (metrics/eval_by_split.json), with the fresh draw's own interval, and says
whether it falls inside. Draw many programs: a draw the size of the test split (270) is as noisy as the committed
one, so each mode's point lands outside the committed interval by chance about one time in six (docs/RESULTS.md:
270 programs gave direct 22.5% on seed 1, 2500 programs of the same seed 18.0%).
Not a DVC stage: a check to run once after the default changes (docs/RESULTS.md, "Research III").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from codi.data.cache import CacheDataset, write_split
from codi.data.cache_build import cache_manifest, encode_rows, usable_traces
from codi.data.traces import trace_samples, write_traces
from codi.evaluation.core import evaluate, load_examples
from codi.evaluation.writer import write_reports
from codi.infra.config import UserError, load_params
from codi.infra.files import write_json
from codi.infra.kernels import check_cpu_kernels, describe_kernels, pin_cpu_kernels
from codi.schemas.modes import MODES
from codi.sources.synthetic import NAME as SYNTHETIC
from codi.sources.synthetic import generate
from codi.tracing.cluster import open_tracer
from codi.tracing.tokens import load_tokenizer


def fresh_samples(params: Any, seed: int, programs: int, seen: set[str]) -> list:
    """The samples of `programs` programs drawn with generator seed `seed`, none of whose text is in `seen`."""
    synth = dataclasses.replace(params.extract.synthetic, seed=seed, n_programs=programs)
    return [s for s in generate(synth) if s.program not in seen]


def committed_programs(cache: Path) -> set[str]:
    out: set[str] = set()
    for split in ("train", "val", "test"):
        if (cache / f"{split}.arrow").is_file():
            out.update(CacheDataset(cache / f"{split}.arrow").column("program"))
    return out


def within(fresh: dict[str, Any], committed: dict[str, Any]) -> dict[str, Any]:
    """A mode's fresh accuracy and interval beside the committed ones; inside = the fresh point in the committed
    interval."""
    value = fresh["output_accuracy"]
    lo, hi = committed.get("output_accuracy_lo"), committed.get("output_accuracy_hi")
    return {"fresh": value, "fresh_lo": fresh.get("output_accuracy_lo"), "fresh_hi": fresh.get("output_accuracy_hi"),
            "committed": committed["output_accuracy"], "committed_lo": lo, "committed_hi": hi,
            "within_interval": lo is not None and lo <= value <= hi}


def run(params_path: Path, seed: int, programs: int, out: Path, cache: Path, models: dict[str, Path],
        committed_metrics: Path) -> dict[str, Any]:
    params = load_params(params_path)
    # the committed models were evaluated under params.yaml's kernels: pinned before torch's first op, as a stage
    pin_cpu_kernels(params.kernels.cpu)
    check_cpu_kernels(params.kernels.cpu)
    print(f"fresh seed: {describe_kernels(params.kernels.cpu)}", flush=True)
    if seed == params.extract.synthetic.seed:
        raise UserError(f"--seed {seed}: the committed generator seed (extract.synthetic.seed); pick another")
    samples = fresh_samples(params, seed, programs, committed_programs(cache))
    if not samples:
        raise UserError(f"seed {seed}: every one of the {programs} programs is in the committed cache {cache}")
    tok = load_tokenizer(models["sft"])
    with tempfile.TemporaryDirectory(prefix="codi-fresh-") as tmp_dir:
        tmp = Path(tmp_dir)
        with open_tracer(params.extract) as tracer:
            rows, _ = trace_samples(tracer, samples, f"trace seed {seed}")
        write_traces(rows, tmp / "traces" / f"{SYNTHETIC}.parquet")
        dropped: dict[str, Counter] = defaultdict(Counter)
        usable = [r | {"split": "test"} for r in usable_traces([tmp / "traces" / f"{SYNTHETIC}.parquet"],
                                                                params.precompute, dropped)]
        by_split = encode_rows(usable, tok, params.precompute, dropped)
        fresh_cache = tmp / "cache"
        fresh_cache.mkdir()
        shas = {s: write_split(r, fresh_cache / f"{s}.arrow") for s, r in by_split.items()}
        write_json(fresh_cache / "manifest.json", cache_manifest(by_split, shas, tok, params.precompute,
                                                                params.model, dropped))
        # accuracies only: the fresh cache has no train split for the latent probe to fit on
        cfg = dataclasses.replace(params.evaluate, splits=["test"], max_examples=0, probe_train_examples=0,
                                  ablate_latents=False)
        result = evaluate(load_examples(fresh_cache, cfg.splits, cfg.max_examples), cfg, models, fresh_cache)
        write_reports(result, cfg, out, out / "predictions.parquet", tmp / "plots")
    fresh = result.by_split["test"][SYNTHETIC]
    committed = json.loads(committed_metrics.read_text())["test"][SYNTHETIC]
    report = {"seed": seed, "programs_drawn": programs, "programs_fresh": len({s.problem_id for s in samples}),
              "examples": fresh["explicit"]["n"] if "explicit" in fresh else None,
              **{m: within(fresh[m], committed[m]) for m in MODES if m in fresh and m in committed}}
    write_json(out / "fresh_seed.json", report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.fresh_seed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, required=True, help="generator seed of the fresh draw (not the committed one)")
    ap.add_argument("--programs", type=int, required=True,
                    help="programs to draw (2500 gives intervals about a third as wide as the 270-problem test split's)")
    ap.add_argument("--out", type=Path, required=True, help="folder for eval.json, eval.md, fresh_seed.json, predictions.parquet")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--cache", type=Path, default=Path("data/cache"))
    ap.add_argument("--committed", type=Path, default=Path("metrics/eval_by_split.json"))
    args = ap.parse_args(argv)
    models = {"sft": Path("models/sft"), "codi": Path("models/codi"), "sft_direct": Path("models/sft_direct")}
    try:
        report = run(args.params, args.seed, args.programs, args.out, args.cache, models, args.committed)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for mode in MODES:
        if mode in report:
            r = report[mode]
            print(f"{mode}: fresh {r['fresh']:.1%} [{r['fresh_lo']:.1%}, {r['fresh_hi']:.1%}], "
                  f"committed {r['committed']:.1%} [{r['committed_lo']:.1%}, {r['committed_hi']:.1%}]: "
                  f"{'within' if r['within_interval'] else 'OUTSIDE'} the interval")
    return 0


if __name__ == "__main__":
    sys.exit(main())
