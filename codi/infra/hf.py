"""The Hugging Face folders a stage starts from, loaded with one-line errors.

    model = load_causal_lm("models/sft", torch.float32)      # ConfigError if it is no causal LM

A folder whose config is not a causal LM (an encoder, a vision model), or whose weights are missing, is an
error a user can fix: it names the folder, with transformers' first line of why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from codi.infra.config import ConfigError


def load_causal_lm(path: str | Path, dtype: Any):
    """AutoModelForCausalLM.from_pretrained(path, dtype=dtype); ConfigError naming `path` if it cannot be one."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: not a causal LM that transformers can load ({why})") from None
