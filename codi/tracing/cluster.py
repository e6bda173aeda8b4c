"""Trace samples on a Dask cluster: the samples are cut into shards, and each Dask worker traces its
shards with its own sandbox pool (codi.tracing.sandbox.TracerPool).

    from codi.tracing.cluster import open_tracer
    with open_tracer(params.extract) as tracer:     # executor local: a TracerPool; dask: a DaskTracer
        print(tracer.isolation)
        for result in tracer.trace(samples):        # input order, whatever the executor
            ...

The rows are byte-identical to the local executor's: each shard's results come back whole and in order,
and the shards are put back in input order. A worker that dies mid-shard loses nothing: the scheduler
runs its shards again on another worker (up to `distributed.scheduler.allowed-failures` deaths of one
shard, then the stage stops with an error naming the shard), and a shard's result is taken once.

With `extract.dask.address: ""` the stage starts a LocalCluster on 127.0.0.1 and stops it at the end.
A real cluster: one `dask worker tcp://<scheduler>:8786 --nthreads 1` per machine; its pool then has
`extract.workers` sandbox processes (0 = that machine's cores). Why the stage holds its own client
rather than Prefect's DaskTaskRunner: docs/design/scale-out.md, "Scale-out".
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Protocol

try:
    from distributed import Client, LocalCluster, WorkerPlugin, as_completed, get_worker
    DASK_MISSING: ImportError | None = None
except ImportError as e:  # only the dask executor needs it: without Dask (a bare GPU machine) extract runs locally
    DASK_MISSING = e
    WorkerPlugin = object

from codi.infra.config import ConfigError
from codi.schemas.extract import DaskConfig, ExtractConfig, SandboxConfig, TraceConfig
from codi.sources.base import Sample
from codi.tracing.sandbox import TraceResult, TracerPool

PLUGIN_NAME = "codi-tracer-pool"


class Tracer(Protocol):
    """What the extract stage traces with: a TracerPool here, or a DaskTracer over a cluster."""

    @property
    def isolation(self) -> str: ...

    def trace(self, samples: Iterable[Sample]) -> Iterator[TraceResult]: ...


def shard_bounds(n: int, shard_size: int) -> list[tuple[int, int]]:
    """[start, stop) of each shard of `n` samples, in order."""
    return [(start, min(start + shard_size, n)) for start in range(0, n, shard_size)]


def local_pool_size(workers: int, local_workers: int) -> int:
    """Sandbox processes per LocalCluster worker: `extract.workers`, or this machine's cores shared out."""
    return workers or max(1, (os.cpu_count() or 1) // local_workers)


class TracerPoolPlugin(WorkerPlugin):
    """A Dask worker plugin: one sandbox pool per Dask worker, started on first use, closed with the worker.

    The pool takes one shard at a time (a TracerPool is single-threaded), so a worker with several
    threads runs its shards one after the other; parallelism comes from the pool's processes."""

    name = PLUGIN_NAME

    def __init__(self, trace: TraceConfig, sandbox: SandboxConfig, workers: int) -> None:
        self.trace_cfg, self.sandbox_cfg, self.workers = trace, sandbox, workers
        self.pool: TracerPool | None = None
        self.lock = threading.Lock()

    def setup(self, worker) -> None:
        self.pool = TracerPool(self.trace_cfg, self.sandbox_cfg, self.workers)

    def teardown(self, worker) -> None:
        if self.pool is not None:
            self.pool.close()

    def __getstate__(self) -> dict:  # what travels to the workers: the settings, never a live pool
        return {"trace_cfg": self.trace_cfg, "sandbox_cfg": self.sandbox_cfg, "workers": self.workers}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["trace_cfg"], state["sandbox_cfg"], state["workers"])


def _worker_plugin(worker) -> TracerPoolPlugin:
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        raise RuntimeError(f"this Dask worker has no {PLUGIN_NAME} plugin: register it before submitting shards")
    return plugin


