"""Stage `evaluate`: explicit-trace vs latent vs no-trace decoding on held-out problems.

    python -m codi evaluate      # metrics/eval.{json,md}, eval_by_{source,difficulty,split}.json, predictions, plots

Each mode decodes greedily (codi.decoding): `explicit` = the sft model writes the trace, `latent` = the codi
model writes it with a latent block per LINE frame (exactly the latent_steps it was trained with), `direct` =
the sft_direct baseline writes only the answer. Scores: codi.metrics; reports: codi.report. For the latent mode,
what the latents carry (codi.probe): the constant-latent ablation (evaluate.ablate_latents) and the latent probe
(evaluate.probe_train_examples), in eval.json's latent_ablation / latent_probe and eval.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from codi.config import ConfigError
from codi.data import CacheDataset, check_tokenizer
from codi.decoding import iter_decode, mean_latent, program_action_lines, true_action_lines
from codi.device import set_threads
from codi.files import write_json, write_text
from codi.hf import load_causal_lm
from codi.metrics import Bootstrap, latent_diagnostics, per_difficulty, score_example, summarize
from codi.probe import ablation_summary, collect_blocks, diagnosis, probe_report
from codi.report import (compact, markdown_report, probe_markdown, split_summaries, write_plots, write_predictions,
                         write_probe_plot)
from codi.schemas.evaluate import EvaluateConfig
from codi.tokens import load_tokenizer
from codi.tracing.format import parse_trace
from codi.values import TokenPieces, assigned_values

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
                         "prompt_ids": ex["prompt_ids"], "truth": answers[k], "frames": parse_trace(traces[k]),
                         "trace_ids": ex["trace_ids"], "spans": ex["spans"], "trace_text": traces[k]})
    return rows


@dataclass
class LoadedMode:
    """A mode's model, ready to decode: for latent, also its projector and the options decoding must honour."""

    mode: str
    model: nn.Module
    tokenizer: Any
    projector: nn.Module | None = None
    latent_steps: int = 0
    value_feedback: str = "none"
    codi: Any = None  # latent: the LoadedCodi (the probe rebuilds its CodiModel)


def load_mode_model(mode: str, paths: dict[str, Path], cache_dir: Path) -> LoadedMode:
    """A mode's LoadedMode; a missing folder, or a tokenizer that did not make the cache, is a clear error."""
    import torch

    path = paths[MODE_MODEL[mode]]
    if not (path / "config.json").is_file():
        raise ConfigError(f"evaluate.modes includes {mode!r}, but {path} holds no model (run its stage first)")
    if mode == "latent":
        from codi.modeling import load_codi_model
        loaded = load_codi_model(path, dtype=torch.float32)
        check_tokenizer(loaded.tokenizer, cache_dir, path)
        opts = loaded.config.options
        return LoadedMode(mode, loaded.model, loaded.tokenizer, loaded.projector, opts.latent_steps,
                          opts.value_feedback, loaded)
    tok = load_tokenizer(path)
    check_tokenizer(tok, cache_dir, path)
    return LoadedMode(mode, load_causal_lm(path, torch.float32).eval(), tok)


