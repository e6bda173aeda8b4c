"""The `extract` section: sources, the synthetic generator, trace limits, the sandbox, the Dask cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from codi.infra.config import ConfigError, option
from codi.schemas.source_names import source_names

# codi.sources.synthetic_templates.TEMPLATE_NAMES (a test holds them equal; no source module is imported here)
SYNTHETIC_TEMPLATES = ("arith_chain", "branch", "early_return", "ternary", "for_range", "while_loop",
                       "list_accumulate", "list_build", "list_ops", "string_loop", "string_ops", "dict_count",
                       "dict_map", "helper_call", "scan_best", "recursion_int", "recursion_list", "recursion_str",
                       "nested_range", "nested_lists", "chain", "chain_const", "chain_fresh", "chain_branch")


@dataclass(frozen=True)
class SyntheticConfig:
    """The built-in generator of small programs (the embedded default's main training data)."""

    n_programs: int = option("number of distinct programs (problems)", ge=1)
    calls_per_program: int = option("calls (samples) per program, each with fresh inputs", ge=1)
    difficulty: int = option("1 = straight-line code, 2 = +loops/branches/helpers, 3 = +recursion/nesting", ge=1, le=3)
    max_int: int = option("largest free integer argument (0..max_int; loop bounds keep their own ranges)", ge=1, le=99)
    canonical_names: bool = option("name variables a, b, c ... in order and the entry f (less to copy: tiny models)")
    operators: list[str] = option("integer operations the templates may draw (copy: a line that copies a value)",
                                  choices=("+", "-", "*", "//", "%", "max", "min", "abs", "copy"), nonempty=True)
    templates: list[str] = option("template families to draw from; [] = every one of level <= difficulty",
                                  choices=SYNTHETIC_TEMPLATES)
    chain_steps: list[int] = option("[lo, hi]: assignment lines of the straight-line templates (arith_chain and the "
                                    "chain templates)")
    value_range: list[int] = option("[lo, hi]: every integer a call holds (locals, items, result); a call outside is "
                                    "drawn again")
    add_max: int = option("largest constant of a drawn + or - (`c + 1` .. `c + add_max`)", ge=1, le=9)
    seed: int = option("generator seed; the same seed gives the same programs")

    def __post_init__(self) -> None:
        for key, (lo, hi), bounds in (("chain_steps", (1, 10), self.chain_steps), ("value_range", (-999, 999),
                                                                                      self.value_range)):
            if len(bounds) != 2 or not lo <= bounds[0] <= bounds[1] <= hi:
                raise ConfigError(f"extract.synthetic.{key} = {bounds}: expected [lo, hi] with "
                                  f"{lo} <= lo <= hi <= {hi}")


@dataclass(frozen=True)
class TraceConfig:
    """What a trace may contain."""

    max_frames: int = option("frames per trace; a longer run is kept with status `truncated`", ge=1)
    max_repr_chars: int = option("characters per repr; a longer one is cut and ends in a visible marker", ge=8)
    diff_locals: bool = option("write a value unchanged since the previous frame of the same scope as \"..\"")


@dataclass(frozen=True)
class SandboxConfig:
    """Per-sample isolation limits (see codi/tracing/sandbox.py)."""

    wall_timeout_s: float = option("wall-clock limit per sample; the whole process group is killed", gt=0)
    cpu_time_s: int = option("RLIMIT_CPU per sample", ge=1)
    memory_mb: int = option("MB a sample may use: RLIMIT_AS headroom above the worker's own footprint, and (as "
                            "root, with a cgroup) the memory cgroup of all its processes", ge=64)
    max_file_mb: int = option("RLIMIT_FSIZE per sample (files written in its private temp dir)", ge=1)
    max_processes: int = option("RLIMIT_NPROC for the sample's (unprivileged, per-worker) uid", ge=1)
    max_output_bytes: int = option("stdout/stderr bytes kept per sample; the rest is discarded", ge=0)
    max_result_bytes: int = option("bytes of JSON a sample may send back; more is a `truncated`/`error` row", ge=4096)


@dataclass(frozen=True)
class DaskConfig:
    """The Dask cluster of `extract.executor: dask` (codi/tracing/cluster.py)."""

    address: str = option("scheduler address (tcp://host:8786); \"\" = a LocalCluster on 127.0.0.1 started by the stage")
    local_workers: int = option("worker processes of that LocalCluster", ge=1)
    shard_size: int = option("samples per shard: a Dask task (the shard of a worker that dies reruns whole), and "
                             "under either executor the unit a killed extract resumes from", ge=1)


@dataclass(frozen=True)
class ExtractConfig:
    """`extract`: trace programs from the chosen sources inside the sandbox."""

    sources: list[str] = option("sources to trace, in order", choices=source_names, nonempty=True)
    paths: dict[str, str] = option("a file source's dataset (name: path): a local file under data/raw/, or "
                                   "`hf:<dataset id>[:<split>]` (needs network); \"\" = none", choices=source_names)
    skip_bad_lines: bool = option("count and skip a malformed dataset line instead of failing the stage")
    workers: int = option("sandboxed worker processes (per Dask worker under dask); 0 = one per CPU core", ge=0)
    executor: Literal["local", "dask"] = option("local: one sandbox pool here; dask: shards over a Dask cluster")
    dask: DaskConfig = option("the Dask cluster (executor dask)")
    synthetic: SyntheticConfig = option("synthetic generator")
    trace: TraceConfig = option("trace content limits")
    sandbox: SandboxConfig = option("isolation limits")
