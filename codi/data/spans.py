"""Tokenize prompt + trace and locate every LINE frame's locals span (the contract with codi).

    enc = encode_examples(tok, prompts, traces, locals_char_spans)   # batched, fast tokenizer
    enc[k].trace_ids[i] == <|line_sep|>;  enc[k].trace_ids[i+1:j] == its LOCALS;  trace_ids[j] == <|action_sep|>

Spans come from the tokenizer's character offsets (not from searching token ids), and every span is
verified: decoding `trace_ids[i+1:j]` must give back exactly that frame's LOCALS text, else `SpanError`
names the sample. `trace_ids` end with the tokenizer's eos.
Design: docs/design/data.md, "Tokenization and spans".
"""

from __future__ import annotations

from dataclasses import dataclass

from codi.tracing.tokens import ACTION_SEP, LINE_SEP, TraceTokenIds, token_ids


class SpanError(ValueError):
    """A locals span that does not line up with the tokens (a tokenizer that merges across a special token)."""


@dataclass(frozen=True)
class Encoded:
    prompt_ids: list[int]
    trace_ids: list[int]       # ends with eos
    spans: list[tuple[int, int]]


def _rust_backend(tokenizer):
    """The `tokenizers.Tokenizer` under a HF fast tokenizer, or None (a slow tokenizer).

    Calling it directly skips the HF wrapper's per-token Python conversions (BatchEncoding,
    `to_py_obj` over every id), which cost more than the tokenization itself on short texts. The ids
    are the same: the wrapper's __call__ (no padding/truncation) and batch_decode (no clean-up) are
    thin layers over these calls; the benchmark and tests compare against the wrapper path."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    # A hub tokenizer.json may carry padding or truncation, which the wrapper turns off per call: use
    # the wrapper then, so the cache never holds pads or cut traces.
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return None
    return backend


def encode_examples(tokenizer, prompts: list[str], traces: list[str],
                    locals_char_spans: list[list[tuple[int, int]]], names: list[str] | None = None,
                    ids: TraceTokenIds | None = None) -> list[Encoded]:
    """Tokenize a batch and find every span; `names` (sample ids) go into error messages."""
    ids = ids or token_ids(tokenizer)
    names = names or [f"example {k}" for k in range(len(traces))]
    backend = _rust_backend(tokenizer)
    if backend is not None:
        p_ids = [e.ids for e in backend.encode_batch_fast(prompts, add_special_tokens=False)]
        t_enc = backend.encode_batch(traces, add_special_tokens=False)
        t_ids = [e.ids for e in t_enc]
        # The token holding a character, asked of Rust for the two boundary characters of each span
        # (no per-token offsets list in Python).
        token_at = [e.char_to_token for e in t_enc]
    else:
        p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        enc = tokenizer(traces, add_special_tokens=False, return_offsets_mapping=True)
        t_ids = enc["input_ids"]
        token_at = [{s: n for n, (s, e) in enumerate(offsets) if e > s}.get for offsets in enc["offset_mapping"]]
    out, checks = [], []
    for k, tids in enumerate(t_ids):
        spans = []
        for cs, ce in locals_char_spans[k]:
            # <|line_sep|> and <|action_sep|> are atomic and cannot overlap an occurrence of themselves,
            # so a boundary token with the right id starts exactly at the boundary character.
            i = token_at[k](cs - len(LINE_SEP))
            j = token_at[k](ce)
            if i is None or j is None or tids[i] != ids.line_sep or tids[j] != ids.action_sep or j <= i + 1:
                raise SpanError(f"{names[k]}: locals at characters [{cs}, {ce}) are not bounded by "
                                f"{LINE_SEP} / {ACTION_SEP} tokens (tokens {i}, {j})")
            spans.append((i, j))
            checks.append((k, i, j, traces[k][cs:ce]))
        out.append(Encoded(list(p_ids[k]), list(tids) + [ids.eos], spans))
    # One batched decode of every span: the invariant is checked on every example written.
    pieces = [out[k].trace_ids[i + 1:j] for k, i, j, _ in checks]
    if backend is not None:
        decoded = backend.decode_batch(pieces, skip_special_tokens=False)
    else:
        decoded = tokenizer.batch_decode(pieces, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    for (k, i, j, want), got in zip(checks, decoded):
        if got != want:
            raise SpanError(f"{names[k]}: span ({i}, {j}) decodes to {got[:60]!r}, expected the locals {want[:60]!r}")
    return out


def encode_naive(tokenizer, prompt: str, trace: str, ids: TraceTokenIds) -> Encoded:
    """One example at a time, spans by searching token ids: the benchmark's baseline (and a cross-check:
    with atomic special tokens both must agree)."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    t = tokenizer(trace, add_special_tokens=False)["input_ids"] + [ids.eos]
    spans, open_at = [], None
    for n, tid in enumerate(t):
        if tid == ids.line_sep:
            open_at = n
        elif tid == ids.action_sep and open_at is not None:
            spans.append((open_at, n))
            open_at = None
        elif tid in (ids.call_sep, ids.return_sep, ids.exception_sep):
            open_at = None
    return Encoded(p, t, spans)
