"""The Hugging Face folders a stage starts from, loaded with one-line errors.

    model = load_causal_lm("models/sft", torch.float32)      # ConfigError if it is no causal LM
    check_model_folder("models/sft", made_by="sft")          # before loading a folder a stage wrote

A folder whose config is not a causal LM (an encoder, a vision model), or whose weights are missing, is an
error a user can fix: it names the folder, with transformers' first line of why. A folder a stage wrote is
checked first (check_model_folder): a truncated weights file or a garbled JSON file is an error naming that
file and the stage that rebuilds it, not a safetensors or tokenizers traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from codi.infra.config import ConfigError

_SAFETENSORS_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header: more is no safetensors file


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with a .safetensors file's frame (8-byte header length, JSON header, data), or None.

    The header's data_offsets say how long the data is: a file shorter than that was cut."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"truncated ({size} bytes, not even a safetensors header)"
        n = int.from_bytes(prefix, "little")
        if n > _SAFETENSORS_MAX_HEADER:
            return "not a safetensors file (no header length at its start)"
        if 8 + n > size:
            return f"truncated ({size} bytes; its header alone needs {8 + n})"
        try:
            header = json.loads(f.read(n))
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "not a safetensors file (its header is not the JSON of a tensor table)"
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"truncated ({size} of the {need} bytes its header describes)"
    if size > need:
        return f"corrupted ({size} bytes, but its header describes {need})"
    return None


def check_model_folder(path: str | Path, made_by: str) -> None:
    """A model folder that stage `made_by` wrote, checked before loading: its config.json, every JSON file and
    every .safetensors file whole. ConfigError naming the folder or file and how to rebuild it."""
    path = Path(path)
    rebuild = f"rebuild it: dvc repro {made_by} (or python -m codi {made_by})"
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path}: no config.json: not a complete model folder; {rebuild}")
    for f in sorted(path.glob("*.json")):
        try:
            value = json.loads(f.read_text())
        except (ValueError, OSError) as e:
            raise ConfigError(f"{f}: not valid JSON ({e}); {rebuild}") from None
        if f.name == "config.json" and not (isinstance(value, dict) and "model_type" in value):
            raise ConfigError(f"{f}: not a model config (a JSON object with a model_type); {rebuild}")
    weights = sorted(path.glob("*.safetensors"))
    if not any(f.name.startswith("model") for f in weights) and not any(path.glob("pytorch_model*.bin")):
        raise ConfigError(f"{path}: no weights file (model.safetensors); {rebuild}")
    for f in weights:
        if (problem := _safetensors_problem(f)) is not None:
            raise ConfigError(f"{f}: {problem}; {rebuild}")


def load_causal_lm(path: str | Path, dtype: Any):
    """AutoModelForCausalLM.from_pretrained(path, dtype=dtype); ConfigError naming `path` if it cannot be one."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: not a causal LM that transformers can load ({why})") from None
