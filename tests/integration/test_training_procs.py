"""Training stages as separate processes: 2-process gloo DDP, and kill -9 then resume giving the same
final weights as an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from codi.data.cache import CacheDataset
from codi.training.checkpoints import checkpoint_step
from tests.tiny import prepared_workspace, write_params

ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return prepared_workspace(
        tmp_path_factory.mktemp("procs"),
        sft={"max_steps": 40, "save_steps": 4, "eval_steps": 20, "logging_steps": 5, "save_total_limit": 0},
        codi={"max_steps": 12, "save_steps": 3, "eval_steps": 12, "val_accuracy_samples": 0, "save_total_limit": 0})


def stage_cmd(stage: str, out: str, ck: str, extra: tuple[str, ...] = ()) -> list[str]:
    src = {"sft": ["--base", "models/base"], "codi": ["--sft", "models/sft"]}[stage]
    return [*extra, "-m", "codi", "--params", "params.yaml", stage, *src, "--out", out, "--checkpoints", ck,
            "--metrics", f"m/{out}.json", "--plots", f"p/{out}"]


def run(ws: Path, cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *cmd], cwd=ws, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def weights(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def kill_after_first_checkpoint(ws: Path, cmd: list[str], ck: Path, min_step: int = 0) -> int:
    """Run `cmd` and kill -9 its process group once a checkpoint of step >= min_step is complete; its step."""
    proc = subprocess.Popen([sys.executable, *cmd], cwd=ws, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    done: list[int] = []
    while time.time() < deadline and proc.poll() is None:
        done = [checkpoint_step(p) for p in ck.rglob("checkpoint-*")
                if (p / "trainer_state.json").is_file() and checkpoint_step(p) >= min_step]
        if done:
            os.killpg(proc.pid, signal.SIGKILL)  # kill -9, no chance to clean up
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    return max(done)


@pytest.mark.parametrize("stage", ["sft", "codi"])
def test_kill_9_then_rerun_equals_an_uninterrupted_run(ws, stage):
    if stage == "codi" and not (ws / "models/sft").exists():
        run(ws, stage_cmd("sft", "models/sft", "ck/sft-base"))
    run(ws, stage_cmd(stage, f"ref-{stage}", f"ck/ref-{stage}"))
    ck = ws / f"ck/kill-{stage}"
    kill_after_first_checkpoint(ws, stage_cmd(stage, f"kill-{stage}", str(ck)), ck)
    assert not (ws / f"kill-{stage}").exists()  # no final model that looks complete
    proc = run(ws, stage_cmd(stage, f"kill-{stage}", str(ck)))
    assert "resuming from" in proc.stdout
    a, b = weights(ws / f"ref-{stage}"), weights(ws / f"kill-{stage}")
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), "resumed run ended with different weights"
    if stage == "codi":
        from safetensors.torch import load_file
        pa = load_file(str(ws / "ref-codi/thought_projector.safetensors"))
        pb = load_file(str(ws / "kill-codi/thought_projector.safetensors"))
        assert all((pa[k] == pb[k]).all() for k in pa)


@pytest.mark.parametrize("stage, launch", [("sft", "torchrun"), ("codi", "cpu_processes")])
def test_two_process_gloo_ddp(ws, stage, launch):
    """Under torchrun, and by `<stage>.cpu_processes: 2` (the stage starts its own workers)."""
    if stage == "codi" and not (ws / "models/sft").exists():
        run(ws, stage_cmd("sft", "models/sft", "ck/sft-base"))
    if launch == "torchrun":
        cmd = stage_cmd(stage, f"ddp-{stage}", f"ck/ddp-{stage}",
                        ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"))
    else:
        params = yaml.safe_load((ws / "params.yaml").read_text())
        params[stage]["cpu_processes"] = 2
        write_params(ws / "ddp.yaml", params)
        cmd = [c if c != "params.yaml" else "ddp.yaml" for c in stage_cmd(stage, f"ddp-{stage}", f"ck/ddp-{stage}")]
    proc = run(ws, cmd, timeout=400)
    if launch == "cpu_processes":
        assert "launching 2 data-parallel CPU processes" in proc.stdout
    metrics = json.loads((ws / f"m/ddp-{stage}.json").read_text())
    assert metrics["steps"] == (40 if stage == "sft" else 12)
    assert (ws / f"ddp-{stage}" / "model.safetensors").is_file()
    # one summary and one optimizer/precision line: only rank 0 prints and writes outputs
    assert len(re.findall(rf"^{stage}: \d+ steps in", proc.stdout, re.M)) == 1
    assert proc.stdout.count(f"{stage}: optimizer ") == 1


def test_codi_with_a_latent_curriculum_and_its_own_decoder_under_ddp_and_kill_9(ws):
    """The start of a latent curriculum has no latent (the projector and the reconstruction decoder get no
    gradient: DDP must expect that), and a killed run resumes with the auxiliary decoder's weights."""
    if not (ws / "models/sft").exists():
        run(ws, stage_cmd("sft", "models/sft", "ck/sft-base"))
    params = yaml.safe_load((ws / "params.yaml").read_text())
    params["codi"].update(latent_curriculum_frac=0.5, recon_weight=0.5, recon_decoder="copy", kd_norm="teacher_std")
    write_params(ws / "curriculum.yaml", params)
    params["codi"]["cpu_processes"] = 2
    write_params(ws / "curriculum-ddp.yaml", params)

    def cmd(out: str, ck: str, file: str) -> list[str]:
        return [c if c != "params.yaml" else file for c in stage_cmd("codi", out, ck)]

    proc = run(ws, cmd("cur-ddp", "ck/cur-ddp", "curriculum-ddp.yaml"), timeout=400)
    assert "launching 2 data-parallel CPU processes" in proc.stdout
    assert json.loads((ws / "m/cur-ddp.json").read_text())["steps"] == 12
    run(ws, cmd("cur-ref", "ck/cur-ref", "curriculum.yaml"))
    ck = ws / "ck/cur-kill"
    kill_after_first_checkpoint(ws, cmd("cur-kill", str(ck), "curriculum.yaml"), ck)
    assert "resuming from" in run(ws, cmd("cur-kill", str(ck), "curriculum.yaml")).stdout
    a, b = weights(ws / "cur-ref"), weights(ws / "cur-kill")
    assert all((a[k] == b[k]).all() for k in a), "resumed run ended with different weights"


