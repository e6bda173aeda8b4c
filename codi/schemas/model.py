"""The `model` section: the base LM every training stage starts from."""

from __future__ import annotations

from dataclasses import dataclass

from codi.infra.config import ConfigError, option


@dataclass(frozen=True)
class TinyModelConfig:
    """The embedded default base model: a from-scratch Qwen2-style decoder and a byte-level BPE."""

    vocab_size: int = option("BPE vocabulary incl. the 256 byte symbols and the special tokens", ge=300)
    tokenizer_min_frequency: int = option("minimum pair frequency for a BPE merge", ge=1)
    split_digits: bool = option("tokenize numbers digit by digit; false = BPE merges frequent numbers into one token")
    hidden_size: int = option("model width", ge=8)
    num_layers: int = option("decoder layers", ge=1)
    num_heads: int = option("attention heads", ge=1)
    num_kv_heads: int = option("key/value heads (grouped-query attention); must divide num_heads", ge=1)
    intermediate_size: int = option("MLP width", ge=8)
    max_position_embeddings: int = option("longest sequence the rotary embedding is set up for", ge=16)
    rope_theta: float = option("rotary base", gt=0)
    tie_word_embeddings: bool = option("share input embeddings and lm_head")
    seed: int = option("weight-initialisation seed")

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.tiny.hidden_size = {self.hidden_size}: expected a multiple of model.tiny.num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.tiny.num_kv_heads = {self.num_kv_heads}: expected a divisor of model.tiny.num_heads ({self.num_heads})")


@dataclass(frozen=True)
class ModelConfig:
    """`model`: the base LM every training stage starts from."""

    base: str = option("`tiny` (embedded default), a local HF folder, or a hub id (needs network)", nonempty=True)
    revision: str = option("hub revision when `base` is a hub id")
    trust_remote_code: bool = option("allow custom modelling code from the hub")
    tiny: TinyModelConfig = option("used when base = tiny")
