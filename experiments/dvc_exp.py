"""`dvc exp run` in one place: the `-S key=value` text of a params value, the command that runs or queues an
experiment, and an experiment's files read back from its git ref.

    set_args({"gamma": 2.0, "extract.synthetic.operators": ["max", "min"]})
        # ["-S", "gamma=2.0", "-S", "extract.synthetic.operators=[max, min]"]
    exp_run_args({"gamma": 2.0}, name="g2", queue=True)   # ["exp", "run", "--queue", "-n", "g2", "-S", "gamma=2.0"]
    run_exp({"gamma": 2.0}, name="g2", queue=True)        # the same through `dvc` on PATH
    experiment_refs("ladder")                            # {"ladder-copy": "refs/exps/.../ladder-copy", ...}
    read_at(ref, "metrics/eval.json")                    # a JSON or YAML file as the experiment committed it

A value is written as YAML flow text, the way DVC reads `-S` values back (YAML 1.2): a string that YAML would
read as something else ("a: b", "true", "1e-3") is quoted, so what DVC sets is exactly the value asked for.
pipelines/dvc.py runs the same commands under Prefect, streamed and retried.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from codi.infra.config import yaml_value

ROOT = Path(__file__).resolve().parents[1]


def format_value(value: Any) -> str:
    """`value` as the text after `key=` in `dvc exp run -S key=value`: YAML flow style, read back equal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()
    if yaml_value(text) != value:  # PyYAML quotes by YAML 1.1 rules; DVC reads 1.2 ("1e-3" is a float there)
        text = json.dumps(value)   # JSON is YAML: double-quoted strings read back as strings
    return text


def set_args(overrides: Mapping[str, Any]) -> list[str]:
    """`-S key=value` arguments of `dvc exp run` for `overrides` (dotted params keys)."""
    args: list[str] = []
    for key, value in overrides.items():
        args += ["-S", f"{key}={format_value(value)}"]
    return args


def exp_run_args(overrides: Mapping[str, Any], name: str, queue: bool = False, temp: bool = False) -> list[str]:
    """The arguments after `dvc` of one experiment: run now (in the workspace, or `temp`: in a temporary copy) or
    `queue` it for `dvc queue start`."""
    if queue and temp:
        raise ValueError("an experiment is queued or run in a temporary copy, not both")
    mode = ["--queue"] if queue else ["--temp"] if temp else []
    return ["exp", "run", *mode, "-n", name, *set_args(overrides)]


def run_exp(overrides: Mapping[str, Any], name: str, queue: bool = False, cwd: Path = ROOT) -> None:
    """Run (or queue) one experiment with the `dvc` on PATH; a failure raises CalledProcessError."""
    subprocess.run(["dvc", *exp_run_args(overrides, name, queue=queue)], cwd=cwd, check=True)


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def experiment_refs(prefix: str, cwd: Path = ROOT) -> dict[str, str]:
    """{experiment name: git ref} of the local dvc experiments whose name starts with `prefix-`."""
    refs = _git("for-each-ref", "--format=%(refname)", "refs/exps", cwd=cwd).split()
    return {ref.rsplit("/", 1)[1]: ref for ref in refs if ref.rsplit("/", 1)[1].startswith(f"{prefix}-")}


def read_at(ref: str, path: str, cwd: Path = ROOT) -> Any:
    """File `path` (JSON, or YAML for .yaml) as committed at `ref`; CalledProcessError if it is not there."""
    text = _git("show", f"{ref}:{path}", cwd=cwd)
    return yaml.safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
