"""The example cache: split assignment, writing, and memory-mapped loading for the training stages.

    split_of("mbpp/11", val_fraction=0.1, test_fraction=0.1, salt="codi-trace")  # "train" | "val" | "test"
    write_split(rows, "data/cache/train.arrow")
    ds = CacheDataset("data/cache/train.arrow")      # torch Dataset of codi-contract dicts
    ds[0] -> {"prompt_ids": [...], "trace_ids": [...], "spans": [(i, j), ...], "answer_ids": [...], ...}

One uncompressed Arrow IPC file per split: opening it memory-maps the file and reads nothing.
Format and why: docs/design/data.md, "The cache".
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from codi.infra.config import ConfigError
from codi.infra.files import atomic_path, file_sha256

SPLITS = ("train", "val", "test", "holdout")
CACHE_FORMAT_VERSION = 2

SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("source", pa.string()),
    ("problem_id", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("trace_ids", pa.list_(pa.int32())),
    ("span_starts", pa.list_(pa.int32())),   # i of each LINE frame: trace_ids[i] == <|line_sep|>
    ("span_ends", pa.list_(pa.int32())),     # j of each LINE frame: trace_ids[j] == <|action_sep|>
    ("answer_ids", pa.list_(pa.int32())),    # the no-trace target (codi.data.answers format) incl. eos
    ("answer", pa.string()),                 # repr of the entry call's return value
    ("program", pa.string()),
    ("call", pa.string()),
    ("trace_text", pa.string()),             # the explicit trace (no eos): truth frames for evaluation
    ("n_frames", pa.int32()),
    ("difficulty", pa.int32()),              # the source's level (synthetic: 1-3); 0 = ungraded
])


def split_of(problem_id: str, val_fraction: float, test_fraction: float, salt: str) -> str:
    """Stable split of a problem: a hash of (salt, problem id) mapped to [0, 1)."""
    h = int.from_bytes(hashlib.sha256(f"{salt}\0{problem_id}".encode()).digest()[:8], "big") / 2**64
    if h < test_fraction:
        return "test"
    if h < test_fraction + val_fraction:
        return "val"
    return "train"


def write_split(rows: list[dict[str, Any]], path: str | Path) -> str:
    """Write rows (dicts with SCHEMA's fields; `spans` as [(i, j)]) atomically; returns the file's sha256."""
    path = Path(path)
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    for r in rows:
        for name in SCHEMA.names:
            if name == "span_starts":
                cols[name].append([i for i, _ in r["spans"]])
            elif name == "span_ends":
                cols[name].append([j for _, j in r["spans"]])
            else:
                cols[name].append(r[name])
    table = pa.table(cols, schema=SCHEMA)
    with atomic_path(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        writer.write_table(table, max_chunksize=4096)
    return file_sha256(path)


def read_table(path: str | Path) -> pa.Table:
    """Memory-map a split (no copy, no decompression)."""
    source = pa.memory_map(str(path), "r")
    return pa.ipc.open_file(source).read_all()


class CacheDataset:
    """A split as a map-style dataset of codi-contract example dicts, read from the memory map.

    Works as a torch Dataset (len + getitem); `lengths` (prompt + trace tokens) serves length-grouped
    sampling without touching the token buffers."""

    def __init__(self, path: str | Path, limit: int = 0):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{self.path}: no such cache split (run the precompute stage)")
        self.table = read_table(self.path)
        if self.table.schema.names != SCHEMA.names:
            raise ConfigError(f"{self.path}: cache columns {self.table.schema.names} do not match this version's "
                             f"{SCHEMA.names}: rerun the precompute stage")
        if limit:
            self.table = self.table.slice(0, min(limit, self.table.num_rows))
        self._cols = {name: self.table.column(name) for name in SCHEMA.names}

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def lengths(self) -> list[int]:
        p = pc.list_value_length(self._cols["prompt_ids"])
        t = pc.list_value_length(self._cols["trace_ids"])
        return pc.add(p, t).to_pylist()

    def __getitem__(self, k: int) -> dict[str, Any]:
        if not 0 <= k < len(self):
            raise IndexError(k)
        c = self._cols

        def ids(name: str) -> list[int]:
            return c[name][k].values.to_numpy(zero_copy_only=False).tolist()

        return {
            "prompt_ids": ids("prompt_ids"),
            "trace_ids": ids("trace_ids"),
            "spans": list(zip(ids("span_starts"), ids("span_ends"))),
            "answer_ids": ids("answer_ids"),
            "sample_id": c["sample_id"][k].as_py(),
            "problem_id": c["problem_id"][k].as_py(),
            "source": c["source"][k].as_py(),
        }

    def column(self, name: str) -> list[Any]:
        """A whole column as Python values (e.g. `answer`, `trace_text` for evaluation)."""
        return self._cols[name].to_pylist()

    def __iter__(self) -> Iterable[dict[str, Any]]:
        return (self[k] for k in range(len(self)))


def check_tokenizer(tokenizer, cache_dir: str | Path, model_dir: str | Path) -> None:
    """A model's tokenizer must be the one that made the cache's token ids (their hash is in the manifest)."""
    import json

    from codi.tracing.tokens import tokenizer_sha256

    manifest = Path(cache_dir) / "manifest.json"
    try:
        want = json.loads(manifest.read_text()).get("tokenizer_sha256")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{manifest}: cannot read the cache manifest ({e}): run the precompute stage") from None
    if tokenizer_sha256(tokenizer) != want:
        raise ConfigError(f"{model_dir}: its tokenizer is not the one that made {manifest} (sha256 differs): the "
                         "token ids would mean other tokens; rerun precompute, or train from its models/base")
