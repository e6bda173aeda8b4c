"""Data-parallel CPU training without a launcher: `python -m codi sft` with `sft.cpu_processes: 2`
starts itself again under torchrun (gloo), one process per core.

    maybe_relaunch(cfg.cpu_processes, ["--params", "params.yaml", "sft"])   # None: run here

On the host where the default was tuned, two single-threaded processes gave 1.7x the throughput of
one (on another 2-core host, one process with 2 threads did about as well: measure with
benchmarks/bench_train.py).
Nothing happens on a GPU machine (use torchrun/accelerate there), under an existing launcher
(WORLD_SIZE set), or when 1 process is asked for. The DVC stage command stays `python -m codi <stage>`.
torchrun starts its workers in sessions of their own, so a kill of the stage's process group would not
reach them: on Linux the torchrun agent and every worker ask the kernel for SIGKILL when their parent
dies (PR_SET_PDEATHSIG), so killing the stage (DVC, Prefect, kill -9 of the group) takes them all down.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_DIE_WITH_PARENT = "CODI_DIE_WITH_PARENT"


def set_parent_death_signal(sig: int) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)


def die_with_parent() -> None:
    set_parent_death_signal(signal.SIGKILL)


def maybe_relaunch(processes: int, argv: list[str]) -> int | None:
    """Exit code of the relaunched run, or None when this process should train by itself."""
    if "WORLD_SIZE" in os.environ:
        if os.environ.get(_DIE_WITH_PARENT) == "1":  # a worker of our own relaunch, child of the torchrun agent
            die_with_parent()
            if os.getppid() == 1:  # the agent died before prctl took effect
                os._exit(128 + signal.SIGKILL)
        return None
    if processes <= 1:
        return None
    import torch
    if torch.cuda.is_available():
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
           "-m", "codi", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), _DIE_WITH_PARENT: "1"}
    print(f"launching {processes} data-parallel CPU processes (gloo): {' '.join(cmd[1:])}", flush=True)
    return subprocess.call(cmd, env=env, preexec_fn=die_with_parent)
