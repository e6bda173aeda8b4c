"""The one entry point: `python -m codi <stage>` (also installed as the `codi` console script).

    python -m codi extract                      # data/traces/<source>.parquet + stats.json
    python -m codi precompute                   # models/base/ + data/cache/
    python -m codi sft | sft_direct | codi      # models/<stage>/ + metrics + plots
    python -m codi evaluate                     # metrics/eval.json, eval.md, predictions, plots
    python -m codi trace --source mbpp --path mbpp.jsonl --out mbpp.parquet
    python -m codi params                       # validate params.yaml and print every key

Arguments are paths only. Every hyperparameter comes from params.yaml (`--params`), so DVC's
`dvc exp run -S key=value` is the one override path; nothing here has a default that could
shadow a param.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from codi.config import ConfigError, load_params


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="codi", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default: params.yaml)")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("extract", help="trace every configured source in the sandbox")
    p.add_argument("--out", type=Path, default=Path("data/traces"), help="output folder")
    p.add_argument("--metrics", type=Path, default=Path("metrics/extract.json"), help="DVC metrics file")

    p = sub.add_parser("trace", help="trace one dataset file with the extract stage's code and limits")
    p.add_argument("--source", required=True, help="source format: synthetic, humaneval, mbpp, pyx, cruxeval")
    p.add_argument("--path", default=None, help="dataset file or hf:<id>[:<split>] (default: params extract.paths)")
    p.add_argument("--out", type=Path, required=True, help="output parquet file")

    p = sub.add_parser("precompute", help="tokenizer + base model, spans, split caches")
    p.add_argument("--traces", type=Path, default=Path("data/traces"))
    p.add_argument("--cache", type=Path, default=Path("data/cache"))
    p.add_argument("--base-out", type=Path, default=Path("models/base"))
    p.add_argument("--metrics", type=Path, default=Path("metrics/precompute.json"), help="DVC metrics file")

    for name, what in (("sft", "stage 1: fine-tune on prompt + explicit trace"),
                       ("sft_direct", "the no-trace baseline: prompt -> answer")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--cache", type=Path, default=Path("data/cache"))
        p.add_argument("--base", type=Path, default=Path("models/base"))
        p.add_argument("--out", type=Path, default=Path("models") / name)
        p.add_argument("--checkpoints", type=Path, default=Path("checkpoints") / name)
        p.add_argument("--metrics", type=Path, default=Path("metrics") / f"{name}.json")
        p.add_argument("--plots", type=Path, default=Path("plots") / name)

    p = sub.add_parser("codi", help="stage 2b: CODI self-distillation into latent frames")
    p.add_argument("--cache", type=Path, default=Path("data/cache"))
    p.add_argument("--sft", type=Path, default=Path("models/sft"))
    p.add_argument("--out", type=Path, default=Path("models/codi"))
    p.add_argument("--checkpoints", type=Path, default=Path("checkpoints/codi"))
    p.add_argument("--metrics", type=Path, default=Path("metrics/codi.json"))
    p.add_argument("--plots", type=Path, default=Path("plots/codi"))

    p = sub.add_parser("evaluate", help="explicit vs latent vs no-trace decoding on held-out problems")
    p.add_argument("--cache", type=Path, default=Path("data/cache"))
    p.add_argument("--sft", type=Path, default=Path("models/sft"))
    p.add_argument("--codi", type=Path, default=Path("models/codi"))
    p.add_argument("--direct", type=Path, default=Path("models/sft_direct"))
    p.add_argument("--metrics", type=Path, default=Path("metrics"))
    p.add_argument("--predictions", type=Path, default=Path("data/eval/predictions.parquet"))
    p.add_argument("--plots", type=Path, default=Path("plots/eval"))

    sub.add_parser("params", help="validate params.yaml and list every key with its value")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        params = load_params(args.params)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _dispatch(args, params, argv) or 0
    except ConfigError as e:  # a value that is only wrong in context (a missing model path, ...)
        print(f"error: {e}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace, params, argv: list[str] | None = None) -> int | None:
    # Imports are per command: `extract` must not pay for torch, `params` for anything.
    if args.command == "params":
        from codi.config import describe, flatten, to_dict
        flat = flatten(to_dict(params))
        for key, tp, doc in describe():
            print(f"{key} = {flat[key]!r}  ({tp}) {doc}")
        return 0
    if args.command == "extract":
        from codi.stages import extract
        return extract.run(params, out_dir=args.out, metrics=args.metrics)
    if args.command == "trace":
        from codi.stages import extract
        return extract.trace_file(params, source=args.source, path=args.path, out=args.out)
    if args.command == "precompute":
        from codi.stages import precompute
        return precompute.run(params, traces_dir=args.traces, cache_dir=args.cache, base_out=args.base_out,
                              metrics=args.metrics)
    if args.command in ("sft", "sft_direct", "codi"):
        from codi.launch import maybe_relaunch
        code = maybe_relaunch(getattr(params, args.command).cpu_processes, sys.argv[1:] if argv is None else argv)
        if code is not None:
            return code
    if args.command in ("sft", "sft_direct"):
        from codi.stages import sft
        return sft.run(params, stage=args.command, cache_dir=args.cache, base=args.base, out=args.out,
                       checkpoints=args.checkpoints, metrics=args.metrics, plots=args.plots)
    if args.command == "codi":
        from codi.stages import codi_stage
        return codi_stage.run(params, cache_dir=args.cache, sft=args.sft, out=args.out,
                              checkpoints=args.checkpoints, metrics=args.metrics, plots=args.plots)
    if args.command == "evaluate":
        from codi.stages import evaluate
        return evaluate.run(params, cache_dir=args.cache, sft=args.sft, codi=args.codi, direct=args.direct,
                            metrics_dir=args.metrics, predictions=args.predictions, plots=args.plots)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
