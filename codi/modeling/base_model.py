"""The base LM every training stage starts from (params section `model`).

    check_model_source(cfg.model)                    # fail fast: bad path, hub id while offline
    tok = train_tiny_tokenizer(texts, cfg.model.tiny) # when model.base == "tiny"
    model, tok = build_base(cfg.model, train_texts)  # tiny from scratch, or from_pretrained + tokens
    save_base(model, tok, "models/base")              # HF format: later stages load it like a hub model

`tiny` is the embedded default: a from-scratch Qwen2-style decoder and a byte-level BPE trained on the
training split's text, digits split one by one. Anything else is a local HF folder or a hub id, loaded
with `from_pretrained` and its own tokenizer.json, trace tokens added, each new token's embedding row (and
untied head row) the mean of the old ones. Design: docs/design/data.md, "Tokenization and spans".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from codi.infra.config import ConfigError
from codi.schemas.model import ModelConfig, TinyModelConfig
from codi.tracing.tokens import EOS, PAD, TRACE_TOKENS, add_trace_tokens

SPECIAL_TOKENS: tuple[str, ...] = (EOS, PAD, *TRACE_TOKENS)
BYTE_ALPHABET = 256
BASE_MODELS_DIR = "base_models"  # precompute's DVC dependency (dvc.yaml): a local model.base belongs here


def is_pinned_revision(revision: str) -> bool:
    """A full commit sha: the one kind of hub revision that names the same files forever."""
    return len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


def source_warnings(cfg: ModelConfig, root: str | Path = ".") -> list[str]:
    """What makes a result from `cfg.base` unreproducible or possibly stale (empty for the tiny default)."""
    if cfg.base == "tiny":
        return []
    if is_local_path(cfg.base):
        path = Path(os.path.expanduser(cfg.base))
        inside = (Path(root) / BASE_MODELS_DIR).resolve()
        if inside == path.resolve() or inside in path.resolve().parents:
            return []
        return [f"model.base = {cfg.base!r} is outside {BASE_MODELS_DIR}/, so DVC does not hash it: replacing its "
                f"weights will NOT rerun precompute and the stages after it (a stale result is possible). Move or "
                f"copy it into {BASE_MODELS_DIR}/ ({BASE_MODELS_DIR}/README.md)"]
    if not is_pinned_revision(cfg.revision):
        return [f"model.base = {cfg.base!r} at model.revision = {cfg.revision!r} is NOT pinned: the hub can change "
                f"the files under that name, and the run is not reproducible. Set model.revision to a commit sha"]
    return []


def is_local_path(base: str) -> bool:
    """A `model.base` that names a folder rather than a hub id (`org/name`)."""
    return (base.startswith((".", "/", "~", BASE_MODELS_DIR + "/")) or os.path.exists(os.path.expanduser(base))
            or base.count("/") > 1)


def check_model_source(cfg: ModelConfig) -> None:
    """Fail before any work when `model.base` cannot be loaded: missing folder, unreadable config,
    vocabulary too small, or a hub id that is neither cached nor reachable. Warn loudly where the result
    could be stale or unreproducible (`source_warnings`); an unpinned hub id's warning names the commit
    it resolved to, ready to pin."""
    for warning in source_warnings(cfg):
        print(f"WARNING: {warning}", flush=True)
    if cfg.base == "tiny":
        need = BYTE_ALPHABET + len(SPECIAL_TOKENS) + 1
        if cfg.tiny.vocab_size < need:
            raise ConfigError(f"model.tiny.vocab_size = {cfg.tiny.vocab_size}: expected >= {need} "
                              f"(256 byte symbols + {len(SPECIAL_TOKENS)} special tokens + merges)")
        return
    if is_local_path(cfg.base):
        path = Path(os.path.expanduser(cfg.base))
        if not path.is_dir():
            raise ConfigError(f"model.base = {cfg.base!r}: no such model folder")
        config = path / "config.json"
        try:
            json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.base = {cfg.base!r}: cannot read {config}: {e}") from None
        return
    # A hub id. Resolve config.json now (cache first), so that an offline machine fails here with
    # a sentence instead of deep inside from_pretrained after the split was written.
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    try:
        config = hf_hub_download(cfg.base, "config.json", revision=cfg.revision, local_files_only=offline)
    except LocalEntryNotFoundError:
        raise ConfigError(f"model.base = {cfg.base!r}: a hub id, but the hub cannot be reached (offline?) and the "
                          f"model is not in the local Hugging Face cache; download it first or name a local folder") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ConfigError(f"model.base = {cfg.base!r}: cannot resolve it on the hub: {e}") from None
    if not is_pinned_revision(cfg.revision):  # the cache lays files out as snapshots/<commit sha>/<file>
        print(f"WARNING: model.revision = {cfg.revision!r} resolves to commit {Path(config).parent.name} today: "
              f"pin it with `dvc exp run -S model.revision={Path(config).parent.name}` or in params.yaml", flush=True)


def train_tiny_tokenizer(texts: Iterable[str], cfg: TinyModelConfig):
    """A byte-level BPE over `texts` with the trace tokens as atomic specials, as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # GPT-2 style byte-level splitting (a run of digits is one pre-token, which BPE merges into whole-number
    # tokens where they are frequent), or digits one by one first. trim_offsets=False keeps offsets exact
    # (precompute finds spans from them).
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True, trim_offsets=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if cfg.split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=cfg.tokenizer_min_frequency,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   clean_up_tokenization_spaces=False)
    fast.add_special_tokens({"extra_special_tokens": list(TRACE_TOKENS)})
    return fast


