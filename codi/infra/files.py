"""Atomic file writes and content digests: a kill mid-write never leaves a complete-looking output.

    with atomic_path("data/traces/mbpp.parquet") as tmp: pq.write_table(table, tmp)
    with atomic_paths(["data/cache/train.arrow", "data/cache/manifest.json"]) as tmps: ...   # all or none
    with atomic_dir("models/sft") as tmp: model.save_pretrained(tmp)
    write_json("metrics/sft.json", summary); file_sha256("data/cache/train.arrow")

A write that fills the disk (ENOSPC, or a quota) ends in DiskFullError, a UserError naming the path: the
temporary file or folder is removed and the previous output, if any, is left as it was.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Sequence

from codi.infra.config import UserError

# What a full disk looks like: the errno of Python's own writes, or the OS's sentence inside the message of a
# library that writes by itself (pyarrow, safetensors) and keeps no errno.
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_WORDS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


class DiskFullError(UserError):
    """A write that found no space left on the device; the message names the output it was writing (`path`)."""

    def __init__(self, path: Path, kind: str):
        self.path = path
        super().__init__(f"{path}: no space left on the device while writing this {kind}; nothing was replaced "
                         "(an earlier complete version, if any, is unchanged): free some space and rerun the stage")


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, says the disk (or the user's quota) is full."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS:
            return True
        if any(words in str(e) for words in _DISK_FULL_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


def temporary_sibling(path: str | Path) -> Path:
    """Where atomic_path / atomic_dir write `path` before it replaces the output (hidden, this process's own)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary sibling of `path` to write to; it replaces `path` only when the block ends normally."""
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        tmp.replace(path)
    except Exception as e:
        # A DiskFullError of a write nested in this one names that write's path: this one's when the nested write
        # wrote `tmp` (atomic_paths' caller writing through write_split), its own otherwise.
        if (e.path == tmp) if isinstance(e, DiskFullError) else is_disk_full(e):
            raise DiskFullError(path, "file") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_paths(paths: Sequence[str | Path]) -> Iterator[list[Path]]:
    """Temporary siblings of files that belong together (a cache's splits and its manifest, last): they replace
    the files, the last one last, only when the block ends normally; otherwise none is replaced."""
    with contextlib.ExitStack() as stack:
        # entered from the last: the stack leaves (and so replaces) the first path first and the last path last
        tmps = [stack.enter_context(atomic_path(p)) for p in reversed(paths)][::-1]
        yield tmps


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """A temporary sibling folder to fill; it replaces the folder `path` only when the block ends normally."""
    path = Path(path)
    tmp = temporary_sibling(path)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # a file written inside (DiskFullError) named its temporary path: the folder is what the user knows
        if isinstance(e, DiskFullError) or is_disk_full(e):
            raise DiskFullError(path, "folder") from None
        raise
    if path.exists():
        shutil.rmtree(path)
    tmp.replace(path)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: Any, sort_keys: bool = False) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
