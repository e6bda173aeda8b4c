"""Stage `evaluate`: explicit-trace vs latent vs no-trace decoding on held-out problems.

    python -m codi evaluate      # metrics/eval.{json,md}, eval_by_{source,difficulty,split}.json, predictions, plots

Each mode decodes greedily (codi.decoding): `explicit` = the sft model writes the trace, `latent` = the codi
model writes it with a latent block per LINE frame (exactly the latent_steps it was trained with), `direct` =
the sft_direct baseline writes only the answer. Scores: codi.metrics; reports: codi.report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codi.config import ConfigError
from codi.data import CacheDataset, check_tokenizer
from codi.decoding import iter_decode, program_action_lines, true_action_lines
from codi.device import set_threads
from codi.files import write_json, write_text
from codi.hf import load_causal_lm
from codi.metrics import Bootstrap, latent_diagnostics, per_difficulty, score_example, summarize
from codi.report import compact, markdown_report, split_summaries, write_plots, write_predictions
from codi.schemas.evaluate import EvaluateConfig
from codi.tokens import load_tokenizer
from codi.tracing.format import parse_trace

MODE_MODEL = {"explicit": "sft", "latent": "codi", "direct": "sft_direct"}


@dataclass(frozen=True)
class EvaluateParams:
    """What this stage reads from params.yaml (the codi model's options come from its folder)."""

    evaluate: EvaluateConfig


def load_examples(cache_dir: Path, splits: list[str], limit: int) -> list[dict[str, Any]]:
    rows = []
    for split in splits:
        ds = CacheDataset(cache_dir / f"{split}.arrow", limit=limit)
        answers, traces, programs = ds.column("answer"), ds.column("trace_text"), ds.column("program")
        levels = ds.column("difficulty")
        for k in range(len(ds)):
            ex = ds[k]
            rows.append({"split": split, "id": ex["sample_id"], "problem_id": ex["problem_id"], "source": ex["source"],
                         "program": programs[k], "difficulty": levels[k],
                         "prompt_ids": ex["prompt_ids"], "truth": answers[k], "frames": parse_trace(traces[k])})
    return rows


def load_mode_model(mode: str, paths: dict[str, Path], cache_dir: Path):
    """(model, tokenizer, projector, latent_steps) for a mode; a missing folder, or a tokenizer that did not
    make the cache, is a clear error."""
    import torch

    path = paths[MODE_MODEL[mode]]
    if not (path / "config.json").is_file():
        raise ConfigError(f"evaluate.modes includes {mode!r}, but {path} holds no model (run its stage first)")
    if mode == "latent":
        from codi.modeling import load_codi_model
        loaded = load_codi_model(path, dtype=torch.float32)
        check_tokenizer(loaded.tokenizer, cache_dir, path)
        return loaded.model, loaded.tokenizer, loaded.projector, loaded.config.options.latent_steps
    tok = load_tokenizer(path)
    check_tokenizer(tok, cache_dir, path)
    return load_causal_lm(path, torch.float32).eval(), tok, None, 0


def run(params: EvaluateParams, cache: Path, sft: Path, codi: Path, direct: Path, metrics: Path, predictions: Path,
        plots: Path) -> int:
    cache_dir, metrics_dir = cache, metrics
    cfg = params.evaluate
    set_threads(cfg.torch_threads)
    examples = load_examples(cache_dir, cfg.splits, cfg.max_examples)
    if not examples:
        raise ConfigError(f"evaluate.splits = {cfg.splits}: no examples in {cache_dir} for these splits")
    paths = {"sft": sft, "codi": codi, "sft_direct": direct}
    boot = Bootstrap(cfg.bootstrap_samples, cfg.bootstrap_seed, cfg.ci_level)
    rows, generated, diagnostics = [], [], None
    for mode in cfg.modes:
        model, tok, projector, latent_steps = load_mode_model(mode, paths, cache_dir)
        t0 = time.time()
        lines = ([program_action_lines(tok, e["program"]) for e in examples]
                 if cfg.constrain_actions and mode != "direct" else None)

        def decode_all(forced: list | None, desc: str) -> list:
            return list(iter_decode(mode, model, tok, [e["prompt_ids"] for e in examples], projector=projector,
                                    latent_steps=latent_steps, max_new_tokens=cfg.max_new_tokens,
                                    max_frames=cfg.max_frames, batch_size=cfg.batch_size, progress=desc,
                                    action_lines=lines, forced_actions=forced))

        def score(results: list) -> list[dict[str, Any]]:
            return [score_example(res, ex["frames"], truth=ex["truth"], source=ex["source"], example_id=ex["id"],
                                  problem_id=ex["problem_id"], difficulty=ex["difficulty"]) | {"split": ex["split"]}
                    for ex, res in zip(examples, results)]

        results = decode_all(None, f"decode {mode}")
        rows += score(results)
        generated += [res.text for res in results]
        acc = sum(r["correct"] for r in rows[-len(examples):]) / len(examples)
        print(f"evaluate {mode}: {len(examples)} examples in {time.time() - t0:.1f}s, output accuracy {acc:.3f}")
        if mode == "latent":  # what the latents lose: the same decoding with every action line teacher-forced
            forced = score(decode_all([true_action_lines(tok, e["frames"]) for e in examples], "latent, forced actions"))
            diagnostics = latent_diagnostics(forced, results, model.get_input_embeddings().weight[:len(tok)], boot)
            print(f"evaluate latent with teacher-forced actions: output accuracy {diagnostics['forced_actions_accuracy']:.3f}")

    overall, per_source = summarize(rows, boot)
    by_level = per_difficulty(rows, boot)
    by_split = split_summaries({split: summarize([r for r in rows if r["split"] == split], boot)
                                for split in dict.fromkeys(r["split"] for r in rows)})
    write_json(metrics_dir / "eval.json", compact(overall) | ({"latent_diagnostics": diagnostics} if diagnostics else {}))
    write_json(metrics_dir / "eval_by_source.json", {s: compact(v) for s, v in per_source.items()})
    write_json(metrics_dir / "eval_by_difficulty.json", {d: compact(v) for d, v in by_level.items()})
    write_json(metrics_dir / "eval_by_split.json", by_split)
    write_predictions(rows, generated, predictions)
    write_plots(overall, per_source, plots)
    report = markdown_report(overall, per_source, cfg.splits, by_level, diagnostics, by_split)
    write_text(metrics_dir / "eval.md", report)
    print(report)
    return 0
