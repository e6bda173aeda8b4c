"""FSDP (`<stage>.strategy: fsdp`) against DDP on 2 CPU processes (gloo): the same loss curve and final weights
(to 1e-5) for sft and codi, the same final folder format, and a kill -9 under FSDP resuming to the same weights.
A damaged checkpoint, DDP's or FSDP's, stops the stage with one `error:` line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from codi.training.checkpoints import checkpoint_step
from tests.integration.test_training_procs import ENV, kill_after_first_checkpoint, stage_cmd
from tests.tiny import prepared_workspace, write_params

TOL = 1e-5


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return prepared_workspace(
        tmp_path_factory.mktemp("fsdp"),
        sft={"max_steps": 6, "save_steps": 2, "eval_steps": 3, "logging_steps": 1, "save_total_limit": 0},
        codi={"max_steps": 4, "save_steps": 2, "eval_steps": 2, "logging_steps": 1, "val_accuracy_samples": 2,
              "save_total_limit": 0})


def params_file(ws: Path, name: str, stage: str, **changes) -> str:
    params = yaml.safe_load((ws / "params.yaml").read_text())
    params[stage].update(changes)
    write_params(ws / name, params)
    return name


def run_stage(ws: Path, stage: str, out: str, params: str = "params.yaml",
              expect: int = 0) -> subprocess.CompletedProcess:
    cmd = [c if c != "params.yaml" else params for c in stage_cmd(stage, out, f"ck/{out}")]
    proc = subprocess.run([sys.executable, *cmd], cwd=ws, env=ENV, capture_output=True, text=True, timeout=400)
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def start_model(ws: Path) -> None:
    if not (ws / "models/sft").exists():
        run_stage(ws, "sft", "models/sft")


def log_history(ck: Path) -> list[dict]:
    last = max(ck.glob("checkpoint-*"), key=checkpoint_step)
    return json.loads((last / "trainer_state.json").read_text())["log_history"]


def curve(history: list[dict], key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in history if key in h}


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    return out


def assert_close_weights(a: Path, b: Path, tol: float = TOL) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    worst = max((ta[k] - tb[k]).abs().max().item() for k in ta)
    assert worst <= tol, f"largest weight difference {worst:.3g} > {tol}"


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "codi"])
def test_fsdp_trains_what_ddp_trains(ws, stage):
    """2 processes, the same global batch: the loss curve (every step) and the final weights agree to 1e-5, and
    the final folder is DDP's: the same files, the same config, loadable by from_pretrained."""
    if stage == "codi":
        start_model(ws)
    ddp = params_file(ws, f"{stage}-ddp.yaml", stage, cpu_processes=2, strategy="ddp")
    fsdp = params_file(ws, f"{stage}-fsdp.yaml", stage, cpu_processes=2, strategy="fsdp")
    run_stage(ws, stage, f"{stage}-ddp", ddp)
    proc = run_stage(ws, stage, f"{stage}-fsdp", fsdp)
    assert "FSDP2:" in proc.stdout and "sharded over 2 processes" in proc.stdout
    h_ddp, h_fsdp = log_history(ws / f"ck/{stage}-ddp"), log_history(ws / f"ck/{stage}-fsdp")
    for key in ("loss", "eval_loss"):
        a, b = curve(h_ddp, key), curve(h_fsdp, key)
        assert a and a.keys() == b.keys(), key
        assert all(abs(a[s] - b[s]) <= TOL for s in a), f"{key}: DDP {a} vs FSDP {b}"
    assert_close_weights(ws / f"{stage}-ddp", ws / f"{stage}-fsdp")
    files = lambda p: sorted(f.name for f in p.iterdir())  # noqa: E731
    assert files(ws / f"{stage}-ddp") == files(ws / f"{stage}-fsdp")
    assert (ws / f"{stage}-ddp/config.json").read_text() == (ws / f"{stage}-fsdp/config.json").read_text()
    # the checkpoints are sharded: one .distcp file per process, no full model file
    ckpt = ws / f"ck/{stage}-fsdp/checkpoint-2"
    assert len(list((ckpt / "sharded").glob("*.distcp"))) == 2 and not list(ckpt.glob("*.safetensors"))
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(ws / f"{stage}-fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "codi"])
def test_kill_9_under_fsdp_then_rerun_equals_an_uninterrupted_run(ws, stage):
    if stage == "codi":
        start_model(ws)
    fsdp = params_file(ws, f"{stage}-fsdp-kill.yaml", stage, cpu_processes=2, strategy="fsdp")
    run_stage(ws, stage, f"{stage}-fsdp-ref", fsdp)
    out = f"{stage}-fsdp-kill"
    cmd = [c if c != "params.yaml" else fsdp for c in stage_cmd(stage, out, f"ck/{out}")]
    step = kill_after_first_checkpoint(ws, cmd, ws / f"ck/{out}")
    assert not (ws / out).exists()
    proc = run_stage(ws, stage, out, fsdp)
    assert "resuming from" in proc.stdout, proc.stdout[-2000:]
    a, b = tensors(ws / f"{stage}-fsdp-ref"), tensors(ws / out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), f"resumed from step {step}: different weights"


def damage(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("strategy, victim", [
    ("fsdp", "sharded/__1_0.distcp"),                   # the default suite's one FSDP run (~50 s with the fixture)
    pytest.param("fsdp", "sharded/.metadata", marks=pytest.mark.slow),
    pytest.param("ddp", "model.safetensors", marks=pytest.mark.slow)])
def test_a_damaged_checkpoint_is_one_error_line_and_exit_2(ws, strategy, victim):
    """A checkpoint saved whole (trainer_state.json present) with a file cut short: no traceback, no resume from
    an older checkpoint, one `error:` line naming the file and what to delete."""
    name = f"sft-{strategy}"
    params = params_file(ws, f"{name}.yaml", "sft", cpu_processes=2, strategy=strategy)
    ck = ws / f"ck/{name}"
    if not ck.exists():
        run_stage(ws, "sft", name, params)
    last = max(ck.glob("checkpoint-*"), key=checkpoint_step)  # the one a rerun resumes from
    backup = (last / victim).read_bytes()
    damage(last / victim)
    try:
        proc = run_stage(ws, "sft", name, params, expect=2)
    finally:
        (last / victim).write_bytes(backup)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert str(Path(victim).name) in errors[0] and f"delete ck/{name} to restart the sft stage" in errors[0]