def latent_probe(loaded: LoadedMode, examples: list[dict[str, Any]], cache_dir: Path, cfg: EvaluateConfig
                 ) -> dict[str, Any] | None:
    """codi.probe.probe_report of the latent model: the linear probe fit on the first probe_train_examples train
    examples' blocks, scored per evaluated split; None (said) when no train block holds a value."""
    from codi.modeling import CodiModel
    from codi.tokens import token_ids

    codi = loaded.codi
    model = CodiModel(loaded.model, token_ids(loaded.tokenizer), codi.config.options, codi.config.weights)
    model.projector = loaded.projector
    pieces = TokenPieces(loaded.tokenizer)

    def slots(exs: list[dict[str, Any]]) -> list:
        return [assigned_values(e["trace_text"], e["trace_ids"], e["spans"], pieces) for e in exs]

    train_ds = CacheDataset(cache_dir / "train.arrow", limit=cfg.probe_train_examples)
    texts = train_ds.column("trace_text")
    train = [train_ds[k] | {"trace_text": texts[k]} for k in range(len(train_ds))]
    train_blocks = collect_blocks(model, train, slots(train), cfg.batch_size, progress="probe: train blocks")
    if not len(train_blocks):
        print(f"evaluate: no latent probe: no LINE frame with an assigned value in the first "
              f"{cfg.probe_train_examples} examples of {cache_dir / 'train.arrow'}")
        return None
    held_out = {}
    for split in dict.fromkeys(e["split"] for e in examples):
        exs = [e for e in examples if e["split"] == split]
        held_out[split] = collect_blocks(model, exs, slots(exs), cfg.batch_size, progress=f"probe: {split} blocks")
    return probe_report(train_blocks, held_out, model.head.weight)


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
    by_mode: dict[str, list[dict[str, Any]]] = {}
    ablated: list[dict[str, Any]] | None = None
    probe = None
    for mode in cfg.modes:
        loaded = load_mode_model(mode, paths, cache_dir)
        tok = loaded.tokenizer
        t0 = time.time()
        lines = ([program_action_lines(tok, e["program"]) for e in examples]
                 if cfg.constrain_actions and mode != "direct" else None)
        results = decode_mode(loaded, examples, cfg, lines, desc=f"decode {mode}")
        by_mode[mode] = score_mode(results, examples)
        rows += by_mode[mode]
        generated += [res.text for res in results]
        acc = sum(r["correct"] for r in by_mode[mode]) / len(examples)
        print(f"evaluate {mode}: {len(examples)} examples in {time.time() - t0:.1f}s, output accuracy {acc:.3f}")
        if mode == "latent":  # what the latents lose: the same decoding with every action line teacher-forced
            forced = score_mode(decode_mode(loaded, examples, cfg, lines, desc="latent, forced actions",
                                            forced=[true_action_lines(tok, e["frames"]) for e in examples]), examples)
            diagnostics = latent_diagnostics(forced, results, loaded.model.get_input_embeddings().weight[:len(tok)], boot)
            print(f"evaluate latent with teacher-forced actions: output accuracy {diagnostics['forced_actions_accuracy']:.3f}")
            if cfg.ablate_latents:  # what the latents carry: the same decoding with one constant latent input
                fed = any(r.latent_count for r in results)  # none fed (no LINE frame written): nothing to replace
                ablated = score_mode(decode_mode(loaded, examples, cfg, lines, desc="latent, constant latents",
                                                 override=mean_latent(results)), examples) if fed else by_mode[mode]
                print(f"evaluate latent with constant latents: output accuracy "
                      f"{sum(r['correct'] for r in ablated) / len(examples):.3f}")
            if cfg.probe_train_examples:
                probe = latent_probe(loaded, examples, cache_dir, cfg)

    ablation = None
    if ablated is not None:
        ablation = {}
        for split in dict.fromkeys(r["split"] for r in rows):
            pick = [k for k, e in enumerate(examples) if e["split"] == split]
            direct = [by_mode["direct"][k] for k in pick] if "direct" in by_mode else None
            ablation[split] = ablation_summary([by_mode["latent"][k] for k in pick], [ablated[k] for k in pick], direct,
                                               cfg.bootstrap_samples, cfg.bootstrap_seed, cfg.ci_level)
    diagnoses = {split: diagnosis((probe or {}).get(split), (ablation or {}).get(split))
                 for split in dict.fromkeys(r["split"] for r in rows) if probe or ablation}
    overall, per_source = summarize(rows, boot)
    by_level = per_difficulty(rows, boot)
    by_split = split_summaries({split: summarize([r for r in rows if r["split"] == split], boot)
                                for split in dict.fromkeys(r["split"] for r in rows)})
    write_json(metrics_dir / "eval.json", compact(overall) | ({"latent_diagnostics": diagnostics} if diagnostics else {})
               | ({"latent_ablation": ablation} if ablation else {}) | ({"latent_probe": probe} if probe else {})
               | ({"latent_diagnosis": diagnoses} if diagnoses else {}))
    write_json(metrics_dir / "eval_by_source.json", {s: compact(v) for s, v in per_source.items()})
    write_json(metrics_dir / "eval_by_difficulty.json", {d: compact(v) for d, v in by_level.items()})
    write_json(metrics_dir / "eval_by_split.json", by_split)
    write_predictions(rows, generated, predictions)
    write_plots(overall, per_source, plots)
    write_probe_plot(probe, plots, why_none="" if cfg.probe_train_examples and "latent" in cfg.modes else
                     "evaluate.probe_train_examples = 0 or no latent mode")
    report = markdown_report(overall, per_source, cfg.splits, by_level, diagnostics, by_split)
    if probe or ablation:
        report += "\n".join(probe_markdown(probe, ablation, diagnoses)) + "\n"
    write_text(metrics_dir / "eval.md", report)
    print(report)
    return 0


def decode_mode(loaded: LoadedMode, examples: list[dict[str, Any]], cfg: EvaluateConfig, lines: list | None, *,
                desc: str, forced: list | None = None, override=None) -> list:
    """Every example decoded by one mode (codi.decoding.iter_decode), in order; `forced`: teacher-forced action
    lines; `override`: one constant latent input (the ablation)."""
    return list(iter_decode(loaded.mode, loaded.model, loaded.tokenizer, [e["prompt_ids"] for e in examples],
                            projector=loaded.projector, latent_steps=loaded.latent_steps,
                            max_new_tokens=cfg.max_new_tokens, max_frames=cfg.max_frames, batch_size=cfg.batch_size,
                            progress=desc, action_lines=lines, forced_actions=forced,
                            value_feedback=loaded.value_feedback, latent_override=override))


def score_mode(results: list, examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The scored rows of one mode's results (codi.metrics.score_example), each with its split."""
    return [score_example(res, ex["frames"], truth=ex["truth"], source=ex["source"], example_id=ex["id"],
                          problem_id=ex["problem_id"], difficulty=ex["difficulty"]) | {"split": ex["split"]}
            for ex, res in zip(examples, results)]
