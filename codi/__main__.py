"""The library's command line: `python -m codi <command>` (also the `codi` console script); every DVC stage
runs through it. The research tools (`python -m experiments.<tool>`) and the Prefect flows (`python -m pipelines`)
have command lines of their own.

    python -m codi extract | precompute | sft | sft_direct | codi | evaluate     # the DVC stages
    python -m codi trace --source mbpp --path data/raw/mbpp.jsonl --out /tmp/mbpp.parquet
    python -m codi params                                                     # every key, its value and doc
    python -m codi kernels                    # the CPU kernels torch runs here (kernels.cpu), and their ops md5

Arguments are paths only: every hyperparameter comes from params.yaml, so `dvc exp run -S` is the one override.
The whole file is checked before any work; a stage then gets the sections its `run` declares (its params
dataclass). An error a user can fix prints one line, `error: ...`, and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codi.infra.config import UserError, describe, get_dotted, load_params, sections, to_dict
from codi.infra.kernels import pin_cpu_kernels

# No command reaches the network unless asked to; a user's own setting wins.
OFFLINE_ENV = {"DVC_NO_ANALYTICS": "1", "DVC_STUDIO_OFFLINE": "true", "HF_HUB_DISABLE_TELEMETRY": "1",
               "WANDB_SILENT": "true"}


@dataclass(frozen=True)
class Command:
    """A command: the function that runs it ("module:function", imported only then) and its path options."""

    target: str
    help: str
    paths: dict[str, str] = field(default_factory=dict)   # --option: default path
    fixed: dict[str, Any] = field(default_factory=dict)   # keyword arguments of the function
    relaunchable: bool = False                            # a training stage: it gets argv to relaunch itself as DDP workers


def _train_paths(stage: str, start: str, start_default: str) -> dict[str, str]:
    return {"--cache": "data/cache", start: start_default, "--out": f"models/{stage}",
            "--checkpoints": f"checkpoints/{stage}", "--metrics": f"metrics/{stage}.json", "--plots": f"plots/{stage}",
            "--live": f"dvclive/{stage}"}


# The stages' import closures are separate: nothing here imports a stage module (codi.infra.provenance reads this).
COMMANDS: dict[str, Command] = {
    "extract": Command("codi.stages.extract:run", "trace every configured source in the sandbox",
                       {"--out": "data/traces", "--metrics": "metrics/extract.json",
                        "--checkpoints": "checkpoints/extract"}),
    "trace": Command("codi.stages.extract:trace_file", "trace one dataset file with the extract stage's code and limits"),
    "kernels": Command("codi.stages.kernels_check:run", "the CPU kernels torch computes with here, against the reference"),
    "precompute": Command("codi.stages.precompute:run", "tokenizer + base model, spans, split caches",
                          {"--traces": "data/traces", "--cache": "data/cache", "--base-out": "models/base",
                           "--metrics": "metrics/precompute.json"}),
    "sft": Command("codi.stages.sft:run", "stage 1: fine-tune on prompt + explicit trace",
                   _train_paths("sft", "--base", "models/base"), {"stage": "sft"}, relaunchable=True),
    "sft_direct": Command("codi.stages.sft:run", "the no-trace baseline: prompt -> answer",
                          _train_paths("sft_direct", "--base", "models/base"), {"stage": "sft_direct"}, relaunchable=True),
    "codi": Command("codi.stages.codi_stage:run", "stage 2b: CODI self-distillation into latent frames",
                    _train_paths("codi", "--sft", "models/sft"), relaunchable=True),
    "evaluate": Command("codi.stages.evaluate:run", "explicit vs latent vs no-trace decoding on held-out problems",
                        {"--cache": "data/cache", "--sft": "models/sft", "--codi": "models/codi",
                         "--direct": "models/sft_direct", "--metrics": "metrics",
                         "--predictions": "data/eval/predictions.parquet", "--plots": "plots/eval"}),
}


def stage_module(command: str) -> str:
    """The module that runs `command` (what codi.infra.provenance follows for its code)."""
    return COMMANDS[command].target.partition(":")[0]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="codi", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default: params.yaml)")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help)
        for option, default in cmd.paths.items():
            p.add_argument(option, type=Path, default=Path(default), help=f"default: {default}")
    trace = sub.choices["trace"]
    trace.add_argument("--source", required=True, help="source format: synthetic, humaneval, mbpp, pyx, cruxeval")
    trace.add_argument("--path", default=None, help="dataset file or hf:<id>[:<split>] (default: params extract.paths)")
    trace.add_argument("--out", type=Path, required=True, help="output parquet file")
    sub.add_parser("params", help="validate params.yaml and list every key with its value")
    return ap


def main(argv: list[str] | None = None) -> int:
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    try:
        params = load_params(args.params)
        if args.command == "params":
            values = to_dict(params)
            for key, tp, doc in describe(type(params)):
                print(f"{key} = {get_dotted(values, key)!r}  ({tp}) {doc}")
            return 0
        # Before the stage module (and so torch) is imported: the libraries read the pins once, at their first
        # op, and every process this one starts (CPU data-parallel workers) inherits them.
        pin_cpu_kernels(params.kernels.cpu)
        cmd = COMMANDS[args.command]
        module, _, function = cmd.target.partition(":")
        run = getattr(importlib.import_module(module), function)
        kwargs = {k: v for k, v in vars(args).items() if k not in ("params", "command")}
        kwargs.update(cmd.fixed)
        if cmd.relaunchable:
            kwargs["argv"] = argv
        return run(sections(params, typing.get_type_hints(run)["params"]), **kwargs) or 0
    except (UserError, FileNotFoundError) as e:  # params, a dataset line, a file or folder: the user can fix it
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
