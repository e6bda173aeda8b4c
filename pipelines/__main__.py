"""Command line of the Prefect orchestration.

    $ python -m pipelines run [--repo PATH] [--retries N] [--retry-delay S] [--stage-timeout S]
    $ python -m pipelines experiments gamma=0.5,1,2 [codi.lr=1e-4,3e-4] [--repo PATH] [--timeout S]
    $ python -m pipelines serve [--cron "0 3 * * *"] [--repo PATH]

`run` and `experiments` are one flow run each, in this process. With PREFECT_API_URL set they are recorded by
that server (about 3 s of overhead); without it Prefect starts a temporary server (about 20 s; the first time
on an empty PREFECT_HOME, up to a minute). The same pipeline runs without Prefect at all: `dvc repro`.
The user guide: docs/ORCHESTRATION.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from codi.infra.config import ConfigError


def parse_value(text: str) -> Any:
    """A grid value from the command line: int, float, true/false, null, else the string itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none", "~"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """["gamma=0.5,1", "beta=2"] -> {"gamma": [0.5, 1], "beta": [2]}."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"bad override {item!r}: expected KEY=V1[,V2...], e.g. gamma=0.5,1,2")
        if key in grid:
            raise ValueError(f"override {key!r} given twice: put all its values in one KEY=V1,V2")
        grid[key] = [parse_value(v) for v in values.split(",")]
    return grid


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one pipeline flow run now (all DVC stages in DAG order)")
    run.add_argument("--repo", default=".", help="project root (holds dvc.yaml); default: the current directory")
    run.add_argument("--retries", type=int, help="retries of a transient stage failure (default: params.yaml)")
    run.add_argument("--retry-delay", type=float, help="seconds before a retry (default: params.yaml)")
    run.add_argument("--stage-timeout", type=float, help="kill a stage running longer than this (seconds)")
    exp = sub.add_parser("experiments", help="a grid of DVC experiments and one comparison table")
    exp.add_argument("overrides", nargs="+", metavar="KEY=V1,V2", help="params key and its values, e.g. gamma=0.5,1,2")
    exp.add_argument("--repo", default=".", help="project root (holds dvc.yaml); default: the current directory")
    exp.add_argument("--metrics-file", default="metrics/eval.json", help="metrics file whose values are compared")
    exp.add_argument("--timeout", type=float, help="kill an experiment running longer than this (seconds)")
    srv = sub.add_parser("serve", help="serve both flows as deployments (pipeline on a cron schedule)")
    srv.add_argument("--repo", default=".", help="project root (holds dvc.yaml); default: the current directory")
    srv.add_argument("--cron", help="schedule of the pipeline deployment (default: params.yaml pipeline.cron)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            from pipelines.serve import serve

            serve(args.repo, args.cron)
            return 0
        from pipelines import flows

        if args.command == "run":
            summary = flows.pipeline(repo=args.repo, retries=args.retries, retry_delay_s=args.retry_delay,
                                     stage_timeout_s=args.stage_timeout)
            ran = [s["stage"] for s in summary["stages"] if s["status"] == "ran"]
            print(f"pipeline done: {len(summary['stages'])} stages, ran {ran or 'none (all up to date)'}; "
                  f"artifacts: {summary['artifacts']}")
        else:
            rows = flows.experiments(grid=parse_grid(args.overrides), repo=args.repo,
                                     metrics_file=args.metrics_file, timeout_s=args.timeout)
            for row in rows:
                print("  ".join(f"{k}={v}" for k, v in row.items()))
        return 0
    except (ValueError, ConfigError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