def tiny_model(cfg: TinyModelConfig, tokenizer):
    """A freshly initialised Qwen2-style decoder sized by `cfg`, vocabulary from the tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(config)
    return model


def build_base(cfg: ModelConfig, train_texts: Iterable[str]):
    """(model, tokenizer) of the configured base, trace tokens included.

    A local folder or hub id: its own tokenizer.json read verbatim (as `codi.tracing.tokens.load_tokenizer` reads
    models/base later; AutoTokenizer would build the family's class for some configs, e.g. Qwen2Tokenizer,
    which swaps in its own pre-tokenizer and pad token), the trace tokens (and pad/eos where missing) added,
    and the embeddings made to fit with `init_new_token_rows`."""
    if cfg.base == "tiny":
        tok = train_tiny_tokenizer(train_texts, cfg.tiny)
        return tiny_model(cfg.tiny, tok), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    path = os.path.expanduser(cfg.base)
    kw = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    try:
        tok = TokenizersBackend.from_pretrained(path, revision=cfg.revision)
    except (OSError, ValueError):  # no tokenizer.json: the family's class converts its slow files
        tok = AutoTokenizer.from_pretrained(path, use_fast=True, **kw)
    if not getattr(tok, "is_fast", False):
        raise ConfigError(f"model.base = {cfg.base!r}: needs a fast tokenizer (offsets locate the locals spans)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", **kw)
    known = len(tok)
    add_trace_tokens(tok)
    init_new_token_rows(model, known, len(tok))
    model.config.pad_token_id = tok.pad_token_id
    return model, tok


def init_new_token_rows(model, known: int, total: int) -> None:
    """Fit the embeddings to a tokenizer that grew from `known` to `total` tokens, deterministically.

    The input embedding keeps its rows (a hub model's are often padded past its tokenizer, e.g. to a multiple
    of 64) and grows only when `total` exceeds them; the head follows, tied or not. The row of every new token
    id (known <= id < total) is set to the mean of the known tokens' rows: input rows to the mean input row,
    and for an untied head output rows to the mean output row (bias to the mean bias), so a new token starts
    at the average logit. Padding rows past the tokenizer are not averaged in. The same folder always gives
    the same weights (transformers' default `mean_resizing` samples appended rows around the mean with a
    little random noise, and resizing a padded model down to its tokenizer left new ids on padding rows)."""
    import torch

    rows = model.get_input_embeddings().weight.shape[0]
    if total > rows:
        model.resize_token_embeddings(total, mean_resizing=False)
    known = min(known, rows)
    if total <= known:
        return
    inp = model.get_input_embeddings()
    out = model.get_output_embeddings()
    params = [inp.weight]
    if out is not None and out.weight.data_ptr() != inp.weight.data_ptr():
        params.append(out.weight)
        if getattr(out, "bias", None) is not None:
            params.append(out.bias)
    with torch.no_grad():
        for w in params:
            w[known:total] = w[:known].float().mean(0).to(w.dtype)


def save_base(model, tokenizer, out: str | Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
