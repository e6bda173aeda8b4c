"""Load the samples of one source: the extract stage's single entry point into `codi.sources`.

    from codi.sources.registry import load_samples
    load = load_samples("mbpp", params.extract)                    # path from extract.paths.mbpp
    load = load_samples("mbpp", params.extract, path="hf:google-research-datasets/mbpp:test")
    load.samples, load.skipped, load.unchecked

A source is a module of codi.sources found by its name (codi.schemas.source_names), never listed here. What
a source module defines (docs/design/sources.md, "Adding a source"):
- a generated source: `NAME` and `generate(cfg)`, cfg being the section `extract.<NAME>`;
- a file source: `NAME`, `FIELDS` (field -> (types, required), checked here) and `harvest(record) -> Harvest`
  (or `harvester()` returning one per file), optionally `check_record(record)` and `default_path()`; it reads
  JSON Lines (optionally gzipped) or `hf:<id>[:<split>]` from `extract.paths.<NAME>`.
A malformed line raises `DatasetError` naming the file, line and field (a `SkippedRecord` under
`extract.skip_bad_lines`).
"""

from __future__ import annotations

import gzip
import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from codi.schemas.extract import ExtractConfig
from codi.schemas.source_names import source_names
from codi.sources.asserts import Harvest
from codi.sources.base import DatasetError, Sample

# Sources are imported by name at run time: codi.infra.provenance counts every module of this package as imported
# by this one (the extract stage's code deps).
PLUGIN_PACKAGE = "codi.sources"
HF_PREFIX = "hf:"
_TYPE_NAMES = {str: "a string", int: "an integer", list: "a list of strings"}


@dataclass(frozen=True)
class SkippedRecord:
    """A record (or part of one) that yields no sample: where ("file:line") and why."""

    where: str
    why: str
    bad_line: bool = False  # a malformed line skipped under extract.skip_bad_lines


@dataclass(frozen=True)
class SourceLoad:
    """What a source gave: its samples, what yielded none, and why some samples have no `expected`."""

    samples: list[Sample]
    skipped: list[SkippedRecord]
    unchecked: dict[str, str] = field(default_factory=dict)  # sample_id -> why expected is None

    @property
    def n_bad_lines(self) -> int:
        return sum(s.bad_line for s in self.skipped)


def source_module(name: str) -> ModuleType:
    """The module of source `name`; DatasetError naming the known ones if there is none."""
    names = source_names()
    if name not in names:
        raise DatasetError(f"unknown source {name!r}: expected one of {', '.join(names)}")
    return importlib.import_module(f"{PLUGIN_PACKAGE}.{name}")


def is_generated(module: ModuleType) -> bool:
    """A generated source (`generate(cfg)`), not a file source."""
    return hasattr(module, "generate")


def load_samples(source: str, cfg: ExtractConfig, path: str | None = None) -> SourceLoad:
    """All samples of `source`; `path` overrides `cfg.paths[source]` (and the source's default_path)."""
    module = source_module(source)
    if is_generated(module):
        if path:
            raise DatasetError(f"source {source} is generated (extract.{source}), it reads no path ({path!r})")
        return SourceLoad(samples=module.generate(getattr(cfg, source)), skipped=[])
    if path is None:
        path = cfg.paths.get(source) or (module.default_path() if hasattr(module, "default_path") else "")
    if not path:
        raise DatasetError(f"source {source}: no path: set extract.paths.{source} in params.yaml "
                           f"or pass --path (a jsonl file or hf:<dataset id>[:<split>])")
    harvest: Callable[[dict[str, Any]], Harvest] = module.harvester() if hasattr(module, "harvester") else module.harvest
    return _load(path, module, harvest, cfg.skip_bad_lines)


