"""Saving and loading a trained codi model as one self-describing folder.

    save_codi_model(model, tokenizer, "models/codi", extra={"step": 1200})
    loaded = load_codi_model("models/codi", device="cuda", dtype=torch.bfloat16)
    loaded.model, loaded.projector, loaded.tokenizer, loaded.config.options.latent_steps

The folder holds the base model in HF format (`save_pretrained`, safetensors: a tied lm_head is
stored once and re-tied on load), the tokenizer, `thought_projector.safetensors` and `codi_config.json`:
every field of CodiOptions and LossWeights (codi/schemas/options.py) as a top-level key, the hidden size,
whether a frozen teacher was used, the token ids and the caller's `extra`. Reading checks the options with
the same declarations as params.yaml. A key this version does not know is refused: the model was trained
with an option that the loader cannot honour. The auxiliary reconstruction decoder (recon_decoder copy) is
not saved here (codi.training.codi_trainer adds it to checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from codi.infra.config import ConfigError, build
from codi.infra.files import write_json
from codi.infra.hf import load_causal_lm
from codi.modeling.latent import build_projector
from codi.modeling.model import CodiModel
from codi.schemas.options import CodiOptions, LossWeights
from codi.tracing.tokens import TraceTokenIds, load_tokenizer, token_ids

CODI_CONFIG = "codi_config.json"
PROJECTOR_FILE = "thought_projector.safetensors"
FORMAT_VERSION = 7
# A folder of an older format predates some options: it was trained with their reference behaviour.
_CURRICULUM_OPTIONS = {"unit_stage_steps": 0}  # format 7 (research VI, the unit curriculum)
_CALL_OPTIONS = {"latent_call": False, **_CURRICULUM_OPTIONS}  # format 6 (research VI, the latent call frame)
_UNIT_OPTIONS = {"latent_unit": "locals", "frames_per_block": 1, **_CALL_OPTIONS}  # format 5 (research VI)
_VALUE_OPTIONS = {"value_weight": 0.0, "value_feedback": "none", "value_kd_weight": 0.0,  # format 4 (research IV)
                  "stage_steps": 0, "stage_reset_optimizer": False, "stage_smoothing": 0.0, "stage_mix_prob": 0.0,
                  **_UNIT_OPTIONS}
OLDER_DEFAULTS = {
    1: {"kd_norm": "none", "kd_positions": "action_sep", "recon_weight": 0.0, "recon_decoder": "shared",
        "latent_curriculum_frac": 0.0, "mix_explicit_prob": 0.0, "projector_dropout": 0.0, **_VALUE_OPTIONS},
    2: {"projector_dropout": 0.0, **_VALUE_OPTIONS},
    3: dict(_VALUE_OPTIONS),
    4: dict(_UNIT_OPTIONS),
    5: dict(_CALL_OPTIONS),
    6: dict(_CURRICULUM_OPTIONS),
}
_OPTION_KEYS = tuple(f.name for f in dataclasses.fields(CodiOptions))
_WEIGHT_KEYS = tuple(f.name for f in dataclasses.fields(LossWeights))
_RECORD_KEYS = ("hidden_size", "frozen_teacher", "token_ids")  # and format_version, extra


@dataclass(frozen=True)
class SavedCodiConfig:
    """What `codi_config.json` records about a saved codi model."""

    options: CodiOptions
    weights: LossWeights
    hidden_size: int
    frozen_teacher: bool          # trained against a frozen teacher (the teacher is not saved)
    token_ids: TraceTokenIds
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadedCodi:
    """A loaded codi model: the base causal LM, its thought projector, tokenizer and config (eval mode)."""

    model: nn.Module
    projector: nn.Module
    tokenizer: Any
    config: SavedCodiConfig


def save_codi_model(model: CodiModel, tokenizer: Any, out_dir: str | Path, extra: dict[str, Any] | None = None,
                    base: nn.Module | None = None, projector_state: dict[str, Any] | None = None) -> Path:
    """Write `model` (base + projector), `tokenizer` and codi_config.json into `out_dir`; returns it.

    `base`: the causal LM to write instead of `model.model` (a LoRA run's merged model, codi.modeling.lora);
    `projector_state`: the projector's weights to write instead of `model.projector`'s (FSDP's gathered ones)."""
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
    (base if base is not None else model.model).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    projector = projector_state if projector_state is not None else model.projector.state_dict()
    save_file({k: v.detach().contiguous().cpu() for k, v in projector.items()}, str(out / PROJECTOR_FILE))
    cfg = {"format_version": FORMAT_VERSION, **dataclasses.asdict(model.options), **dataclasses.asdict(model.weights),
           "hidden_size": model.model.config.get_text_config().hidden_size,
           "frozen_teacher": model.frozen_teacher is not None, "token_ids": model.token_ids.as_dict(), "extra": extra}
    write_json(out / CODI_CONFIG, cfg, sort_keys=True)  # written last: its presence marks a complete folder
    return out


def read_codi_config(path: str | Path) -> SavedCodiConfig:
    """Parse and check `<path>/codi_config.json`; errors (ConfigError) name the file and key."""
    f = Path(path) / CODI_CONFIG
    try:
        raw = json.loads(f.read_text())
    except OSError as e:
        raise ConfigError(f"{f}: cannot read the codi config ({e.strerror}); is {path} a saved codi model?") from None
    except ValueError as e:
        raise ConfigError(f"{f}: invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{f}: expected a JSON object")
    version = raw.get("format_version")
    if version not in (*OLDER_DEFAULTS, FORMAT_VERSION):
        raise ConfigError(f"{f}: format_version = {version!r}: expected {FORMAT_VERSION} (or an older "
                          f"{', '.join(map(str, OLDER_DEFAULTS))})")
    raw = {**OLDER_DEFAULTS.get(version, {}), **raw}
    unknown = sorted(set(raw) - {*_OPTION_KEYS, *_WEIGHT_KEYS, *_RECORD_KEYS, "format_version", "extra"})
    if unknown:
        raise ConfigError(f"{f}: unknown option {unknown[0]!r}: the model was trained with an option this version "
                          "does not know; load it with the codi-trace version that wrote it")
    missing = [n for n in (*_OPTION_KEYS, *_WEIGHT_KEYS, *_RECORD_KEYS) if n not in raw]
    if missing:
        raise ConfigError(f"{f}: missing key {missing[0]}")
    options = build(CodiOptions, {k: raw[k] for k in _OPTION_KEYS}, prefix="", source=str(f))
    weights = build(LossWeights, {k: raw[k] for k in _WEIGHT_KEYS}, prefix="", source=str(f))
    hidden, frozen = raw["hidden_size"], raw["frozen_teacher"]
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1 or not isinstance(frozen, bool):
        raise ConfigError(f"{f}: hidden_size = {hidden!r}, frozen_teacher = {frozen!r}: expected an integer >= 1 "
                          "and true or false")
    try:
        ids = TraceTokenIds(**raw["token_ids"])
    except TypeError as e:
        raise ConfigError(f"{f}: token_ids: {e}") from None
    return SavedCodiConfig(options=options, weights=weights, hidden_size=hidden, frozen_teacher=frozen, token_ids=ids,
                           extra=raw.get("extra", {}))


def load_codi_model(path: str | Path, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None) -> LoadedCodi:
    """Load a folder written by `save_codi_model`. dtype None keeps the saved dtype; device None = CPU."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_codi_config(path)
    tok = load_tokenizer(path)
    if token_ids(tok) != cfg.token_ids:
        raise ConfigError(f"{path / CODI_CONFIG}: token_ids differ from the saved tokenizer's")
    model = load_causal_lm(path, dtype if dtype is not None else "auto")
    if device is not None:
        model.to(device)
    model.eval()
    ref = model.get_input_embeddings().weight
    if model.config.get_text_config().hidden_size != cfg.hidden_size:
        raise ConfigError(f"{path / CODI_CONFIG}: hidden_size = {cfg.hidden_size}, but the model has "
                         f"{model.config.get_text_config().hidden_size}")
    projector = build_projector(cfg.hidden_size, dtype=ref.dtype, device=ref.device)
    try:
        state = load_file(str(path / PROJECTOR_FILE))
    except OSError as e:
        raise ConfigError(f"{path / PROJECTOR_FILE}: cannot read the projector: {e}") from None
    projector.load_state_dict({k: v.to(dtype=ref.dtype) for k, v in state.items()})
    projector.eval()
    return LoadedCodi(model=model, projector=projector, tokenizer=tok, config=cfg)
