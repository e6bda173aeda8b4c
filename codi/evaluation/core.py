"""The evaluation itself, without files: load each mode's model, decode the examples, score them, summarise.

    examples = load_examples(Path("data/cache"), ["val", "test"], limit=0)
    result = evaluate(examples, cfg, {"sft": ..., "codi": ..., "sft_direct": ...}, Path("data/cache"))
    result.by_split["test"]["synthetic"]["latent"]["output_accuracy"]
    write_reports(result, cfg, metrics_dir, predictions, plots)     # codi.evaluation.report: the one writer

`evaluate_mode` decodes one mode (codi.evaluation.decoding) and scores it (codi.evaluation.metrics). For the
latent mode it also measures what the latents carry (codi.evaluation.probe): teacher-forced actions and the
constant-latent ablation (`evaluate.ablate_latents`); the latent probe (`evaluate.probe_train_examples`) is a
work unit of its own, since it decodes nothing. The units (each mode's decoding, the probe) share no state, so
with `evaluate.processes` > 1 they run in that many spawned processes, longest first, each loading the model it
needs: every accuracy, prediction and probe figure is the one a single process computes (the same examples,
batches and kernels), and the stage's wall time is about that of its longest unit; but each mode's decoding time,
and so the wall speedup, is then measured while other units load the machine (1, the shipped value, when the
speedup is a figure to report). The stage `evaluate` (codi/stages/evaluate.py) and
`python -m experiments.fresh_seed` both run this.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from codi.data.cache import CacheDataset, check_tokenizer
from codi.data.values import TokenPieces, assigned_values
from codi.evaluation.decoding import iter_decode, mean_latent, program_action_lines, true_action_lines
from codi.evaluation.metrics import Bootstrap, latent_diagnostics, per_difficulty, score_example, summarize
from codi.evaluation.probe import ablation_summary, collect_blocks, diagnosis, probe_report
from codi.evaluation.report import split_summaries
from codi.infra.config import ConfigError
from codi.infra.device import set_threads
from codi.infra.hf import load_causal_lm
from codi.schemas.evaluate import EvaluateConfig
from codi.tracing.format import parse_trace
from codi.tracing.tokens import load_tokenizer

MODE_MODEL = {"explicit": "sft", "latent": "codi", "direct": "sft_direct"}  # the model folder each mode decodes


def load_examples(cache_dir: Path, splits: list[str], limit: int) -> list[dict[str, Any]]:
    """The examples of `splits` (the first `limit` of each; 0 = all), each with what decoding and scoring need."""
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


def mode_folder(mode: str, paths: dict[str, Path]) -> Path:
    """The model folder a mode decodes with; one that holds no model is a clear error."""
    path = paths[MODE_MODEL[mode]]
    if not (path / "config.json").is_file():
        raise ConfigError(f"evaluate.modes includes {mode!r}, but {path} holds no model (run its stage first)")
    return path


def load_mode_model(mode: str, paths: dict[str, Path], cache_dir: Path) -> LoadedMode:
    """A mode's LoadedMode; a missing folder, or a tokenizer that did not make the cache, is a clear error."""
    import torch

    path = mode_folder(mode, paths)
    if mode == "latent":
        from codi.modeling.io import load_codi_model
        loaded = load_codi_model(path, dtype=torch.float32)
        check_tokenizer(loaded.tokenizer, cache_dir, path)
        opts = loaded.config.options
        return LoadedMode(mode, loaded.model, loaded.tokenizer, loaded.projector, opts.latent_steps,
                          opts.value_feedback, loaded)
    tok = load_tokenizer(path)
    check_tokenizer(tok, cache_dir, path)
    return LoadedMode(mode, load_causal_lm(path, torch.float32).eval(), tok)


def decode_mode(loaded: LoadedMode, examples: list[dict[str, Any]], cfg: EvaluateConfig, lines: list | None, *,
                desc: str, forced: list | None = None, override=None) -> list:
    """Every example decoded by one mode (codi.evaluation.decoding.iter_decode), in order; `forced`: teacher-forced
    action lines; `override`: one constant latent input (the ablation)."""
    return list(iter_decode(loaded.mode, loaded.model, loaded.tokenizer, [e["prompt_ids"] for e in examples],
                            projector=loaded.projector, latent_steps=loaded.latent_steps,
                            max_new_tokens=cfg.max_new_tokens, max_frames=cfg.max_frames, batch_size=cfg.batch_size,
                            progress=desc, action_lines=lines, forced_actions=forced,
                            value_feedback=loaded.value_feedback, latent_override=override))


