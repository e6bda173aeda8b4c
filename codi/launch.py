"""Data-parallel CPU training without a launcher: `python -m codi sft` with `sft.cpu_processes: 2`
starts itself again under torchrun (gloo), one process per core.

    maybe_relaunch(cfg.cpu_processes, ["--params", "params.yaml", "sft"])   # None: run here

One torch thread per process is several times faster than two threads in one process for the tiny
default, so on a 2-core machine two single-threaded processes nearly double training throughput.
Nothing happens on a GPU machine (use torchrun/accelerate there), under an existing launcher
(WORLD_SIZE set), or when 1 process is asked for. The DVC stage command stays `python -m codi <stage>`;
killing its process group (DVC, Prefect) takes the workers down with it.
"""

from __future__ import annotations

import os
import subprocess
import sys


def maybe_relaunch(processes: int, argv: list[str]) -> int | None:
    """Exit code of the relaunched run, or None when this process should train by itself."""
    if processes <= 1 or "WORLD_SIZE" in os.environ:
        return None
    import torch
    if torch.cuda.is_available():
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
           "-m", "codi", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"launching {processes} data-parallel CPU processes (gloo): {' '.join(cmd[1:])}", flush=True)
    return subprocess.call(cmd, env=env)