def _load(path: str, module: ModuleType, harvest: Callable[[dict[str, Any]], Harvest],
          skip_bad_lines: bool) -> SourceLoad:
    samples: list[Sample] = []
    skipped: list[SkippedRecord] = []
    unchecked: dict[str, str] = {}
    first_seen: dict[str, str] = {}
    check_record = getattr(module, "check_record", None)
    for where, rec in _records(path):
        try:
            if isinstance(rec, DatasetError):
                raise rec
            _check_fields(rec, module.FIELDS, where)
            problem = check_record(rec) if check_record else None
            if problem:
                raise DatasetError(f"{where}: {problem}")
            got = harvest(rec)
            for s in got.samples:
                if s.sample_id in first_seen:
                    raise DatasetError(f"{where}: sample id {s.sample_id} was already made by "
                                       f"{first_seen[s.sample_id]} (a repeated record id?)")
        except DatasetError as e:
            if not skip_bad_lines:
                raise
            skipped.append(SkippedRecord(where, str(e).removeprefix(f"{where}: "), bad_line=True))
            continue
        for s in got.samples:
            first_seen[s.sample_id] = where
        samples.extend(got.samples)
        skipped.extend(SkippedRecord(where, why) for why in got.skipped)
        unchecked.update(got.unchecked)
    return SourceLoad(samples=samples, skipped=skipped, unchecked=unchecked)


def _check_fields(rec: dict[str, Any], fields: dict[str, tuple[tuple[type, ...], bool]], where: str) -> None:
    for name, (types, required) in fields.items():
        if name not in rec or rec[name] is None:
            if required:
                raise DatasetError(f"{where}: missing field {name!r}")
            continue
        value = rec[name]
        ok = isinstance(value, types) and not isinstance(value, bool)
        if ok and isinstance(value, list):
            ok = all(isinstance(v, str) for v in value)
        if not ok:
            expected = " or ".join(_TYPE_NAMES[t] for t in types)
            raise DatasetError(f"{where}: field {name!r}: expected {expected}, got {_describe(value, types)}")


def _describe(value: Any, types: tuple[type, ...]) -> str:
    if isinstance(value, list) and list in types:
        bad = next(v for v in value if not isinstance(v, str))
        return f"a list holding {type(bad).__name__} {bad!r}"[:120]
    return f"{type(value).__name__} {value!r}"[:120]


def _records(path: str) -> Iterator[tuple[str, dict[str, Any] | DatasetError]]:
    """(where, record) for every record; a malformed line comes as a DatasetError to raise or skip."""
    if path.startswith(HF_PREFIX):
        yield from _hub_records(path)
        return
    file = Path(path)
    try:
        raw = gzip.open(file, "rt", encoding="utf-8") if file.suffix == ".gz" else file.open(encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"{path}: cannot read dataset: {e.strerror or e}") from None
    with raw:
        try:
            for lineno, line in enumerate(raw, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    rec = json.loads(line.strip())
                except json.JSONDecodeError as e:
                    yield where, DatasetError(f"{where}: bad JSON: {e.msg} (column {e.colno})")
                    continue
                if not isinstance(rec, dict):
                    yield where, DatasetError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
                    continue
                yield where, rec
        except (UnicodeDecodeError, OSError, EOFError) as e:
            raise DatasetError(f"{path}: cannot read dataset: {e}") from None


def parse_hub_path(path: str) -> tuple[str, str | None]:
    """`hf:<dataset id>[:<split>]` -> (dataset id, split or None)."""
    spec = path.removeprefix(HF_PREFIX)
    dataset_id, sep, split = spec.partition(":")
    if not dataset_id or ":" in split or (sep and not split):
        raise DatasetError(f"{path}: expected hf:<dataset id>[:<split>], e.g. hf:google-research-datasets/mbpp:test")
    return dataset_id, split or None


def _hub_records(path: str) -> Iterator[tuple[str, dict[str, Any] | DatasetError]]:
    dataset_id, split = parse_hub_path(path)
    try:
        import datasets

        loaded = datasets.load_dataset(dataset_id, split=split)
    except Exception as e:  # noqa: BLE001 - offline, unknown id, bad split: all one clear message
        raise DatasetError(f"{path}: cannot load {dataset_id!r} from the Hugging Face hub "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}). "
                           f"Offline? Download it once and set a local jsonl path instead.") from None
    splits = [(split, loaded)] if split else list(loaded.items())
    for name, rows in splits:
        for i, row in enumerate(rows):
            yield f"{HF_PREFIX}{dataset_id}:{name}:{i}", dict(row)
