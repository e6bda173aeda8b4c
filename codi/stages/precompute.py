"""Stage `precompute`: traces -> tokenizer + base model + split caches with exact locals spans.

    python -m codi precompute     # data/cache/{train,val,test,holdout}.arrow + manifest.json, models/base/

Keeps `ok` traces, splits by problem (stable hash), builds the base model (`model.base`), tokenizes,
locates and checks every LINE frame's locals span, and writes the counts as DVC metrics.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from pathlib import Path

from tqdm import tqdm

from codi.answers import render_direct
from codi.base_model import build_base, check_model_source, save_base, tokenizer_sha256
from codi.config import ConfigError, Params, to_dict
from codi.data import CACHE_FORMAT_VERSION, SPLITS, split_of, write_split
from codi.files import atomic_dir, write_json
from codi.spans import encode_examples
from codi.tokens import token_ids
from codi.traces import TracesFileError, read_traces
from codi.tracing.format import entry_exit, locals_offsets, parse_trace, render_prompt

TRACE_COLUMNS = ("sample_id", "source", "problem_id", "program", "call", "trace_text", "status", "n_frames")


def load_ok_traces(traces_dir: Path, pc_cfg, dropped: dict[str, Counter]) -> list[dict]:
    """`ok` rows of every source file, parsed; every row not kept is counted in `dropped[source]`."""
    files = sorted(traces_dir.glob("*.parquet"))
    if not files:
        raise ConfigError(f"{traces_dir}: no <source>.parquet files (run the extract stage first)")
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
            if r["n_frames"] > pc_cfg.max_frames:
                dropped[src]["max_frames"] += 1
                continue
            frames = parse_trace(r["trace_text"])
            exit_frame = entry_exit(frames)
            spans = locals_offsets(frames)
            if not spans:
                dropped[src]["no_line_frames"] += 1
                continue
            if exit_frame is None or exit_frame.kind != "return":
                raise ConfigError(f"{f}: sample {r['sample_id']} has status ok but no entry return frame")
            r["prompt"] = render_prompt(r["program"], r["call"])
            r["char_spans"] = spans
            r["answer_repr"] = exit_frame.value_repr()  # the trace's own VALUE: the truth of every mode
            rows.append(r)
    return rows


def run(params: Params, traces: Path, cache: Path, base_out: Path, metrics: Path) -> int:
    traces_dir, cache_dir = traces, cache
    t0 = time.time()
    pc_cfg, model_cfg = params.precompute, params.model
    check_model_source(model_cfg)  # before any work: bad path / offline hub id

    dropped: dict[str, Counter] = defaultdict(Counter)
    rows = load_ok_traces(traces_dir, pc_cfg, dropped)
    for r in rows:
        r["split"] = ("holdout" if r["source"] in pc_cfg.holdout_sources else
                      split_of(r["problem_id"], pc_cfg.val_fraction, pc_cfg.test_fraction, pc_cfg.split_salt))
    train_rows = [r for r in rows if r["split"] == "train"]
    if not train_rows:
        raise ConfigError(f"{traces_dir}: no ok traces fall in the train split ({len(rows)} ok traces in all)")

    print(f"precompute: {len(rows)} usable traces; building base model {model_cfg.base!r}")
    model, tok = build_base(model_cfg, (r["prompt"] + r["trace_text"] for r in train_rows))
    ids = token_ids(tok)

    by_split: dict[str, list[dict]] = {s: [] for s in SPLITS}
    bs = pc_cfg.batch_size
    for start in tqdm(range(0, len(rows), bs), desc="tokenize+spans", unit="batch", leave=False):
        batch = rows[start:start + bs]
        enc = encode_examples(tok, [r["prompt"] for r in batch], [r["trace_text"] for r in batch],
                              [r["char_spans"] for r in batch], names=[r["sample_id"] for r in batch], ids=ids)
        answers = tok([render_direct(r["answer_repr"]) for r in batch], add_special_tokens=False)["input_ids"]
        for r, e, a in zip(batch, enc, answers):
            if len(e.prompt_ids) + len(e.trace_ids) > pc_cfg.max_seq_len:
                dropped[r["source"]]["max_seq_len"] += 1
                continue
            by_split[r["split"]].append({
                "sample_id": r["sample_id"], "source": r["source"], "problem_id": r["problem_id"],
                "prompt_ids": e.prompt_ids, "trace_ids": e.trace_ids, "spans": e.spans,
                "answer_ids": list(a) + [ids.eos], "answer": r["answer_repr"], "program": r["program"],
                "call": r["call"], "trace_text": r["trace_text"], "n_frames": r["n_frames"],
            })

    cache_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format_version": CACHE_FORMAT_VERSION,
        "tokenizer_sha256": tokenizer_sha256(tok),
        "vocab_size": len(tok),
        "params": {"precompute": to_dict(pc_cfg), "model": to_dict(model_cfg)},
        "splits": {},
        "dropped": {src: dict(sorted(c.items())) for src, c in sorted(dropped.items())},
        "tokens": token_statistics([r for s in SPLITS for r in by_split[s]]),
    }
    for split in SPLITS:
        split_rows = by_split[split]
        sha = write_split(split_rows, cache_dir / f"{split}.arrow")
        manifest["splits"][split] = {
            "examples": len(split_rows),
            "problems": len({r["problem_id"] for r in split_rows}),
            "by_source": dict(sorted(Counter(r["source"] for r in split_rows).items())),
            "sha256": sha,
        }
    write_json(cache_dir / "manifest.json", manifest)
    # The counts as DVC metrics: what `dvc exp show` should compare (no digests, no copy of params.yaml).
    summary = {"vocab_size": manifest["vocab_size"], "dropped": manifest["dropped"], "tokens": manifest["tokens"],
               "splits": {s: {k: v for k, v in d.items() if k != "sha256"} for s, d in manifest["splits"].items()}}
    write_json(metrics, summary)
    with atomic_dir(base_out) as tmp:
        save_base(model, tok, tmp)

    print_summary(manifest, time.time() - t0)
    return 0


def token_statistics(rows: list[dict]) -> dict[str, float]:
    if not rows:
        return {"mean_prompt": 0.0, "mean_trace": 0.0, "mean_total": 0.0, "max_total": 0, "locals_share": 0.0}
    p = [len(r["prompt_ids"]) for r in rows]
    t = [len(r["trace_ids"]) for r in rows]
    locals_tokens = sum(j - i - 1 for r in rows for i, j in r["spans"])
    return {
        "mean_prompt": round(sum(p) / len(rows), 2),
        "mean_trace": round(sum(t) / len(rows), 2),
        "mean_total": round((sum(p) + sum(t)) / len(rows), 2),
        "max_total": max(a + b for a, b in zip(p, t)),
        "mean_line_frames": round(sum(len(r["spans"]) for r in rows) / len(rows), 2),
        "locals_share": round(locals_tokens / sum(t), 4),  # what CODI compresses
    }


def print_summary(manifest: dict, seconds: float) -> None:
    s = manifest["splits"]
    counts = ", ".join(f"{k} {v['examples']} ({v['problems']} problems)" for k, v in s.items())
    tk = manifest["tokens"]
    print(f"precompute: {counts}; vocab {manifest['vocab_size']}; mean tokens prompt {tk['mean_prompt']} + "
          f"trace {tk['mean_trace']}; locals share {tk['locals_share']:.1%}; {seconds:.1f}s")
    for src, c in manifest["dropped"].items():
        print(f"  dropped from {src}: " + ", ".join(f"{k} {v}" for k, v in c.items()))
