"""The committed results are the results of the committed pipeline.

dvc.lock, metrics/ and plots/ are committed as the outcome of `make run`. If params.yaml or a stage's
code changes without a rerun, `dvc status` reports the stage's params or code dependencies as
modified and every figure in the README and metrics/ describes a pipeline that no longer exists.
In a fresh clone the DVC-cached outputs (data/, models/) are absent, so "deleted" and "not in cache"
are expected; anything else is stale.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from pipelines.dvc import dvc_command, is_transient, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
ABSENT_IN_A_CLONE = {"deleted", "not in cache"}


def stale_entries(status: dict) -> list[str]:
    """`dvc status --json` -> the entries that are not explained by outputs missing from a clone."""
    stale = []
    for stage, groups in status.items():
        for group in groups:
            if not isinstance(group, dict):  # e.g. "always changed"
                stale.append(f"{stage}: {group}")
                continue
            for kind, entries in group.items():
                for path, state in entries.items():
                    if isinstance(state, dict):  # params.yaml: {key: "modified" | "new" | "deleted"}
                        stale += [f"{stage}: {kind} {path}:{key} {s}" for key, s in state.items()]
                    elif state not in ABSENT_IN_A_CLONE:
                        stale.append(f"{stage}: {kind} {path} {state}")
    return stale


def test_stale_entries_are_params_code_and_edited_metrics_not_missing_outputs():
    status = {
        "sft": [{"changed deps": {"models/base": "deleted", "codi/data/cache.py": "modified",
                                  "params.yaml": {"sft.lr": "modified"}}},
                {"changed outs": {"models/sft": "not in cache", "metrics/sft.json": "modified"}}],
        "extract": [{"changed outs": {"data/traces": "not in cache"}}],
    }
    assert stale_entries(status) == ["sft: changed deps codi/data/cache.py modified",
                                     "sft: changed deps params.yaml:sft.lr modified",
                                     "sft: changed outs metrics/sft.json modified"]
    assert stale_entries({}) == []


def dvc_status(root: Path, wait_s: float = 300.0) -> dict:
    """`dvc status --json` of `root`. It waits for the repo lock (`dvc --wait-for-lock`); while a `dvc repro`
    there runs a stage, that stage's paths are busy (a lock --wait-for-lock does not wait for): retry then."""
    deadline = time.monotonic() + wait_s
    while True:
        proc = subprocess.run(dvc_command("status", "--json"), cwd=root, capture_output=True, text=True,
                              env=subprocess_env(), timeout=wait_s)
        if proc.returncode and is_transient(proc.returncode, [proc.stderr]) and time.monotonic() < deadline:
            time.sleep(2.0)
            continue
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout or "{}")


def test_dvc_lock_matches_the_committed_params_code_and_metrics():
    git = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True)
    assert git.returncode == 0, (f"{ROOT} is not a git repository, and DVC needs one: `make test` makes one "
                                 "(`make git-repo`: git init + one commit of the tree)")
    stale = stale_entries(dvc_status(ROOT))
    assert not stale, ("dvc.lock does not describe the committed pipeline; run `dvc repro` and commit "
                       "dvc.lock, metrics/ and plots/:\n  " + "\n  ".join(stale))