def score_mode(results: list, examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The scored rows of one mode's results (codi.evaluation.metrics.score_example), each with its split."""
    return [score_example(res, ex["frames"], truth=ex["truth"], source=ex["source"], example_id=ex["id"],
                          problem_id=ex["problem_id"], difficulty=ex["difficulty"]) | {"split": ex["split"]}
            for ex, res in zip(examples, results)]


def latent_probe(loaded: LoadedMode, examples: list[dict[str, Any]], cache_dir: Path, cfg: EvaluateConfig
                 ) -> dict[str, Any] | None:
    """codi.evaluation.probe.probe_report of the latent model: the linear probe fit on the first
    probe_train_examples train examples' blocks, scored per evaluated split; None (said) when no train block holds
    a value."""
    from codi.modeling.model import CodiModel
    from codi.tracing.tokens import token_ids

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


@dataclass
class ModeResult:
    """One mode on every example: its scored rows (example order), the generated texts, and for latent what the
    latents carry (diagnostics with teacher-forced actions, the ablation's rows, the probe)."""

    mode: str
    rows: list[dict[str, Any]]
    generated: list[str]
    seconds: float
    diagnostics: dict[str, Any] | None = None
    ablated_rows: list[dict[str, Any]] | None = None
    probe: dict[str, Any] | None = None

    @property
    def accuracy(self) -> float:
        return sum(r["correct"] for r in self.rows) / max(len(self.rows), 1)


def evaluate_mode(loaded: LoadedMode, examples: list[dict[str, Any]], cfg: EvaluateConfig, boot: Bootstrap
                  ) -> ModeResult:
    """Decode and score one mode; for latent also the forced-action diagnostics and the ablation."""
    tok, mode = loaded.tokenizer, loaded.mode
    t0 = time.time()
    lines = ([program_action_lines(tok, e["program"]) for e in examples]
             if cfg.constrain_actions and mode != "direct" else None)
    results = decode_mode(loaded, examples, cfg, lines, desc=f"decode {mode}")
    out = ModeResult(mode, score_mode(results, examples), [res.text for res in results], time.time() - t0)
    print(f"evaluate {mode}: {len(examples)} examples in {out.seconds:.1f}s, output accuracy {out.accuracy:.3f}")
    if mode != "latent":
        return out
    # what the latents lose: the same decoding with every action line teacher-forced
    forced = score_mode(decode_mode(loaded, examples, cfg, lines, desc="latent, forced actions",
                                    forced=[true_action_lines(tok, e["frames"]) for e in examples]), examples)
    out.diagnostics = latent_diagnostics(forced, results, loaded.model.get_input_embeddings().weight[:len(tok)], boot)
    print(f"evaluate latent with teacher-forced actions: output accuracy {out.diagnostics['forced_actions_accuracy']:.3f}")
    if cfg.ablate_latents:  # what the latents carry: the same decoding with one constant latent input
        fed = any(r.latent_count for r in results)  # none fed (no LINE frame written): nothing to replace
        out.ablated_rows = score_mode(decode_mode(loaded, examples, cfg, lines, desc="latent, constant latents",
                                                  override=mean_latent(results)), examples) if fed else out.rows
        print(f"evaluate latent with constant latents: output accuracy "
              f"{sum(r['correct'] for r in out.ablated_rows) / len(examples):.3f}")
    return out


@dataclass(frozen=True)
class WorkUnit:
    """An independent piece of the evaluation: one mode's decoding (`decode`), or the latent probe (`probe`)."""

    kind: str
    mode: str


def work_units(cfg: EvaluateConfig) -> list[WorkUnit]:
    """The evaluation's units. In one process: evaluate.modes' order, the probe after the latent decodes (so each
    mode is timed where it always was: the first one also pays the process's warm-up). In several: longest first
    on the default (latent decodes three times: free, teacher-forced actions, constant latents; then explicit's
    long traces, the probe's forced passes, direct's short answers), so that the workers end at about one time."""
    probe = "latent" in cfg.modes and cfg.probe_train_examples > 0
    if cfg.processes <= 1:
        return [unit for mode in cfg.modes for unit in
                [WorkUnit("decode", mode)] + ([WorkUnit("probe", mode)] if mode == "latent" and probe else [])]
    decodes = [WorkUnit("decode", mode) for mode in ("latent", "explicit") if mode in cfg.modes]
    rest = [WorkUnit("decode", mode) for mode in cfg.modes if mode not in ("latent", "explicit")]
    return decodes + ([WorkUnit("probe", "latent")] if probe else []) + rest


def run_unit(unit: WorkUnit, examples: list[dict[str, Any]], cfg: EvaluateConfig, paths: dict[str, Path],
             cache_dir: Path, boot: Bootstrap) -> ModeResult | dict[str, Any] | None:
    """One unit, in this process: a decode's ModeResult, or the probe's report."""
    loaded = load_mode_model(unit.mode, paths, cache_dir)
    if unit.kind == "probe":
        return latent_probe(loaded, examples, cache_dir, cfg)
    return evaluate_mode(loaded, examples, cfg, boot)


def run_units(units: list[WorkUnit], examples: list[dict[str, Any]], cfg: EvaluateConfig, paths: dict[str, Path],
              cache_dir: Path, boot: Bootstrap) -> dict[WorkUnit, Any]:
    """Every unit's result: in this process (evaluate.processes 1), or in a pool of spawned processes (each with
    evaluate.torch_threads threads; the CPU kernel pins reach them through the environment)."""
    workers = min(cfg.processes, len(units))
    if workers <= 1:
        return {unit: run_unit(unit, examples, cfg, paths, cache_dir, boot) for unit in units}
    for unit in units:  # a missing model is said at once, before any process starts
        mode_folder(unit.mode, paths)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=set_threads,
                             initargs=(cfg.torch_threads,)) as pool:
        futures = {unit: pool.submit(run_unit, unit, examples, cfg, paths, cache_dir, boot) for unit in units}
        try:
            return {unit: future.result() for unit, future in futures.items()}
        except BaseException:  # a unit's error (raised here as it was there): start no other unit
            for future in futures.values():
                future.cancel()
            raise


