"""A training stage runs without dvclive or wandb when their logging is off (a GPU machine without them), says
so, and stops with a clear error naming the switch when a target is on but its package is missing."""

from __future__ import annotations

import sys

import pytest

from codi.infra.config import UserError
from codi.schemas.wandb import WandbConfig
from codi.training.tracking import LiveMetrics, NoLiveMetrics, setup_wandb


def absent(monkeypatch, name: str) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # `import name` fails; find_spec says absent


def test_dvclive_off_writes_nothing_and_says_so(monkeypatch, tmp_path, capsys):
    absent(monkeypatch, "dvclive")
    monkeypatch.setenv("CODI_DVCLIVE", "off")
    cb = LiveMetrics(tmp_path / "live", resume_step=None)
    assert isinstance(cb, NoLiveMetrics) and not (tmp_path / "live").exists()
    assert "dvclive is off (CODI_DVCLIVE=off" in capsys.readouterr().err


def test_dvclive_on_but_missing_names_the_switch(monkeypatch, tmp_path):
    absent(monkeypatch, "dvclive")
    monkeypatch.delenv("CODI_DVCLIVE", raising=False)
    with pytest.raises(UserError, match="CODI_DVCLIVE=off"):
        LiveMetrics(tmp_path / "live", resume_step=None)


def test_a_bad_dvclive_switch_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("CODI_DVCLIVE", "maybe")
    with pytest.raises(UserError, match="CODI_DVCLIVE='maybe': expected on or off"):
        LiveMetrics(tmp_path / "live", resume_step=None)


def test_dvclive_on_logs(monkeypatch, tmp_path):
    monkeypatch.delenv("CODI_DVCLIVE", raising=False)  # dvclive is a dependency of the project: always there
    cb = LiveMetrics(tmp_path / "live", resume_step=None)
    assert type(cb) is LiveMetrics and cb.live is not None


def test_wandb_disabled_needs_no_wandb_and_says_why(monkeypatch, capsys):
    absent(monkeypatch, "wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = WandbConfig(mode="disabled", project="p", entity="")
    assert setup_wandb(cfg, "sft", {}, True) == []
    assert "wandb is off (params wandb.mode = disabled)" in capsys.readouterr().err
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert setup_wandb(WandbConfig(mode="offline", project="p", entity=""), "codi", {}, True) == []
    assert "WANDB_MODE=disabled in the environment" in capsys.readouterr().err


def test_wandb_on_but_missing_names_the_switch(monkeypatch):
    absent(monkeypatch, "wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(UserError, match="wandb.mode: disabled"):
        setup_wandb(WandbConfig(mode="offline", project="p", entity=""), "sft", {}, True)
