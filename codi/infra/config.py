"""How params.yaml is read: one typed, frozen dataclass per section, loaded and validated once.

    from codi.infra.config import load_params
    params = load_params("params.yaml")      # codi.schemas.params.Params: .extract, .precompute, .model, .sft, ...
    params.codi.latent_steps, params.gamma

The sections' schemas live one module each in codi/schemas/ (codi/schemas/params.py puts them together), so that a
stage depends only on the schemas of the sections it reads (dvc.yaml). This module is the machinery they
share: `option()` declares a field, `build()` checks a mapping against a dataclass.

Every key must be known, present, of the declared type and in range; a bad value fails before any work,
naming its dotted key (`params.yaml: sft.lr = -0.001: expected a float > 0`). Floats such as `1e-3` are
floats, as DVC (YAML 1.2) reads them; PyYAML's YAML 1.1 resolver alone would read them as strings.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import re
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

# The whole file's schema, imported by name: checking the other sections can stop a stage before any work,
# but never change its result, so they are not code dependencies of it (codi/infra/provenance.py follows imports).
PARAMS_SCHEMA = "codi.schemas.params:Params"


class UserError(ValueError):
    """An error the user can fix: a bad params value, dataset line, missing file, a folder that is not the model
    it should be. `python -m codi` prints it as one `error: ...` line naming the file, line or key, and exits 2."""


class ConfigError(UserError):
    """A params file or value that does not match the schema, or a value only wrong in context (a missing model,
    an empty split, a cache of another tokenizer)."""


def option(doc: str, **checks: Any) -> Any:
    """A dataclass field with a one-line doc and checks: ge, gt, le, lt, choices (a tuple, or a function
    returning one), nonempty.

    No defaults: params.yaml is the one place a value is set (a default here could disagree with it)."""
    return field(metadata={"doc": doc, **checks})


# --------------------------------------------------------------------------------------- loading
class _Loader(yaml.SafeLoader):
    """SafeLoader that reads YAML 1.2 floats (`1e-3`, `.5e2`) as floats, as DVC does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def yaml_value(text: str) -> Any:
    """YAML text read as DVC and params.yaml read it (YAML 1.2 floats: `1e-3` is a float)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - SafeLoader subclass


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file with the project's float rules; a syntax error names the file and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read params file: {e.strerror}") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None


def params_schema() -> type:
    """codi.schemas.params.Params, the schema of the whole file."""
    module, _, name = PARAMS_SCHEMA.partition(":")
    return getattr(importlib.import_module(module), name)


def load_params(path: str | Path = "params.yaml") -> Any:
    """Load and validate the whole params file (a codi.schemas.params.Params)."""
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    return build(params_schema(), raw, prefix="", source=str(path))


def params_from_dict(raw: dict[str, Any], source: str = "<params>") -> Any:
    """Validate an in-memory params mapping (tests, notebooks)."""
    return build(params_schema(), raw, prefix="", source=source)


def sections(params: Any, view: type) -> Any:
    """The sections of a loaded Params that `view` (a stage's dataclass of what it reads) names."""
    return view(**{f.name: getattr(params, f.name) for f in dataclasses.fields(view)})


def build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    """Build dataclass `cls` from `raw`, checking keys, types and ranges; every field must be present."""
    where = prefix.rstrip(".") or "top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} = {raw!r}: expected a mapping")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{source}: unknown key {prefix}{unknown[0]}: expected one of {sorted(fields)}")
    missing = [n for n in fields if n not in raw]
    if missing:
        raise ConfigError(f"{source}: missing key {prefix}{missing[0]} ({_type_name(hints[missing[0]])}): "
                          f"every parameter must be set in the params file")
    values = {}
    for name, value in raw.items():
        values[name] = _convert(hints[name], value, f"{prefix}{name}", source, fields[name].metadata)
    try:
        return cls(**values)
    except ConfigError as e:
        # A check across fields names them bare ("quantize = ..."): a nested section gets its dotted prefix,
        # so a type used in several sections (sft.lora, codi.lora) still names the key the user wrote.
        msg = str(e)
        if prefix and msg.split(" ", 1)[0] in fields:
            msg = prefix + msg
        raise ConfigError(f"{source}: {msg}") from None


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    if origin is dict:
        return f"dict[{', '.join(_type_name(a) for a in get_args(tp))}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _choices(meta: typing.Mapping[str, Any]) -> tuple[Any, ...] | None:
    choices = meta.get("choices")
    return tuple(choices()) if callable(choices) else choices