@dataclass
class Evaluation:
    """Every mode's result and the summaries the reports are made of."""

    modes: dict[str, ModeResult]
    overall: dict[str, Any]
    per_source: dict[str, Any]
    by_level: dict[str, Any]
    by_split: dict[str, Any]
    splits: list[str]
    ablation: dict[str, Any] | None = None
    diagnoses: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [r for m in self.modes.values() for r in m.rows]

    @property
    def generated(self) -> list[str]:
        return [t for m in self.modes.values() for t in m.generated]

    @property
    def diagnostics(self) -> dict[str, Any] | None:
        return self.modes["latent"].diagnostics if "latent" in self.modes else None

    @property
    def probe(self) -> dict[str, Any] | None:
        return self.modes["latent"].probe if "latent" in self.modes else None


def evaluate(examples: list[dict[str, Any]], cfg: EvaluateConfig, paths: dict[str, Path], cache_dir: Path
             ) -> Evaluation:
    """Every mode of `cfg.modes` on `examples` (models from `paths`: sft, codi, sft_direct), summarised overall,
    per source, per difficulty level and per split; with the ablation per split when the latent mode ran it."""
    if not examples:
        raise ConfigError(f"evaluate.splits = {cfg.splits}: no examples in {cache_dir} for these splits")
    boot = Bootstrap(cfg.bootstrap_samples, cfg.bootstrap_seed, cfg.ci_level)
    done = run_units(work_units(cfg), examples, cfg, paths, cache_dir, boot)
    modes: dict[str, ModeResult] = {mode: done[WorkUnit("decode", mode)] for mode in cfg.modes}
    if WorkUnit("probe", "latent") in done:
        modes["latent"].probe = done[WorkUnit("probe", "latent")]
    rows = [r for m in modes.values() for r in m.rows]
    split_names = list(dict.fromkeys(r["split"] for r in rows))
    latent = modes.get("latent")
    ablation = None
    if latent is not None and latent.ablated_rows is not None:
        ablation = {}
        for split in split_names:
            pick = [k for k, e in enumerate(examples) if e["split"] == split]
            direct = [modes["direct"].rows[k] for k in pick] if "direct" in modes else None
            ablation[split] = ablation_summary([latent.rows[k] for k in pick], [latent.ablated_rows[k] for k in pick],
                                               direct, cfg.bootstrap_samples, cfg.bootstrap_seed, cfg.ci_level)
    probe = latent.probe if latent is not None else None
    diagnoses = {split: diagnosis((probe or {}).get(split), (ablation or {}).get(split))
                 for split in split_names if probe or ablation}
    overall, per_source = summarize(rows, boot)
    by_level = per_difficulty(rows, boot)
    by_split = split_summaries({split: summarize([r for r in rows if r["split"] == split], boot)
                                for split in split_names})
    return Evaluation(modes, overall, per_source, by_level, by_split, list(cfg.splits), ablation, diagnoses)