@pytest.mark.parametrize("processes", [1, 2])
def test_kill_9_past_the_first_epoch_then_rerun_equals_an_uninterrupted_run(ws, processes):
    """Each epoch's data order is drawn when the epoch starts: a run resumed in a later epoch must draw the order
    the uninterrupted run drew then (the checkpoint holds the RNG state it was drawn from), inside an epoch and at
    an epoch's end."""
    import shutil

    params = yaml.safe_load((ws / "params.yaml").read_text())
    params["sft"].update(cpu_processes=processes, max_steps=24, save_steps=2, eval_steps=12)
    write_params(ws / f"epochs{processes}.yaml", params)
    global_batch = params["sft"]["batch_size"] * params["sft"]["grad_accum"] * processes
    steps_per_epoch = -(-len(CacheDataset(ws / "data/cache/train.arrow")) // global_batch)
    assert 2 < steps_per_epoch and 2 * steps_per_epoch < 24, "the run must span more than two epochs"

    def cmd(out: str) -> list[str]:
        return [c if c != "params.yaml" else f"epochs{processes}.yaml" for c in stage_cmd("sft", out, f"ck/{out}")]

    def same_weights(out: str) -> bool:
        a, b = weights(ws / f"ep{processes}-ref"), weights(ws / out)
        return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

    run(ws, cmd(f"ep{processes}-ref"), timeout=400)
    out, ck = f"ep{processes}-kill", ws / f"ck/ep{processes}-kill"
    # Inside the second epoch: the resume draws that epoch's order again, then skips the batches already trained.
    step = kill_after_first_checkpoint(ws, cmd(out), ck, min_step=steps_per_epoch + 1)
    assert step < 24 and step % steps_per_epoch, f"killed at step {step}: expected inside an epoch after the first"
    assert f"resuming from {ck.relative_to(ws)}/checkpoint-{step}" in run(ws, cmd(out), timeout=400).stdout
    assert same_weights(out), f"resumed inside an epoch at step {step}: different weights"
    # At the end of the second epoch (as if killed right after that checkpoint): the next epoch's order is new.
    end = 2 * steps_per_epoch
    for later in (p for p in ck.glob("checkpoint-*") if checkpoint_step(p) > end):
        shutil.rmtree(later)
    assert f"resuming from {ck.relative_to(ws)}/checkpoint-{end}" in run(ws, cmd(out), timeout=400).stdout
    assert same_weights(out), f"resumed at the end of epoch 2 (step {end}): different weights"


def test_a_killed_run_in_a_dvc_experiments_temporary_copy_resumes_in_the_next_copy(ws):
    """`dvc exp run --temp` and the queue run in <repo>/.dvc/tmp/exps/tmp*, which the next run does not reuse:
    the checkpoints live in the repository's checkpoints/exps/, found again by the run's fingerprint."""
    import shutil

    def temp_copy(name: str) -> Path:
        copy = ws / ".dvc/tmp/exps" / name
        for part in ("params.yaml", "data/cache", "models/base"):
            (copy / part).parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if (ws / part).is_dir() else shutil.copy)(ws / part, copy / part)
        return copy

    run(ws, stage_cmd("sft", "tmp-ref", "ck/tmp-ref"))
    first = temp_copy("tmpfirst")
    kill_after_first_checkpoint(first, stage_cmd("sft", "out", "checkpoints/sft"), ws / "checkpoints/exps")
    [kept] = list((ws / "checkpoints/exps").glob("sft-*"))
    assert any(kept.glob("checkpoint-*")) and not (first / "checkpoints").exists()
    shutil.rmtree(first)
    second = temp_copy("tmpsecond")
    proc = run(second, stage_cmd("sft", "out", "checkpoints/sft"))
    assert f"resuming from {kept}/checkpoint-" in proc.stdout
    a, b = weights(ws / "tmp-ref"), weights(second / "out")
    assert all((a[k] == b[k]).all() for k in a), "the resumed experiment ended with different weights"
    assert not kept.exists()  # finished: nothing left to resume

