"""The `lora` block of a training section (`sft.lora`, `sft_direct.lora`, `codi.lora`): LoRA and QLoRA adapters.

    cfg = params.sft.lora          # r = 0: off (full fine-tuning, the default); r > 0: adapters (codi/modeling/lora.py)
    dvc exp run -S sft.lora.r=16 -S sft.lora.quantize=4bit

One type for every training stage: the same keys mean the same thing in sft, sft_direct and codi. What the
options do, and how CODI and the CWM work use them: docs/LORA.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from codi.infra.config import ConfigError, option

ALL_LINEAR = "all-linear"  # peft's name for every linear layer of the decoder except the output head


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on a frozen base (peft), with the trace tokens' embedding rows trained in full."""

    r: int = option("adapter rank; 0 = off: every weight trains (the default, and what the tiny model needs)", ge=0)
    alpha: float = option("LoRA scale numerator: an update is (alpha / r) B A, or (alpha / sqrt(r)) B A with rslora",
                          gt=0)
    dropout: float = option("dropout on the adapters' input", ge=0.0, lt=1.0)
    target_modules: list[str] = option("modules that get adapters, by name suffix (q_proj, v_proj, ...), or "
                                       "[all-linear]: every linear layer of the decoder, not the output head",
                                       nonempty=True)
    rslora: bool = option("rank-stabilised scale alpha / sqrt(r) instead of alpha / r")
    train_new_tokens: bool = option("train the embedding (and untied head) rows of the tokens codi-trace adds "
                                    "(trace tokens, pad, eos) in full; the other rows stay frozen")
    quantize: Literal["none", "4bit"] = option("4bit = QLoRA: the frozen base in 4-bit NF4 (double-quantised, bf16 "
                                               "compute); needs a CUDA GPU and bitsandbytes")

    def __post_init__(self) -> None:
        if self.quantize != "none" and self.r == 0:
            raise ConfigError(f"quantize = {self.quantize!r} with r = 0: QLoRA trains adapters on a frozen quantised "
                              "base; set r > 0 (or quantize: none)")
        if ALL_LINEAR in self.target_modules and len(self.target_modules) > 1:
            raise ConfigError(f"target_modules = {self.target_modules!r}: {ALL_LINEAR} already names every linear "
                              "layer; give it alone or list module names")

    @property
    def enabled(self) -> bool:
        return self.r > 0