def _convert(tp: Any, value: Any, key: str, source: str, meta: typing.Mapping[str, Any]) -> Any:
    def fail(expected: str) -> typing.NoReturn:
        raise ConfigError(f"{source}: {key} = {value!r}: expected {expected}")

    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, prefix=f"{key}.", source=source)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, key, source, meta)
    if origin is Literal:
        if value not in get_args(tp):
            fail(f"one of {', '.join(repr(a) for a in get_args(tp))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            fail(f"a list of {_type_name(get_args(tp)[0])}")
        item_tp = get_args(tp)[0]
        items = [_convert(item_tp, v, f"{key}[{i}]", source, {}) for i, v in enumerate(value)]
        if meta.get("nonempty") and not items:
            fail("a non-empty list")
        choices = _choices(meta)
        if choices is not None:
            bad = [v for v in items if v not in choices]
            if bad:
                fail(f"items from {list(choices)} (bad: {bad[0]!r})")
        if len(set(map(repr, items))) != len(items):
            fail("a list without repeated items")
        return items
    if origin is dict:  # keys from `choices` (when given), values of the declared type
        key_tp, value_tp = get_args(tp)
        if not isinstance(value, dict):
            fail(f"a mapping of {_type_name(key_tp)} to {_type_name(value_tp)}")
        choices = _choices(meta)
        out = {}
        for k, v in value.items():
            if not isinstance(k, key_tp) or (choices is not None and k not in choices):
                raise ConfigError(f"{source}: unknown key {key}.{k}: expected one of {sorted(choices or ())}")
            out[k] = _convert(value_tp, v, f"{key}.{k}", source, {})
        return out
    if tp is bool:
        if not isinstance(value, bool):
            fail("true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail("an integer" + _range_text(meta))
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail("a float" + _range_text(meta))
        value = float(value)
        if value != value:
            fail("a float, not nan")
    elif tp is str:
        if not isinstance(value, str):
            fail("a string")
        if meta.get("nonempty") and not value:
            fail("a non-empty string")
    else:  # pragma: no cover - schema error, not user error
        raise TypeError(f"unsupported config type {tp} for {key}")
    _check_range(value, meta, fail)
    return value


def _range_text(meta: typing.Mapping[str, Any]) -> str:
    parts = [f"{op} {meta[k]}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if k in meta]
    return (" " + " and ".join(parts)) if parts else ""


def _check_range(value: Any, meta: typing.Mapping[str, Any], fail: Any) -> None:
    kind = "an integer" if isinstance(value, int) else "a float"
    if ("ge" in meta and value < meta["ge"]) or ("gt" in meta and value <= meta["gt"]) \
            or ("le" in meta and value > meta["le"]) or ("lt" in meta and value >= meta["lt"]):
        fail(kind + _range_text(meta))


# ------------------------------------------------------------------------------------- reporting
def to_dict(obj: Any) -> Any:
    """A config (or part) as plain YAML-able data (for logging, wandb config and manifests)."""
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"codi": {"lr": 1e-3}} -> {"codi.lr": 1e-3}: nested mappings as dotted keys; lists stay values."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def get_dotted(data: Any, dotted: str, default: Any = None) -> Any:
    """data["a"]["b"] for "a.b" (list items as "a.0"); `default` if a part is absent."""
    cur: Any = data
    for part in dotted.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return default
    return cur


def set_dotted(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` with each dotted key of `overrides` set; a key that is not already there is a KeyError
    naming it (an override never adds a key: params.yaml has every key)."""
    out = copy.deepcopy(data)
    for key, value in overrides.items():
        node = out
        *path, last = key.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                raise KeyError(key)
            node = node[part]
        if last not in node:
            raise KeyError(key)
        node[last] = value
    return out


def describe(cls: type | None = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, doc) for every field of `cls` (default: the whole file): the reference table."""
    cls = cls or params_schema()
    rows = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", _type_name(tp), f.metadata.get("doc", "")))
    return rows
