"""Saving and loading a trained codi model as one self-describing folder.

    save_codi_model(model, tokenizer, "models/codi", extra={"step": 1200})
    loaded = load_codi_model("models/codi", device="cuda", dtype=torch.bfloat16)
    loaded.model, loaded.projector, loaded.tokenizer, loaded.config.latent_steps

The folder holds the base model in HF format (`save_pretrained`, safetensors: a tied lm_head is
stored once and re-tied on load), the tokenizer, `thought_projector.safetensors` and
`codi_config.json` (latent_steps, KD settings, loss weights, token ids, and the caller's `extra`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from codi.files import write_json
from codi.modeling.latent import build_projector
from codi.modeling.model import CodiModel
from codi.tokens import TraceTokenIds, load_tokenizer, token_ids

CODI_CONFIG = "codi_config.json"
PROJECTOR_FILE = "thought_projector.safetensors"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CodiArtifactConfig:
    """What `codi_config.json` records about a saved codi model."""

    latent_steps: int
    hidden_size: int
    kd_target: str
    kd_layers: list[int] | None
    kd_temp: float
    single_anchor: bool
    frozen_teacher: bool
    teacher_ce_weight: float
    student_ce_weight: float
    kd_weight: float
    token_ids: TraceTokenIds
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadedCodi:
    """A loaded codi model: the base causal LM, its thought projector, tokenizer and config (eval mode)."""

    model: nn.Module
    projector: nn.Module
    tokenizer: Any
    config: CodiArtifactConfig


def save_codi_model(model: CodiModel, tokenizer: Any, out_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write `model` (base + projector), `tokenizer` and codi_config.json into `out_dir`; returns it."""
    if not isinstance(model, CodiModel):
        raise ValueError(f"save_codi_model: expected a CodiModel (unwrap DDP with .module), got {type(model).__name__}")
    extra = dict(extra or {})
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_codi_model: extra must be JSON-serializable: {e}") from None
    if token_ids(tokenizer) != model.token_ids:
        raise ValueError("save_codi_model: the tokenizer's trace token ids differ from the model's token_ids")
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.projector.state_dict().items()}, str(out / PROJECTOR_FILE))
    cfg = {
        "format_version": FORMAT_VERSION,
        "latent_steps": model.latent_steps,
        "hidden_size": model.model.config.get_text_config().hidden_size,
        "kd_target": model.kd_target, "kd_layers": model.kd_layers_arg, "kd_temp": model.kd_temp,
        "single_anchor": model.single_anchor, "frozen_teacher": model.frozen_teacher is not None,
        "teacher_ce_weight": model.teacher_ce_weight, "student_ce_weight": model.student_ce_weight,
        "kd_weight": model.kd_weight, "token_ids": model.token_ids.as_dict(), "extra": extra,
    }
    write_json(out / CODI_CONFIG, cfg, sort_keys=True)  # written last: its presence marks a complete folder
    return out


def read_codi_config(path: str | Path) -> CodiArtifactConfig:
    """Parse and check `<path>/codi_config.json`; errors name the file and key."""
    f = Path(path) / CODI_CONFIG
    try:
        raw = json.loads(f.read_text())
    except OSError as e:
        raise ValueError(f"{f}: cannot read the codi config ({e.strerror}); is {path} a saved codi model?") from None
    except ValueError as e:
        raise ValueError(f"{f}: invalid JSON: {e}") from None
    if raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{f}: format_version = {raw.get('format_version')!r}: expected {FORMAT_VERSION}")
    names = [n for n in CodiArtifactConfig.__dataclass_fields__ if n != "extra"]
    missing = [n for n in names if n not in raw]
    if missing:
        raise ValueError(f"{f}: missing key {missing[0]}")
    try:
        ids = TraceTokenIds(**raw["token_ids"])
    except TypeError as e:
        raise ValueError(f"{f}: token_ids: {e}") from None
    return CodiArtifactConfig(**{n: raw[n] for n in names if n != "token_ids"}, token_ids=ids,
                              extra=raw.get("extra", {}))


def load_codi_model(path: str | Path, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None) -> LoadedCodi:
    """Load a folder written by `save_codi_model`. dtype None keeps the saved dtype; device None = CPU."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = Path(path)
    cfg = read_codi_config(path)
    tok = load_tokenizer(path)
    if token_ids(tok) != cfg.token_ids:
        raise ValueError(f"{path / CODI_CONFIG}: token_ids differ from the saved tokenizer's")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype is not None else "auto")
    if device is not None:
        model.to(device)
    model.eval()
    ref = model.get_input_embeddings().weight
    if model.config.get_text_config().hidden_size != cfg.hidden_size:
        raise ValueError(f"{path / CODI_CONFIG}: hidden_size = {cfg.hidden_size}, but the model has "
                         f"{model.config.get_text_config().hidden_size}")
    projector = build_projector(cfg.hidden_size, dtype=ref.dtype, device=ref.device)
    try:
        state = load_file(str(path / PROJECTOR_FILE))
    except OSError as e:
        raise ValueError(f"{path / PROJECTOR_FILE}: cannot read the projector: {e}") from None
    projector.load_state_dict({k: v.to(dtype=ref.dtype) for k, v in state.items()})
    projector.eval()
    return LoadedCodi(model=model, projector=projector, tokenizer=tok, config=cfg)
