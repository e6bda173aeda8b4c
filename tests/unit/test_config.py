"""params.yaml <-> codi/schemas/ (codi/schemas/params.py) <-> dvc.yaml cannot drift; bad values fail with the key named."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from codi.__main__ import COMMANDS
from codi.infra.config import ConfigError, describe, load_params, params_from_dict, read_yaml, to_dict
from codi.schemas.params import Params

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def raw() -> dict:
    return read_yaml(ROOT / "params.yaml")


def with_value(raw: dict, dotted: str, value):
    d = copy.deepcopy(raw)
    *path, last = dotted.split(".")
    node = d
    for p in path:
        node = node[p]
    node[last] = value
    return d


def test_shipped_params_load_and_cover_every_key(raw):
    params = load_params(ROOT / "params.yaml")
    assert isinstance(params, Params)
    assert params.alpha == raw["alpha"] and params.codi.latent_steps == raw["codi"]["latent_steps"]
    # every schema key is documented
    assert all(doc for _, _, doc in describe())


@pytest.mark.parametrize("dotted, value, expected", [
    ("sft.lr", -0.001, "sft.lr = -0.001: expected a float > 0"),
    ("sft.lr", "fast", "sft.lr = 'fast': expected a float > 0"),
    ("sft.batch_size", 1.5, "sft.batch_size = 1.5: expected an integer >= 1"),
    ("sft.batch_size", True, "sft.batch_size = True: expected an integer"),
    ("codi.latent_steps", -1, "codi.latent_steps = -1: expected an integer >= 0"),
    ("codi.kd_target", "logits", "codi.kd_target = 'logits': expected one of 'hidden', 'logit'"),
    ("codi.kd_layers", [1, "x"], "codi.kd_layers[1] = 'x': expected an integer"),
    ("extract.sources", ["synthetic", "nope"], "extract.sources = ['synthetic', 'nope']: expected items from"),
    ("extract.sources", [], "expected a non-empty list"),
    ("precompute.max_seq_len", 0, "precompute.max_seq_len = 0: expected an integer >= 1"),
    ("precompute.val_fraction", 0.95, "precompute.val_fraction + precompute.test_fraction"),
    ("model.tiny.num_heads", 5, "model.tiny.hidden_size = 96: expected a multiple of model.tiny.num_heads (5)"),
    ("model.tiny.num_kv_heads", 2, "model.tiny.num_kv_heads = 2: expected a divisor"),
    ("gamma", -1.0, "gamma = -1.0: expected a float >= 0.0"),
    ("extract.skip_bad_lines", "yes", "extract.skip_bad_lines = 'yes': expected true or false"),
    ("extract.executor", "ray", "extract.executor = 'ray': expected one of 'local', 'dask'"),
    ("extract.dask.shard_size", 0, "extract.dask.shard_size = 0: expected an integer >= 1"),
    ("extract.dask.address", 8786, "extract.dask.address = 8786: expected a string"),
])
def test_bad_values_name_the_key(raw, dotted, value, expected):
    with pytest.raises(ConfigError, match=None) as e:
        params_from_dict(with_value(raw, dotted, value), source="params.yaml")
    assert expected in str(e.value)
    assert str(e.value).startswith("params.yaml: ")


def test_unknown_and_missing_keys(raw):
    bad = with_value(raw, "sft.learning_rate", 0.1)
    with pytest.raises(ConfigError, match=r"unknown key sft\.learning_rate"):
        params_from_dict(bad)
    missing = copy.deepcopy(raw)
    del missing["codi"]["kd_temp"]
    with pytest.raises(ConfigError, match=r"missing key codi\.kd_temp"):
        params_from_dict(missing)
    with pytest.raises(ConfigError, match=r"unknown key zeta"):
        params_from_dict({**raw, "zeta": 1.0})


def test_floats_in_exponent_form_are_floats(tmp_path, raw):
    # PyYAML's YAML 1.1 resolver would read 1e-3 as a string; DVC reads it as a number.
    text, n = re.subn(r"(?m)^(sft:\n(?:  .*\n)*?)  lr: [0-9.e-]+\n", r"\1  lr: 2e-3\n", (ROOT / "params.yaml").read_text())
    assert n == 1
    (tmp_path / "params.yaml").write_text(text)
    assert load_params(tmp_path / "params.yaml").sft.lr == pytest.approx(0.002)


def test_yaml_syntax_error_names_the_file(tmp_path):
    (tmp_path / "params.yaml").write_text("alpha: [1,\n")
    with pytest.raises(ConfigError, match="params.yaml: invalid YAML"):
        load_params(tmp_path / "params.yaml")


def test_configs_are_frozen_and_have_no_defaults():
    params = load_params(ROOT / "params.yaml")
    with pytest.raises(Exception):
        params.codi.latent_steps = 3  # type: ignore[misc]
    # params.yaml is the one place a value is set: a dataclass default could only disagree with it
    import dataclasses
    with pytest.raises(TypeError, match="missing"):
        type(params.codi)()
    for cls in (type(params), type(params.extract), type(params.extract.synthetic), type(params.model.tiny)):
        assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   for f in dataclasses.fields(cls)), cls.__name__


def _dvc_stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


# What each stage's results depend on in params (dvc.yaml's `params`; this is the contract).
STAGE_PARAMS = {
    "extract": {"extract"},
    "precompute": {"precompute", "model", "kernels"},
    "sft": {"sft", "kernels"},
    "sft_direct": {"sft_direct", "kernels"},
    "codi": {"alpha", "beta", "gamma", "codi", "kernels"},
    "evaluate": {"evaluate", "kernels"},
}


def test_every_dvc_params_key_exists_and_loads(raw):
    flat = to_dict(load_params(ROOT / "params.yaml"))
    stages = _dvc_stages()
    assert set(stages) == set(STAGE_PARAMS)
    for name, stage in stages.items():
        keys = stage.get("params", [])
        assert set(keys) == STAGE_PARAMS[name], name
        for key in keys:
            node = flat
            for part in key.split("."):
                assert part in node, f"dvc.yaml stage {name}: params key {key} is not in params.yaml"
                node = node[part]


# Sections a stage reads that decide no result: where logs go, and what the wandb run records.
NOT_RESULTS = {"wandb", "model", "sft", "sft_direct"}


def test_each_stage_reads_the_sections_it_depends_on():
    """A stage's `run` declares the sections it reads (a dataclass); its dvc.yaml params are among them, and the
    others only say where logs go (wandb), what a run records (sft logs `model`), or are the sibling training
    section of the shared sft entry point."""
    import dataclasses
    import importlib
    import typing

    for name, keys in STAGE_PARAMS.items():
        module, _, function = COMMANDS[name].target.partition(":")
        view = typing.get_type_hints(getattr(importlib.import_module(module), function))["params"]
        read = {f.name for f in dataclasses.fields(view)}
        assert keys <= read, name
        assert read - keys <= NOT_RESULTS, name


@pytest.mark.parametrize("changes, message", [
    ({"sft.strategy": "fsdp", "sft.lora.r": 8}, "strategy = 'fsdp' with lora.r > 0"),
    ({"codi.strategy": "fsdp", "codi.recon_weight": 0.5}, "codi.strategy = 'fsdp' with recon_weight > 0"),
    ({"codi.strategy": "zero3"}, "codi.strategy"),
])
def test_fsdp_refuses_what_it_cannot_shard(raw, changes, message):
    data = raw
    for dotted, value in changes.items():
        data = with_value(data, dotted, value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        params_from_dict(data, source="params.yaml")
