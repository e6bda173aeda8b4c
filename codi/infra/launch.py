"""Data-parallel CPU training without a launcher: with `<stage>.cpu_processes: N`, `python -m codi <stage>`
starts N worker processes itself (gloo DDP through the env:// rendezvous) and waits for them.

    maybe_relaunch(cfg.cpu_processes, ["--params", "params.yaml", "sft"])   # None: run here

Nothing is relaunched under a launcher (WORLD_SIZE set: torchrun, accelerate), for 1 process, or on a GPU
machine. The stage exits with the first failing worker's status, shell-style (an OOM kill is 137, which
the Prefect flow retries), and no worker outlives the launcher (PR_SET_PDEATHSIG).
Why not torchrun: docs/design/training.md, "Training".
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from codi.infra.linux import set_parent_death_signal

_DIE_WITH_PARENT = "CODI_DIE_WITH_PARENT"
GRACE_S = 5.0  # after SIGTERM, how long a worker may take before SIGKILL


def die_with_parent() -> None:
    set_parent_death_signal(signal.SIGKILL)


def shell_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: Sequence[subprocess.Popen], sig: int = signal.SIGTERM) -> None:
    """Send `sig` to every live worker, then SIGKILL whoever is still alive after GRACE_S."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spawn_workers(cmd: Sequence[str], processes: int, env: dict[str, str] | None = None,
                  poll_s: float = 0.1) -> int:
    """Run `processes` copies of `cmd` as one gloo DDP group; the group's shell-style exit status.

    Each copy gets RANK/LOCAL_RANK (0..N-1), WORLD_SIZE/LOCAL_WORLD_SIZE = N, GROUP_RANK 0 and one
    MASTER_ADDR/MASTER_PORT. The first worker to fail decides the status and the others are stopped."""
    base = dict(os.environ if env is None else env)
    base.update({"WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes), "GROUP_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), _DIE_WITH_PARENT: "1",
                 "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1")})
    procs: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in range(processes):
            procs.append(subprocess.Popen(list(cmd), env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          preexec_fn=die_with_parent))
        while True:
            if received:
                _stop(procs, received[0])
                return 128 + received[0]
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return shell_status(failed[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    finally:
        _stop(procs)  # no worker outlives the launcher, whatever happened above
        for s, h in old.items():
            signal.signal(s, h)


def maybe_relaunch(processes: int, argv: list[str]) -> int | None:
    """Exit status of the relaunched run, or None when this process should train by itself."""
    if "WORLD_SIZE" in os.environ:
        if os.environ.get(_DIE_WITH_PARENT) == "1":  # one of our own workers
            die_with_parent()
            if os.getppid() == 1:  # the launcher died before prctl took effect
                os._exit(128 + signal.SIGKILL)
        return None
    if processes <= 1:
        return None
    import torch
    if torch.cuda.is_available():
        print(f"note: cpu_processes = {processes} is ignored on a GPU machine; this stage runs in one process "
              "(for several GPUs launch it with torchrun or accelerate)", file=sys.stderr, flush=True)
        return None
    cmd = [sys.executable, "-m", "codi", *argv]
    print(f"launching {processes} data-parallel CPU processes (gloo): {' '.join(cmd[1:])}", flush=True)
    return spawn_workers(cmd, processes)
