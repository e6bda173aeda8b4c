"""The example cache: split assignment, writing, and memory-mapped loading for the training stages.

    split_of("mbpp/11", val_fraction=0.1, test_fraction=0.1, salt="codi-trace")  # "train" | "val" | "test"
    write_split(rows, "data/cache/train.arrow")
    ds = CacheDataset("data/cache/train.arrow")      # torch Dataset of codi-contract dicts
    ds[0] -> {"prompt_ids": [...], "trace_ids": [...], "spans": [(i, j), ...], "answer_ids": [...], ...}
    verify_split("data/cache/val.arrow")             # what CacheDataset checks first (ConfigError naming the file)

One uncompressed Arrow IPC file per split: opening it memory-maps the file and reads nothing. Before that,
CacheDataset checks the file against the sha256 that the cache's manifest.json records for it (once per
process and file version): a truncated, edited or foreign file is an error naming it, not a pyarrow traceback.
Format and why: docs/design/data.md, "The cache".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from codi.infra.config import ConfigError
from codi.infra.files import atomic_path, file_sha256

SPLITS = ("train", "val", "test", "holdout")
CACHE_FORMAT_VERSION = 2
MANIFEST = "manifest.json"
REBUILD = "rebuild the cache: dvc repro precompute (or python -m codi precompute)"
ARROW_MAGIC = b"ARROW1"  # an Arrow IPC file starts with it (then 2 bytes of padding) and ends with it

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
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid as e:  # a file CacheDataset was told not to verify
        raise ConfigError(f"{path}: not a readable Arrow file ({e}): {REBUILD}") from None


def read_manifest(cache_dir: str | Path) -> dict[str, Any]:
    """The cache's manifest.json (written last by precompute); a missing, unreadable or older one is a
    ConfigError naming it."""
    f = Path(cache_dir) / MANIFEST
    try:
        raw = json.loads(f.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{f}: missing: the cache has no manifest to check its files against; {REBUILD}") from None
    except OSError as e:
        raise ConfigError(f"{f}: cannot read the cache manifest ({e.strerror}); {REBUILD}") from None
    except ValueError as e:
        raise ConfigError(f"{f}: the cache manifest is not valid JSON ({e}); {REBUILD}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{f}: the cache manifest is not a JSON object; {REBUILD}")
    if raw.get("format_version") != CACHE_FORMAT_VERSION:
        raise ConfigError(f"{f}: cache format_version {raw.get('format_version')!r}, this version reads "
                          f"{CACHE_FORMAT_VERSION}; {REBUILD}")
    return raw


def _arrow_problem(path: Path, size: int) -> str | None:
    """What is wrong with the file's frame, seen from its first and last bytes (None: it looks whole)."""
    if size == 0:
        return "empty"
    with open(path, "rb") as f:
        head = f.read(len(ARROW_MAGIC))
        f.seek(max(0, size - len(ARROW_MAGIC)))
        tail = f.read()
    if head != ARROW_MAGIC:
        return "not an Arrow file (it does not start with the Arrow magic bytes)"
    if tail != ARROW_MAGIC or size < 2 * len(ARROW_MAGIC) + 2:
        return f"truncated ({size} bytes; its end holds no Arrow footer)"
    return None


_verified: set[tuple[str, int, int, str]] = set()  # (file, size, mtime, sha256 wanted): hashed once per process


def verify_split(path: str | Path) -> None:
    """Check a cache split against the sha256 its folder's manifest records; ConfigError naming the file (and
    what rebuilds it) when it is truncated, not an Arrow file, or not the file precompute wrote."""
    path = Path(path)
    manifest = read_manifest(path.parent)
    entry = manifest.get("splits", {}).get(path.stem) if isinstance(manifest.get("splits"), dict) else None
    want = entry.get("sha256") if isinstance(entry, dict) else None
    if not isinstance(want, str):
        raise ConfigError(f"{path.parent / MANIFEST}: records no sha256 for {path.name}; {REBUILD}")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, want)
    if key in _verified:
        return
    if (problem := _arrow_problem(path, stat.st_size)) is not None:
        raise ConfigError(f"{path}: {problem}; {REBUILD}")
    got = file_sha256(path)
    if got != want:
        raise ConfigError(f"{path}: hash mismatch with the manifest: sha256 {got[:12]}.. but {path.parent / MANIFEST} "
                          f"records {want[:12]}.. (the file changed after precompute wrote it); {REBUILD}")
    _verified.add(key)


class CacheDataset:
    """A split as a map-style dataset of codi-contract example dicts, read from the memory map.

    Works as a torch Dataset (len + getitem); `lengths` (prompt + trace tokens) serves length-grouped
    sampling without touching the token buffers. `verify` checks the file against its folder's manifest first
    (verify_split); only a split written outside a cache (a test of the reader itself) goes without."""

    def __init__(self, path: str | Path, limit: int = 0, verify: bool = True):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{self.path}: no such cache split (run the precompute stage)")
        if verify:
            verify_split(self.path)
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
    from codi.tracing.tokens import tokenizer_sha256

    manifest = Path(cache_dir) / MANIFEST
    want = read_manifest(cache_dir).get("tokenizer_sha256")
    if tokenizer_sha256(tokenizer) != want:
        raise ConfigError(f"{model_dir}: its tokenizer is not the one that made {manifest} (sha256 differs): the "
                         "token ids would mean other tokens; rerun precompute, or train from its models/base")
