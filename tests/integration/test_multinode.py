"""Several nodes: two torchrun agents on this machine (`--nnodes 2 --nproc_per_node 1`, a c10d rendezvous on
127.0.0.1, gloo) train like one process with the same global batch, step for step, for `sft` and `codi`; and
so does `accelerate launch` with configs/accelerate/multi_gpu.yaml and 2 processes (gloo on CPU).

What makes the curves equal, and what is compared:
- the same examples at every step: the length-grouped order is built for the global batch, the same on every
  rank, and accelerate hands rank r the per-device batches r, r + N, ... (codi.training.grouped). sft's
  `num_input_tokens_seen` (the non-padding tokens of all ranks) must match exactly, step for step;
- the same loss: sft's CE is a mean over the target tokens of the whole step on all ranks (HF's
  num_items_in_batch, gathered across ranks: the ranks hold different token counts), the weighted CE
  (`computed_weight`) likewise over the step's total weight; codi's losses are means over examples and every
  rank holds as many; the logged loss and codi's logged sub-losses are means over the ranks;
- codi's value terms (the default recipe's value CE and value KD, codi.modeling.model) off: each is a mean over
  the value slots of the rank's own examples, and the value KD divides by the std of the rank's own teacher
  states (as CODI's and PCCoT's KD normalisation does, per process), so under N processes they are close to
  the 1-process values, not equal (measured: 16.604 against 16.582 at step 1);
- no randomness that depends on the rank: the tiny model has no dropout, and codi's scheduled sampling is off
  (`ss_prob: 0`; its draws are per rank, so with ss_prob > 0 the two runs draw differently).
Not compared: sft's eval_loss. HF's evaluation loop completes the last per-rank batch with repeated val
examples (accelerate's even_batches) and averages per-batch means, so under N processes it is close to the
1-process value, not equal. codi computes its val losses itself (sharded sums, all-reduced) and they are compared.

Tolerance: |a - b| <= 1e-5 * max(1, |a|). The runs differ only in float32 rounding: the 1-process run reduces
one batch, DDP sums two half-batch gradients (gloo all-reduce) and the matmuls see other shapes. That is a
few 1e-7 relative (measured: at most 1 float32 ulp, 4.8e-7 at a loss of 5-6 and 9.5e-7 at 8, over 25 AdamW
steps); 1e-5 leaves room for AdamW to amplify it over longer runs. Real differences are far larger: one other
example in a batch moved the first loss by 2.3e-4 and the curve by up to 0.1, a per-rank mean of the weighted
CE moved it by 0.02, codi's sub-losses logged from rank 0 alone by 0.13.

Every process of a multi-process run carries a marker in its environment; whatever happens (a failure, the
deadline), the test kills the process group of every process that carries it (torchrun starts each worker in
a session of its own, so killing the agent's group alone could leave a worker behind). The 1-process runs are
plain subprocess.run calls with a timeout. Every address is 127.0.0.1: the rendezvous, the workers'
MASTER_ADDR (`--local_addr`; accelerate's default) and gloo (GLOO_SOCKET_IFNAME=lo).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from tests.integration.test_training_procs import ENV, run, stage_cmd, ws  # noqa: F401  (ws: the workspace fixture)
from tests.tiny import ROOT, write_params

MARK = "CODI_TEST_MULTINODE"
TOL = 1e-5
GLOBAL_BATCH = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_node(port: int, run_id: str, host: bool, log_dir: Path) -> tuple[str, ...]:
    """One "node": a torchrun agent with one process, joining a 2-node c10d rendezvous on 127.0.0.1."""
    return ("-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", run_id,
            "--rdzv_conf", f"is_host={int(host)},join_timeout=120",  # node 0 hosts the rendezvous store
            "--local_addr", "127.0.0.1",  # the address the workers' MASTER_ADDR comes from
            "--max_restarts", "0", "--log-dir", str(log_dir))


def kill_marked(marker: str) -> None:
    """SIGKILL the process group of every process whose environment carries `marker` (never our own group)."""
    own = os.getpgrp()
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) != marker:
                continue
            pgid = os.getpgid(proc.pid)
            if pgid != own:
                os.killpg(pgid, signal.SIGKILL)
            else:  # pragma: no cover - every process here is started in a session of its own
                os.kill(proc.pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue


def accelerate_launch(config: str, processes: int, log_dir: Path) -> tuple[str, ...]:
    """`accelerate launch` with one of configs/accelerate/, on CPU: its multi-GPU launcher starts the processes
    (torch elastic) and they use gloo (`--cpu` would start one process: accelerate's multi-CPU path is mpirun)."""
    return ("-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/accelerate" / config),
            "--num_processes", str(processes), "--mixed_precision", "no", "--main_process_port", "0",
            "--log_dir", str(log_dir))