def trace_shard(samples: list[Sample]) -> list[TraceResult]:
    """A Dask task: the results of one shard, in order, from this worker's pool."""
    plugin = _worker_plugin(get_worker())
    with plugin.lock:
        return list(plugin.pool.trace(samples))


def pool_isolation(dask_worker) -> str:
    """Run on every worker by `client.run` (which passes `dask_worker`): the isolation line of its pool."""
    plugin = _worker_plugin(dask_worker)
    with plugin.lock:
        return f"{dask_worker.address}: {plugin.pool.isolation}"


class DaskTracer:
    """Traces on a Dask cluster in shards of `shard_size` samples; results in input order."""

    def __init__(self, client: Client, shard_size: int) -> None:
        self.client, self.shard_size = client, shard_size
        self._runs = 0

    @property
    def isolation(self) -> str:
        lines = self.client.run(pool_isolation)
        return f"Dask cluster {self.client.scheduler.address}, {len(lines)} workers\n  " + "\n  ".join(
            sorted(lines.values()))

    def trace(self, samples: Iterable[Sample]) -> Iterator[TraceResult]:
        """Every sample's result in input order, yielded as soon as the shards before it are done."""
        samples = list(samples)
        self._runs += 1
        bounds = shard_bounds(len(samples), self.shard_size)
        # Explicit keys: a shard is one task however often its worker dies, so it is taken once.
        futures = {self.client.submit(trace_shard, samples[a:b], key=f"trace-shard-{id(self)}-{self._runs}-{i}",
                                      pure=False): i for i, (a, b) in enumerate(bounds)}
        done: dict[int, list[TraceResult]] = {}
        next_shard = 0
        try:
            for future, results in as_completed(futures, with_results=True, raise_errors=False, loop=self.client.loop):
                i = futures[future]
                a, b = bounds[i]
                if future.status != "finished":
                    raise RuntimeError(f"extract: shard {i} (samples {a}..{b - 1}, first "
                                       f"{samples[a].sample_id}) failed on the Dask cluster: {results!r}")
                if len(results) != b - a:
                    raise RuntimeError(f"extract: shard {i} returned {len(results)} results for {b - a} samples")
                done[i] = results
                while next_shard in done:
                    yield from done.pop(next_shard)
                    next_shard += 1
        finally:
            self.client.cancel(list(futures))


@contextlib.contextmanager
def dask_client(cfg: DaskConfig, pool: TracerPoolPlugin) -> Iterator[Client]:
    """A client of `cfg.address`, or of a LocalCluster on 127.0.0.1 that ends with the block; every
    worker (and every worker that joins later) carries `pool`."""
    with contextlib.ExitStack() as stack:
        if cfg.address:
            client = stack.enter_context(Client(cfg.address, timeout="60s", set_as_default=False))
        else:
            cluster = stack.enter_context(LocalCluster(
                n_workers=cfg.local_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address=None, worker_dashboard_address=None))
            client = stack.enter_context(Client(cluster, set_as_default=False))
        client.register_plugin(pool, name=PLUGIN_NAME)
        yield client


@contextlib.contextmanager
def open_tracer(cfg: ExtractConfig) -> Iterator[Tracer]:
    """The tracer `extract.executor` names, started; closed (and a LocalCluster stopped) at the end."""
    if cfg.executor == "local":
        with TracerPool(cfg.trace, cfg.sandbox, cfg.workers) as pool:
            yield pool
        return
    if DASK_MISSING is not None:
        raise ConfigError(f"extract.executor = dask, but Dask's distributed is not importable ({DASK_MISSING}): "
                          "install dask[distributed], or set extract.executor: local")
    workers = cfg.workers if cfg.dask.address else local_pool_size(cfg.workers, cfg.dask.local_workers)
    with dask_client(cfg.dask, TracerPoolPlugin(cfg.trace, cfg.sandbox, workers)) as client:
        yield DaskTracer(client, cfg.dask.shard_size)
