"""codi.infra.launch: our own CPU workers, their environment, and the group's exit status."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from codi.infra.launch import maybe_relaunch, shell_status, spawn_workers

ENV_DUMP = ("import json, os, sys; keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', "
            "'MASTER_ADDR', 'MASTER_PORT', 'CODI_DIE_WITH_PARENT']; "
            "open(sys.argv[1] + os.environ['RANK'], 'w').write(json.dumps({k: os.environ.get(k) for k in keys}))")


def test_all_workers_succeed_with_one_rendezvous(tmp_path):
    code = spawn_workers([sys.executable, "-c", ENV_DUMP, str(tmp_path / "env")], 3)
    assert code == 0
    envs = [json.loads((tmp_path / f"env{r}").read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] == [e["LOCAL_RANK"] for e in envs]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"} == {e["LOCAL_WORLD_SIZE"] for e in envs}
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and envs[0]["MASTER_ADDR"] == "127.0.0.1"
    assert {e["CODI_DIE_WITH_PARENT"] for e in envs} == {"1"}


def _rank_script(rank0: str, others: str, pidfile) -> list[str]:
    body = (f"import os, sys, time, signal; open('{pidfile}' + os.environ['RANK'], 'w').write(str(os.getpid()))\n"
            f"if os.environ['RANK'] == '0':\n    {rank0}\nelse:\n    {others}\n")
    return [sys.executable, "-c", body]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_failing_worker_decides_the_status_and_the_others_stop(tmp_path):
    t0 = time.monotonic()
    code = spawn_workers(_rank_script("time.sleep(0.5); sys.exit(3)", "time.sleep(120)", tmp_path / "pid"), 2)
    assert code == 3 and time.monotonic() - t0 < 30
    assert _gone(int((tmp_path / "pid1").read_text()))


def test_a_worker_killed_by_sigkill_gives_137_which_the_flow_retries(tmp_path):
    from pipelines.dvc import is_transient
    code = spawn_workers(_rank_script("time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)", "time.sleep(120)",
                                      tmp_path / "pid"), 2)
    assert code == 137 == shell_status(-signal.SIGKILL) and is_transient(code, [])
    assert _gone(int((tmp_path / "pid1").read_text()))


def test_no_relaunch_under_a_launcher_or_for_one_process(monkeypatch):
    assert maybe_relaunch(1, ["sft"]) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("CODI_DIE_WITH_PARENT", raising=False)
    assert maybe_relaunch(2, ["sft"]) is None


def test_ignored_on_a_gpu_machine_with_a_note(monkeypatch, capsys):
    import torch
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert maybe_relaunch(2, ["sft"]) is None
    assert "cpu_processes = 2 is ignored on a GPU machine" in capsys.readouterr().err