def run_group(ws: Path, argvs: list[list[str]], name: str, timeout: float = 300) -> None:
    """Start every command at once and wait for all; the first failure (or the deadline) ends the wait.
    Whatever happens, every process they started is killed."""
    marker = uuid.uuid4().hex
    env = {**ENV, MARK: marker, "GLOO_SOCKET_IFNAME": "lo"}  # gloo on the loopback interface
    logs = [ws / f"{name}-{n}.log" for n in range(len(argvs))]
    procs: list[subprocess.Popen] = []
    codes: list[int | None] = [None] * len(argvs)
    try:
        for argv, log in zip(argvs, logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, *argv], cwd=ws, env=env, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
    finally:
        kill_marked(marker)
        for p in procs:
            p.kill()
            p.wait()
    tails = "\n".join(f"--- {log.name} (exit {c}):\n" + log.read_text()[-3000:] for log, c in zip(logs, codes))
    assert codes == [0] * len(argvs), tails


def history(ck: Path) -> list[dict]:
    """The log history of the run's last checkpoint: what metrics/<stage>.json, the loss PNG and dvclive show."""
    last = max(ck.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return json.loads((last / "trainer_state.json").read_text())["log_history"]


def curves(hist: list[dict], keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    return {k: [(h["step"], h[k]) for h in hist if k in h] for k in keys}


SFT_CURVES = ("loss", "grad_norm", "learning_rate", "num_input_tokens_seen")
CODI_CURVES = ("loss", "grad_norm", "learning_rate", "teacher_loss", "student_loss", "kd_loss",
               "eval_loss", "eval_teacher_loss", "eval_student_loss", "eval_kd_loss")
CASES = {
    # name: (stage, launcher, per-rank batch, grad_accum on each rank, extra params, steps, curves)
    "sft": ("sft", "torchrun-2-nodes", 2, 1, {}, 25, SFT_CURVES),
    # 1 example a micro-batch: the ranks' token counts (and weights) differ at every micro-batch
    "sft-weighted-accum": ("sft", "torchrun-2-nodes", 1, 2, {"computed_weight": 4.0}, 25, SFT_CURVES),
    # the value terms off: they are statistics of each rank's own value slots (see the module's docstring)
    "codi": ("codi", "torchrun-2-nodes", 2, 1, {"val_accuracy_samples": 0, "value_weight": 0.0, "value_kd_weight": 0.0},
             12, CODI_CURVES),
    "sft-accelerate": ("sft", "accelerate-multi_gpu", 2, 1, {}, 25, SFT_CURVES),
}


@pytest.mark.parametrize("case", [
    "sft",
    pytest.param("sft-weighted-accum", marks=pytest.mark.slow),
    pytest.param("codi", marks=pytest.mark.slow),
    pytest.param("sft-accelerate", marks=pytest.mark.slow),
])
def test_several_processes_train_like_one_process_with_the_same_global_batch(ws, case):
    from codi.data.cache import CacheDataset

    stage, launcher, per_rank, accum, extra, steps, keys = CASES[case]
    assert 2 * per_rank * accum == GLOBAL_BATCH
    if stage == "codi" and not (ws / "models/sft").exists():
        run(ws, stage_cmd("sft", "models/sft", "ck/sft-base"))
    n_train = len(CacheDataset(ws / "data/cache/train.arrow"))
    # Across epochs only when the split divides into global batches: 1 process takes a short last batch as it
    # is, accelerate completes every rank's with examples from the epoch's start (even_batches).
    if n_train % GLOBAL_BATCH:
        steps = min(steps, n_train // GLOBAL_BATCH)

    def params_file(name: str, batch: int, grad_accum: int) -> str:
        p = yaml.safe_load((ws / "params.yaml").read_text())
        p[stage].update(max_steps=steps, batch_size=batch, grad_accum=grad_accum, logging_steps=1, save_steps=steps,
                        eval_steps=steps, save_total_limit=0, cpu_processes=1, **extra)
        write_params(ws / f"{name}.yaml", p)
        return f"{name}.yaml"

    def cmd(name: str, file: str) -> list[str]:
        return [c if c != "params.yaml" else file for c in stage_cmd(stage, name, f"ck/{name}")] + ["--live", f"live/{name}"]

    one = "one-" + "-".join([stage, *(f"{k}{v}" for k, v in extra.items())])  # shared by the cases that can
    if not (ws / f"m/{one}.json").is_file():
        run(ws, cmd(one, params_file(one, GLOBAL_BATCH, 1)))
    many = f"many-{case}"
    argv = cmd(many, params_file(many, per_rank, accum))
    if launcher == "torchrun-2-nodes":
        port, run_id = free_port(), uuid.uuid4().hex
        run_group(ws, [[*torchrun_node(port, run_id, host=n == 0, log_dir=ws / f"torchelastic-{many}"), *argv]
                       for n in range(2)], many)
    else:
        run_group(ws, [[*accelerate_launch("multi_gpu.yaml", 2, log_dir=ws / f"torchelastic-{many}"), *argv]], many)

    a, b = curves(history(ws / "ck" / one), keys), curves(history(ws / "ck" / many), keys)
    report, bad = [], []
    for k in keys:
        assert a[k], f"{k}: not logged"
        assert [s for s, _ in a[k]] == [s for s, _ in b[k]], f"{k}: logged at other steps"
        diff = max(abs(x - y) for (_, x), (_, y) in zip(a[k], b[k]))
        report.append(f"{k}: {len(a[k])} points, max |diff| {diff:.3g}")
        exact = k == "num_input_tokens_seen"  # the same tokens at every step
        bad += [f"{k} at step {s}: {x} (1 process) vs {y} ({launcher})" for (s, x), (_, y) in zip(a[k], b[k])
                if (x != y if exact else abs(x - y) > TOL * max(1.0, abs(x)))]
    print(f"\n{case}, {steps} steps of {GLOBAL_BATCH} examples: " + "; ".join(report))
    assert not bad, "\n".join(bad[:10])
    assert json.loads((ws / f"m/{many}.json").read_text())["steps"] == steps


def test_the_accelerate_configs_load_and_say_what_the_readme_says():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    configs = {p.stem: load_config_from_file(str(p)) for p in (ROOT / "configs/accelerate").glob("*.yaml")}
    assert set(configs) == {"multi_gpu", "multi_node", "fsdp"}
    assert configs["multi_gpu"].distributed_type == DistributedType.MULTI_GPU and configs["multi_gpu"].num_machines == 1
    node = configs["multi_node"]
    assert node.distributed_type == DistributedType.MULTI_GPU and node.num_machines == 2 and node.main_process_ip
    fsdp = configs["fsdp"]
    assert fsdp.distributed_type == DistributedType.FSDP and fsdp.mixed_precision == "bf16"
    assert fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Qwen2DecoderLayer"
    assert fsdp.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp.fsdp_config["fsdp_reshard_after_forward"] == "FULL_SHARD" and fsdp.fsdp_config["fsdp_use_orig_params"]
