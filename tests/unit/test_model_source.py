"""Where `model.base` comes from, and what makes a result from it stale or unreproducible (codi.modeling.base_model)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from codi.modeling.base_model import check_model_source, is_pinned_revision, source_warnings
from tests.tiny import shipped


def model_cfg(**kw):
    return dataclasses.replace(shipped("model"), **kw)


def test_the_tiny_default_has_nothing_to_warn_about():
    assert source_warnings(model_cfg(base="tiny")) == []


def test_a_local_folder_under_base_models_is_tracked_and_one_elsewhere_is_warned_about(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for folder in ("base_models/mine", "elsewhere/mine"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert source_warnings(model_cfg(base="base_models/mine")) == []
    assert source_warnings(model_cfg(base=str(tmp_path / "base_models/mine"))) == []
    [warning] = source_warnings(model_cfg(base="elsewhere/mine"))
    assert "outside base_models/" in warning and "will NOT rerun precompute" in warning
    check_model_source(model_cfg(base="elsewhere/mine"))  # loads: a warning, not an error
    assert "WARNING: model.base = 'elsewhere/mine' is outside base_models/" in capsys.readouterr().out


def test_a_hub_id_without_a_commit_sha_is_warned_about():
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert is_pinned_revision(sha) and not is_pinned_revision("main") and not is_pinned_revision(sha[:12])
    [warning] = source_warnings(model_cfg(base="Qwen/Qwen2.5-Coder-0.5B", revision="main"))
    assert "model.revision = 'main' is NOT pinned" in warning
    assert source_warnings(model_cfg(base="Qwen/Qwen2.5-Coder-0.5B", revision=sha)) == []


def test_the_shipped_dvc_yaml_makes_base_models_a_dependency_of_precompute():
    import yaml

    from tests.tiny import ROOT

    deps = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["precompute"]["deps"]
    assert "base_models" in deps and (ROOT / "base_models/README.md").is_file()


@pytest.mark.parametrize("base", ["base_models/missing"])
def test_a_missing_local_folder_is_still_an_error(tmp_path, monkeypatch, base):
    from codi.infra.config import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="no such model folder"):
        check_model_source(model_cfg(base=base))
