"""Stage `precompute`: traces -> tokenizer + base model + split caches with exact locals spans.

    python -m codi precompute     # data/cache/{train,val,test,holdout}.arrow + manifest.json, models/base/

Keeps `ok` traces, splits by problem (stable hash), builds the base model (`model.base`), tokenizes,
locates and checks every LINE frame's locals span (codi.data.cache_build), and writes the counts as DVC metrics.
Each file is written atomically, and the cache's manifest.json last: killed, the stage leaves no manifest, so
the next stage stops with an error that says to rerun precompute.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from codi.data.cache import MANIFEST, write_split
from codi.data.cache_build import cache_manifest, cache_metrics, encode_rows, summary_line, usable_traces
from codi.infra.config import ConfigError
from codi.infra.files import atomic_dir, atomic_paths, write_json
from codi.infra.kernels import check_cpu_kernels, describe_kernels
from codi.modeling.base_model import build_base, check_model_source, save_base
from codi.schemas.kernels import KernelsConfig
from codi.schemas.model import ModelConfig
from codi.schemas.precompute import PrecomputeConfig


@dataclass(frozen=True)
class PrecomputeParams:
    """What this stage reads from params.yaml."""

    precompute: PrecomputeConfig
    model: ModelConfig
    kernels: KernelsConfig     # the base model's random initialisation runs torch kernels


def run(params: PrecomputeParams, traces: Path, cache: Path, base_out: Path, metrics: Path) -> int:
    t0 = time.time()
    check_model_source(params.model)  # before any work: bad path / offline hub id
    check_cpu_kernels(params.kernels.cpu)
    print(f"precompute: {describe_kernels(params.kernels.cpu)}")
    files = sorted(traces.glob("*.parquet"))
    if not files:
        raise ConfigError(f"{traces}: no <source>.parquet files (run the extract stage first)")
    dropped: dict[str, Counter] = defaultdict(Counter)
    rows = usable_traces(files, params.precompute, dropped)
    train_rows = [r for r in rows if r["split"] == "train"]
    if not train_rows:
        raise ConfigError(f"{traces}: no ok traces fall in the train split ({len(rows)} ok traces in all)")

    print(f"precompute: {len(rows)} usable traces; building base model {params.model.base!r}")
    model, tok = build_base(params.model, (r["prompt"] + r["trace_text"] for r in train_rows))
    by_split = encode_rows(rows, tok, params.precompute, dropped)

    cache.mkdir(parents=True, exist_ok=True)
    # All or none (a full disk, a kill): the splits and the manifest are written to temporary files and replace the
    # previous ones together, the manifest last, after models/base: never new splits beside the old manifest or
    # model. A kill -9 inside the final renames can leave new splits beside the old manifest: its hashes refuse them.
    with atomic_paths([*(cache / f"{split}.arrow" for split in by_split), cache / MANIFEST]) as tmps:
        shas = {split: write_split(split_rows, tmp) for (split, split_rows), tmp in zip(by_split.items(), tmps)}
        manifest = cache_manifest(by_split, shas, tok, params.precompute, params.model, dropped)
        write_json(tmps[-1], manifest)
        with atomic_dir(base_out) as tmp:
            save_base(model, tok, tmp)
    write_json(metrics, cache_metrics(manifest))
    print(summary_line(manifest, time.time() - t0))
    return 0
