"""Saving and loading a trained codi model as one self-describing folder.

    save_codi_model(model, tokenizer, "models/codi", extra={"step": 1200})
    loaded = load_codi_model("models/codi", device="cuda", dtype=torch.bfloat16)
    loaded.model, loaded.projector, loaded.tokenizer, loaded.config.latent_steps

The folder holds the base model in HF format (`save_pretrained`, safetensors: a tied lm_head is
stored once and re-tied on load), the tokenizer, `thought_projector.safetensors` and
`codi_config.json` (latent_steps, KD settings, loss weights, the options beyond the reference, token ids, and
the caller's `extra`). A config key this version does not know is refused: the model was trained with an
option that the loader cannot honour. The auxiliary reconstruction decoder (recon_decoder copy) is not saved.
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
from codi.modeling.model import KD_NORMS, KD_TARGETS, RECON_DECODERS, CodiModel
from codi.modeling.plan import KD_POSITIONS
from codi.tokens import TraceTokenIds, load_tokenizer, token_ids

CODI_CONFIG = "codi_config.json"
PROJECTOR_FILE = "thought_projector.safetensors"
FORMAT_VERSION = 2
# Version 1 folders predate these options: they were trained with the reference's behaviour.
V1_DEFAULTS = {"kd_norm": "none", "kd_positions": "action_sep", "recon_weight": 0.0, "recon_decoder": "shared",
               "latent_curriculum_frac": 0.0, "mix_explicit_prob": 0.0}


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
    kd_norm: str
    kd_positions: str
    recon_weight: float
    recon_decoder: str
    latent_curriculum_frac: float
    mix_explicit_prob: float
    token_ids: TraceTokenIds
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadedCodi:
    """A loaded codi model: the base causal LM, its thought projector, tokenizer and config (eval mode)."""

    model: nn.Module
    projector: nn.Module
    tokenizer: Any
    config: CodiArtifactConfig


def save_codi_model(model: CodiModel, tokenizer: Any, out_dir: str | Path, extra: dict[str, Any] | None = None,
                    curriculum: tuple[float, float] = (0.0, 0.0)) -> Path:
    """Write `model` (base + projector), `tokenizer` and codi_config.json into `out_dir`; returns it.
    `curriculum`: (latent_curriculum_frac, mix_explicit_prob) it was trained with (a schedule, not the model's)."""
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
        "kd_norm": model.kd_norm, "kd_positions": model.kd_positions, "recon_weight": model.recon_weight,
        "recon_decoder": model.recon_decoder, "latent_curriculum_frac": float(curriculum[0]),
        "mix_explicit_prob": float(curriculum[1]),
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
    version = raw.get("format_version")
    if version not in (1, FORMAT_VERSION):
        raise ValueError(f"{f}: format_version = {version!r}: expected {FORMAT_VERSION} (or 1)")
    if version == 1:
        raw = {**V1_DEFAULTS, **raw}
    names = [n for n in CodiArtifactConfig.__dataclass_fields__ if n != "extra"]
    missing = [n for n in names if n not in raw]
    if missing:
        raise ValueError(f"{f}: missing key {missing[0]}")
    unknown = sorted(set(raw) - set(names) - {"format_version", "extra"})
    if unknown:
        raise ValueError(f"{f}: unknown option {unknown[0]!r}: the model was trained with an option this version "
                         "does not know; load it with the codi-trace version that wrote it")
    for key, allowed in (("kd_target", KD_TARGETS), ("kd_norm", KD_NORMS), ("kd_positions", KD_POSITIONS),
                         ("recon_decoder", RECON_DECODERS)):
        if raw[key] not in allowed:
            raise ValueError(f"{f}: {key} = {raw[key]!r}: this version knows {', '.join(allowed)}")
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
