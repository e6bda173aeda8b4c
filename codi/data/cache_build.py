"""Building the example cache from traces: usable traces, problem splits, tokens and spans, the manifest.

    rows = usable_traces(trace_files, params.precompute, dropped)     # ok traces, parsed; the rest counted
    by_split = encode_rows(rows, tokenizer, params.precompute, dropped)   # {split: [cache rows]}
    manifest = cache_manifest(by_split, shas, tokenizer, params.precompute, params.model, dropped)

usable_traces reads the traces files it is given (parquet); every function counts what it drops, per source
and reason, in the `dropped` mapping it is handed. The precompute stage writes the cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from codi.data.answers import render_direct
from codi.data.cache import CACHE_FORMAT_VERSION, SPLITS, split_of
from codi.data.spans import encode_examples
from codi.data.traces import TracesFileError, read_traces
from codi.infra.config import ConfigError, to_dict
from codi.schemas.model import ModelConfig
from codi.schemas.precompute import PrecomputeConfig
from codi.tracing.format import computed_values, entry_exit, exit_kind, locals_offsets, parse_trace, render_prompt
from codi.tracing.tokens import token_ids, tokenizer_sha256

TRACE_COLUMNS = ("sample_id", "source", "problem_id", "program", "call", "trace_text", "status", "n_frames",
                 "difficulty")


def usable_traces(files: Iterable[Path], cfg: PrecomputeConfig, dropped: dict[str, Counter]) -> list[dict[str, Any]]:
    """`ok` rows of the traces files, parsed, with their prompt, char spans, answer and split; every row not
    kept is counted in `dropped[source]`."""
    rows = []
    for f in files:
        try:
            table = read_traces(f, TRACE_COLUMNS)
        except TracesFileError as e:
            raise ConfigError(str(e)) from None
        for r in table:
            src = r["source"]
            if r["status"] != "ok":
                dropped[src][f"status:{r['status']}"] += 1
                continue
            if r["n_frames"] > cfg.max_frames:
                dropped[src]["max_frames"] += 1
                continue
            frames = parse_trace(r["trace_text"])
            exit_frame = entry_exit(frames)
            spans = locals_offsets(frames)
            if not spans:
                dropped[src]["no_line_frames"] += 1
                continue
            if exit_frame is None or exit_kind(frames, exit_frame) != "return":
                raise ConfigError(f"{f}: sample {r['sample_id']} has status ok but its entry call does not return")
            r["prompt"] = render_prompt(r["program"], r["call"])
            r["char_spans"] = spans
            r["answer_repr"] = exit_frame.value_repr()  # the trace's own VALUE: the truth of every mode
            r["split"] = ("holdout" if src in cfg.holdout_sources else
                          split_of(r["problem_id"], cfg.val_fraction, cfg.test_fraction, cfg.split_salt))
            rows.append(r)
    return rows


def encode_rows(rows: list[dict[str, Any]], tok, cfg: PrecomputeConfig,
                dropped: dict[str, Counter]) -> dict[str, list[dict[str, Any]]]:
    """Tokenize prompts, traces and answers in batches, locate and check every span, drop what is too long."""
    ids = token_ids(tok)
    by_split: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    for start in tqdm(range(0, len(rows), cfg.batch_size), desc="tokenize+spans", unit="batch", leave=False):
        batch = rows[start:start + cfg.batch_size]
        enc = encode_examples(tok, [r["prompt"] for r in batch], [r["trace_text"] for r in batch],
                              [r["char_spans"] for r in batch], names=[r["sample_id"] for r in batch], ids=ids)
        answers = tok([render_direct(r["answer_repr"]) for r in batch], add_special_tokens=False)["input_ids"]
        for r, e, a in zip(batch, enc, answers):
            if len(e.prompt_ids) + len(e.trace_ids) > cfg.max_seq_len:
                dropped[r["source"]]["max_seq_len"] += 1
                continue
            by_split[r["split"]].append({
                "sample_id": r["sample_id"], "source": r["source"], "problem_id": r["problem_id"],
                "prompt_ids": e.prompt_ids, "trace_ids": e.trace_ids, "spans": e.spans,
                "answer_ids": list(a) + [ids.eos], "answer": r["answer_repr"], "program": r["program"],
                "call": r["call"], "trace_text": r["trace_text"], "n_frames": r["n_frames"],
                "difficulty": r["difficulty"],
            })
    return by_split


def token_statistics(rows: list[dict[str, Any]]) -> dict[str, float]:
    if not rows:
        return {"mean_prompt": 0.0, "mean_trace": 0.0, "mean_total": 0.0, "max_total": 0, "mean_line_frames": 0.0,
                "mean_computed_values": 0.0, "locals_share": 0.0}
    p = [len(r["prompt_ids"]) for r in rows]
    t = [len(r["trace_ids"]) for r in rows]
    locals_tokens = sum(j - i - 1 for r in rows for i, j in r["spans"])
    return {
        "mean_prompt": round(sum(p) / len(rows), 2),
        "mean_trace": round(sum(t) / len(rows), 2),
        "mean_total": round((sum(p) + sum(t)) / len(rows), 2),
        "max_total": max(a + b for a, b in zip(p, t)),
        "mean_line_frames": round(sum(len(r["spans"]) for r in rows) / len(rows), 2),
        # the task's work per call (the ladder's axis): values a trace computes rather than copies
        "mean_computed_values": round(sum(computed_values(parse_trace(r["trace_text"])) for r in rows) / len(rows), 2),
        "locals_share": round(locals_tokens / sum(t), 4),  # what CODI compresses
    }


def cache_manifest(by_split: dict[str, list[dict[str, Any]]], shas: dict[str, str], tok, precompute: PrecomputeConfig,
                   model: ModelConfig, dropped: dict[str, Counter]) -> dict[str, Any]:
    """What the training stages check and fingerprint: format version, tokenizer and split digests, counts,
    and the params that made the cache."""
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "tokenizer_sha256": tokenizer_sha256(tok),
        "vocab_size": len(tok),
        "params": {"precompute": to_dict(precompute), "model": to_dict(model)},
        "splits": {split: {"examples": len(rows), "problems": len({r["problem_id"] for r in rows}),
                           "by_source": dict(sorted(Counter(r["source"] for r in rows).items())),
                           "sha256": shas[split]} for split, rows in by_split.items()},
        "dropped": {src: dict(sorted(c.items())) for src, c in sorted(dropped.items())},
        "tokens": token_statistics(everything := [r for s in SPLITS for r in by_split[s]]),
        "tokens_by_source": {src: token_statistics([r for r in everything if r["source"] == src])
                             for src in sorted({r["source"] for r in everything})},
    }


def cache_metrics(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's counts as DVC metrics: what `dvc exp show` compares (no digests, no copy of params)."""
    return {"vocab_size": manifest["vocab_size"], "dropped": manifest["dropped"], "tokens": manifest["tokens"],
            "tokens_by_source": manifest["tokens_by_source"],
            "splits": {s: {k: v for k, v in d.items() if k != "sha256"} for s, d in manifest["splits"].items()}}


def summary_line(manifest: dict[str, Any], seconds: float) -> str:
    s, tk = manifest["splits"], manifest["tokens"]
    counts = ", ".join(f"{k} {v['examples']} ({v['problems']} problems)" for k, v in s.items())
    lines = [f"precompute: {counts}; vocab {manifest['vocab_size']}; mean tokens prompt {tk['mean_prompt']} + "
             f"trace {tk['mean_trace']}; locals share {tk['locals_share']:.1%}; {seconds:.1f}s"]
    lines += [f"  dropped from {src}: " + ", ".join(f"{k} {v}" for k, v in c.items())
              for src, c in manifest["dropped"].items()]
    return "\n".join(lines)
