"""The trace vocabulary: the special tokens of the trace grammar (docs/design/trace-format.md, "The trace format").

This module is the only place that names them. Ids are always looked up in a tokenizer
(`token_ids(tok)`), never hard-coded, so any HF tokenizer can carry them.

    tok = load_tokenizer(path)   # a saved model's tokenizer, exactly as saved
    add_trace_tokens(tok)        # idempotent; returns how many tokens were new
    ids = token_ids(tok)         # TraceTokenIds(line_sep=..., action_sep=..., ...)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path

TRACE_CONTEXT_START = "<|trace_context_start|>"
FRAME_SEP = "<|frame_sep|>"
CALL_SEP = "<|call_sep|>"
LINE_SEP = "<|line_sep|>"
RETURN_SEP = "<|return_sep|>"
EXCEPTION_SEP = "<|exception_sep|>"
ACTION_SEP = "<|action_sep|>"
ARG_SEP = "<|arg_sep|>"
LATENT_START = "<|latent_start|>"
LATENT_END = "<|latent_end|>"
# Used when the tokenizer has none of its own (the tiny default's BPE).
PAD = "<|pad|>"
EOS = "<|endoftext|>"

TRACE_TOKENS: tuple[str, ...] = (
    TRACE_CONTEXT_START, FRAME_SEP, CALL_SEP, LINE_SEP, RETURN_SEP, EXCEPTION_SEP,
    ACTION_SEP, ARG_SEP, LATENT_START, LATENT_END,
)
# Frame-kind markers (the token right after a <|frame_sep|>).
FRAME_MARKERS: tuple[str, ...] = (CALL_SEP, LINE_SEP, RETURN_SEP, EXCEPTION_SEP)


@dataclass(frozen=True)
class TraceTokenIds:
    """Token ids of the trace vocabulary in one tokenizer."""

    trace_context_start: int
    frame_sep: int
    call_sep: int
    line_sep: int
    return_sep: int
    exception_sep: int
    action_sep: int
    arg_sep: int
    latent_start: int
    latent_end: int
    pad: int
    eos: int

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def contains_special(text: str) -> str | None:
    """The first trace token that occurs literally in `text`, or None.

    Program text or a repr that spells a special token would tokenize into a frame boundary
    where there is none; such samples are rejected instead of silently mis-tokenized."""
    if "<|" not in text:
        return None
    for t in (*TRACE_TOKENS, PAD, EOS):
        if t in text:
            return t
    return None


def add_trace_tokens(tokenizer) -> int:
    """Add the trace tokens (and pad/eos if missing) as special tokens; idempotent.

    Returns the number of tokens new to the tokenizer (0 when already present), so callers
    know whether to resize the model's embeddings."""
    before = len(tokenizer)
    # Membership in the *added* tokens, not the vocabulary: a BPE may have learned the string as an
    # ordinary merge, and only an added (special) token is matched before the model splits text.
    added = set(tokenizer.added_tokens_encoder)
    missing = [t for t in TRACE_TOKENS if t not in added]
    if missing:
        # Special tokens are never split or merged by the pre-tokenizer: frame boundaries stay
        # token boundaries. `replace_extra_special_tokens=False` keeps the model's own ones.
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    if tokenizer.eos_token is None:
        tokenizer.add_special_tokens({"eos_token": EOS})
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": PAD})
    return len(tokenizer) - before


def token_ids(tokenizer) -> TraceTokenIds:
    """Look up every trace token's id; fails naming the token if the tokenizer lacks one."""
    vocab = tokenizer.get_vocab()
    ids = {}
    for name, tok in (
        ("trace_context_start", TRACE_CONTEXT_START), ("frame_sep", FRAME_SEP), ("call_sep", CALL_SEP),
        ("line_sep", LINE_SEP), ("return_sep", RETURN_SEP), ("exception_sep", EXCEPTION_SEP),
        ("action_sep", ACTION_SEP), ("arg_sep", ARG_SEP), ("latent_start", LATENT_START),
        ("latent_end", LATENT_END),
    ):
        if tok not in vocab:
            raise KeyError(f"tokenizer has no {tok} token: call codi.tracing.tokens.add_trace_tokens first")
        ids[name] = vocab[tok]
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise KeyError("tokenizer has no eos/pad token: call codi.tracing.tokens.add_trace_tokens first")
    return TraceTokenIds(**ids, pad=tokenizer.pad_token_id, eos=tokenizer.eos_token_id)


def load_tokenizer(path: str | Path):
    """The tokenizer saved with a model folder, exactly as saved (its tokenizer.json read verbatim).

    Not AutoTokenizer: for a Qwen2 config it builds Qwen2Tokenizer, which replaces the saved pre-tokenizer
    with Qwen2's own, so a tokenizer trained with other splitting (the tiny BPE) would no longer give the
    cache's ids."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if not (Path(path) / "tokenizer.json").is_file():  # FileNotFoundError: the CLI prints it as one line; and
        # not ConfigError: the sandbox worker imports this module without site-packages (no yaml)
        raise FileNotFoundError(f"{path}: no tokenizer.json here: not a model folder this pipeline wrote")
    return TokenizersBackend.from_pretrained(str(path))


def tokenizer_sha256(tokenizer) -> str:
    """Content hash of a tokenizer (vocabulary, merges, pre-tokenizer, specials): identifies a cache's ids."""
    blob = (tokenizer.backend_tokenizer.to_str() if getattr(tokenizer, "is_fast", False)
            else json.dumps(tokenizer.get_vocab(), sort_keys=True))
    return hashlib.sha256(blob.encode()).hexdigest()
