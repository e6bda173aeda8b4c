"""Tiny throwaway DVC projects for the tests of pipelines/: a tmp git repo + `dvc init` whose stages are
`python tool.py ...` one-liners, and what the tests read back (process groups, Prefect artifacts)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from pipelines import dvc

# The stage commands of the tiny projects. `write OUT [IN...]` is a stage that reads its inputs and writes OUT.
TOOL = textwrap.dedent(r'''
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    import yaml
    cmd, *args = sys.argv[1:]
    def attempt():
        p = Path("attempts.txt"); n = len(p.read_text().splitlines()) if p.exists() else 0
        p.write_text("x\n" * (n + 1)); return n
    def record_group(pids):
        Path("pids.json").write_text(json.dumps({"pgid": os.getpgid(0), "pids": pids}))
    if cmd == "write":
        out, *ins = args
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("".join(Path(i).read_text() for i in ins) + out + "\n")
        print(f"wrote {out}")
    elif cmd == "evaluate":
        gamma = yaml.safe_load(Path("params.yaml").read_text())["gamma"]
        if gamma < 0:
            raise ValueError(f"gamma = {gamma}: expected >= 0")
        Path("metrics").mkdir(exist_ok=True); Path("plots/eval").mkdir(parents=True, exist_ok=True)
        metrics = {"explicit": {"accuracy": 0.5, "n": 4}, "latent": {"accuracy": gamma / 4, "n": 4},
                   "retention": gamma / 2, "compression": 3.0}
        Path("metrics/eval.json").write_text(json.dumps(metrics))
        Path("metrics/eval.md").write_text("| mode | accuracy |\n|---|---|\n| explicit | 0.5 |\n| latent | %s |\n" % (gamma / 4))
        Path("plots/eval/accuracy.png").write_bytes(b"\x89PNG fake")
        print("evaluated")
    elif cmd == "fail":
        attempt(); raise ValueError("boom in stage")
    elif cmd == "killonce":
        if attempt() == 0:
            print("about to be killed", flush=True); os.kill(os.getpid(), signal.SIGKILL)
        Path(args[0]).write_text("ok")
    elif cmd == "sleep":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        record_group([os.getpid(), child.pid]); print("sleeping", flush=True); time.sleep(120)
    elif cmd == "daemon":
        # exits at once but leaves a child that holds the output pipe open
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        record_group([child.pid]); print("left a child behind")
''')

PIPELINE_PARAMS = {"cron": "0 3 * * *", "retries": 1, "retry_delay_s": 0.0}

# The project's DAG in miniature, listed out of order on purpose.
DAG_STAGES = {
    "evaluate": {"cmd": "python tool.py evaluate", "deps": ["models/codi.txt", "models/sft_direct.txt"],
                 "params": ["gamma"], "metrics": [{"metrics/eval.json": {"cache": False}}],
                 "outs": [{"metrics/eval.md": {"cache": False}}, {"plots/eval": {"cache": False}}]},
    "codi": {"cmd": "python tool.py write models/codi.txt models/sft.txt", "deps": ["models/sft.txt"],
             "params": ["gamma"], "outs": ["models/codi.txt"]},
    "sft_direct": {"cmd": "python tool.py write models/sft_direct.txt data/cache.txt", "deps": ["data/cache.txt"],
                   "outs": ["models/sft_direct.txt"]},
    "sft": {"cmd": "python tool.py write models/sft.txt data/cache.txt", "deps": ["data/cache.txt"],
            "outs": ["models/sft.txt"]},
    "precompute": {"cmd": "python tool.py write data/cache.txt data/traces.txt", "deps": ["data/traces.txt"],
                   "outs": ["data/cache.txt"]},
    "extract": {"cmd": "python tool.py write data/traces.txt", "outs": ["data/traces.txt"]},
}
DAG_ORDER = ["extract", "precompute", "sft", "codi", "sft_direct", "evaluate"]  # DVC's plan: `dvc repro`'s order


def make_project(root: Path, stages: dict[str, Any], gamma: float = 1.0) -> Path:
    """A committed git + DVC project in `root` with these stages."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tool.py").write_text(TOOL)
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (root / "params.yaml").write_text(yaml.safe_dump({"gamma": gamma, "pipeline": PIPELINE_PARAMS}, sort_keys=False))
    (root / ".gitignore").write_text("attempts.txt\npids.json\n")
    env = dvc.subprocess_env()
    for cmd in (["git", "init", "-q"], dvc.dvc_command("init", "-q"), ["git", "add", "-A"],
                ["git", "-c", "user.name=ci", "-c", "user.email=ci@localhost", "commit", "-qm", "tiny project"]):
        subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
    return root


def group_survivors(pgid: int, wait_s: float = 2.0) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, after giving them `wait_s` to go away."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for p in psutil.process_iter(["status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
            except (ProcessLookupError, PermissionError):
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def wait_for_file(path: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def artifacts_of(flow_run_id: Any) -> dict[str, Any]:
    """key -> artifact of one flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in found}
