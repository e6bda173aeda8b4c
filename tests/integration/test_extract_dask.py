"""`extract.executor: dask`: the same bytes as the local executor, and a Dask worker killed mid-shard
loses and duplicates nothing. Each test starts a LocalCluster of 2 worker processes on 127.0.0.1 and
stops it (the `open_tracer` context, also on failure)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from codi.data.traces import trace_row
from codi.tracing.cluster import DaskTracer, open_tracer, shard_bounds
from tests.integration.test_stages_tiny import cli
from tests.tiny import ROOT, shipped, tiny_params, write_params

FIXTURES = ROOT / "tests/fixtures/sources"


def test_shard_bounds_cover_every_sample_once_in_order():
    assert shard_bounds(0, 4) == []
    assert shard_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert shard_bounds(3, 8) == [(0, 3)]


def test_dask_extract_writes_the_local_executors_bytes(tmp_path: Path):
    """Synthetic programs plus real files with syntax errors, missing entries and raising calls."""
    raw = tmp_path / "data/raw"
    raw.mkdir(parents=True)
    for name in ("mbpp.jsonl", "cruxeval.jsonl"):
        shutil.copy(FIXTURES / name, raw / name)
    paths = {"mbpp": "data/raw/mbpp.jsonl", "cruxeval": "data/raw/cruxeval.jsonl"}
    base = {"sources": ["synthetic", "mbpp", "cruxeval"], "paths": paths, "workers": 1}
    write_params(tmp_path / "local.yaml", tiny_params(extract=base))
    write_params(tmp_path / "dask.yaml", tiny_params(extract={
        **base, "executor": "dask", "dask": {"address": "", "local_workers": 2, "shard_size": 7}}))
    for name in ("local", "dask"):
        out = tmp_path / name
        assert cli(tmp_path, "extract", "--out", str(out), "--metrics", str(out / "m.json"),
                   params=f"{name}.yaml") == 0
    for name in ("synthetic.parquet", "mbpp.parquet", "cruxeval.parquet", "stats.json"):
        assert (tmp_path / "dask" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name


def busy_samples(n: int, loops: int = 20000):
    """Samples that each take tens of milliseconds, so a shard is still running when its worker is killed."""
    from codi.sources.base import Sample
    program = "def f(n):\n    total = 0\n    for i in range(n):\n        total += i % 7\n    return total\n"
    return [Sample(f"busy/{i}", "cruxeval", f"busy/{i}", program, f"f({loops + i})") for i in range(n)]


def test_a_worker_killed_mid_shard_loses_and_duplicates_nothing():
    cfg = shipped("extract", workers=1)
    samples = busy_samples(60)
    with open_tracer(cfg) as pool:
        expected = [trace_row(s, r) for s, r in zip(samples, pool.trace(samples))]

    dask_cfg = dataclasses.replace(cfg, executor="dask",
                                   dask=dataclasses.replace(cfg.dask, address="", local_workers=2, shard_size=5))
    with open_tracer(dask_cfg) as tracer:
        assert isinstance(tracer, DaskTracer)
        client = tracer.client
        before = set(client.scheduler_info()["workers"])
        rows, killed = [], None
        for sample, result in zip(samples, tracer.trace(samples)):
            rows.append(trace_row(sample, result))
            if killed is None:  # the first result is in: kill a worker that is running a shard now
                busy = [w for w, keys in client.processing().items() if keys]
                assert busy, "no shard was running"
                killed = busy[0]
                pid = client.run(os.getpid, workers=[killed])[killed]
                os.kill(pid, signal.SIGKILL)
        after = set(client.scheduler_info()["workers"])
    assert killed in before and killed not in after, "the worker did not die"
    assert rows == expected
    assert [r["sample_id"] for r in rows] == [s.sample_id for s in samples]


def kill_workers_once_all_are_busy(client, pids: dict[str, int]) -> None:
    """Wait until every worker runs a shard, then SIGKILL them all."""
    while not all(client.processing().get(w) for w in pids):
        time.sleep(0.01)
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)


def test_a_shard_that_cannot_finish_stops_the_stage_with_its_samples_named():
    """Past `distributed.scheduler.allowed-failures` worker deaths, the error names the shard."""
    import dask

    cfg = shipped("extract", workers=1, executor="dask")
    cfg = dataclasses.replace(cfg, dask=dataclasses.replace(cfg.dask, address="", local_workers=2, shard_size=2))
    samples = busy_samples(4, loops=300_000)
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), open_tracer(cfg) as tracer:
        killer = threading.Thread(target=kill_workers_once_all_are_busy,
                                  args=(tracer.client, tracer.client.run(os.getpid)))
        killer.start()
        try:
            with pytest.raises(RuntimeError, match=r"extract: shard \d \(samples \d\.\.\d, first busy/\d\) failed"):
                list(tracer.trace(samples))
        finally:
            killer.join(timeout=60)


@pytest.mark.slow
def test_the_prefect_flow_runs_extract_on_dask_and_dvc_sees_the_same_traces(tmp_path, prefect_server):
    """The pipeline flow with `extract.executor: dask`: extract reruns (its params changed) on a LocalCluster,
    writes the same traces (dvc.lock's hash of data/traces is unchanged), so every later stage is skipped."""
    import yaml

    from pipelines.flows import pipeline
    from tests.integration.test_real_pipeline_dvc import dvc, tiny_repo

    repo = tiny_repo(tmp_path / "repo")
    lock_before = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["extract"].update(executor="dask", dask={"address": "", "local_workers": 2, "shard_size": 16})
    write_params(repo / "params.yaml", params)

    state = pipeline(repo=str(repo), return_state=True)
    assert state.is_completed(), state.message
    statuses = {s["stage"]: s["status"] for s in state.result()["stages"]}
    assert statuses["extract"] == "ran"
    assert all(statuses[s] != "ran" for s in ("precompute", "sft", "sft_direct", "codi", "evaluate")), statuses
    lock_after = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert lock_after["extract"]["params"]["params.yaml"]["extract"]["executor"] == "dask"
    assert lock_after["extract"]["outs"] == lock_before["extract"]["outs"]  # the same bytes
    assert "up to date" in dvc(repo, "status")
