"""A tiny, fast params set for stage tests: the shipped params.yaml with small sizes and few steps."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from codi.infra.config import read_yaml

ROOT = Path(__file__).resolve().parents[1]

TINY: dict[str, Any] = {
    "extract": {"sources": ["synthetic"], "workers": 2,
                # the general generator (levels 1-2, every template, unbounded values), not the default's task:
                # the stage tests trace loops, lists, strings and dicts too
                "synthetic": {"n_programs": 40, "calls_per_program": 2, "difficulty": 2, "templates": [],
                              "chain_steps": [2, 4], "value_range": [-999, 999], "add_max": 9, "seed": 3}},
    "precompute": {"max_seq_len": 512, "max_frames": 64, "val_fraction": 0.15, "test_fraction": 0.15},
    "model": {"tiny": {"vocab_size": 400, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                       "intermediate_size": 64, "max_position_embeddings": 1024}},
    "sft": {"max_steps": 8, "batch_size": 4, "eval_batch_size": 8, "eval_steps": 4, "save_steps": 4,
            "logging_steps": 2, "lr": 0.003, "cpu_processes": 1},
    "sft_direct": {"max_steps": 6, "batch_size": 4, "eval_batch_size": 8, "eval_steps": 3, "save_steps": 3,
                   "logging_steps": 2, "lr": 0.003, "cpu_processes": 1},
    "codi": {"max_steps": 4, "batch_size": 4, "eval_batch_size": 8, "eval_steps": 2, "save_steps": 2,
             "logging_steps": 1, "val_accuracy_samples": 3, "cpu_processes": 1},
    "evaluate": {"max_examples": 5, "batch_size": 8, "max_new_tokens": 160, "max_frames": 40},
    "wandb": {"mode": "disabled"},
}


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def tiny_params(**overrides: Any) -> dict:
    """The shipped params.yaml merged with TINY and then `overrides` (nested dicts)."""
    return merge(merge(read_yaml(ROOT / "params.yaml"), TINY), overrides)


def write_params(path: Path, params: dict) -> Path:
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def prepared_workspace(ws: Path, **overrides: Any) -> Path:
    """`ws` with tiny params (`overrides` as tiny_params takes them) and the extract and precompute stages run in it:
    the cache and base model the training stages start from."""
    import os

    from codi.__main__ import main

    write_params(ws / "params.yaml", tiny_params(**overrides))
    cwd = os.getcwd()
    os.chdir(ws)
    try:
        assert main(["extract"]) == 0 and main(["precompute"]) == 0
    finally:
        os.chdir(cwd)
    return ws


def shipped(section: str, **overrides: Any) -> Any:
    """A section of the shipped params.yaml as its config dataclass (`"extract.trace"`), fields replaced (a
    mapping such as `"extract.paths"`: keys replaced).

    The config dataclasses have no defaults (params.yaml is the one place a value is set), so a test
    starts from the shipped values and names what it changes."""
    import dataclasses

    from codi.infra.config import load_params

    cfg: Any = load_params(ROOT / "params.yaml")
    for part in section.split("."):
        cfg = getattr(cfg, part)
    return {**cfg, **overrides} if isinstance(cfg, dict) else dataclasses.replace(cfg, **overrides)
