"""The evaluation itself, without files: load each mode's model, decode the examples, score them, summarise.

    examples = load_examples(Path("data/cache"), ["val", "test"], limit=0)
    result = evaluate(examples, cfg, {"sft": ..., "codi": ..., "sft_direct": ...}, Path("data/cache"))
    result.by_split["test"]["synthetic"]["latent"]["output_accuracy"]
    write_reports(result, cfg, metrics_dir, predictions, plots)     # codi.evaluation.report: the one writer

The evaluation runs as units (`work_units`): explicit's and latent's free decoding, interleaved batch by batch so
that the two are timed under the same conditions (`decode_timed`: the wall speedup compares them); for the latent
mode, the decoding with every action teacher-forced and the latent probe (codi.evaluation.probe); direct's
decoding; and, once the free latent decoding has given its mean latent, the constant-latent ablation
(`evaluate.ablate_latents`) in up to one part per process, balanced by cost. With `evaluate.processes` > 1 the
units run in that many spawned processes, each loading the models it needs: every accuracy, prediction and probe
figure is the one a single process computes (the same examples, batches and kernels). The stage `evaluate`
(codi/stages/evaluate.py) and `python -m experiments.fresh_seed` both run this.
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
from codi.infra.hf import check_model_folder, load_causal_lm
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
    latent_unit: str = "locals"  # latent: what a block stands for (codi.latent_unit): parsing and scoring follow it
    frames_per_block: int = 1    # latent: LINE frames a block stands for (codi.frames_per_block)
    latent_call: bool = False    # latent: the entry call's frame is latent too (codi.latent_call)
    codi: Any = None  # latent: the LoadedCodi (the probe rebuilds its CodiModel)


def mode_folder(mode: str, paths: dict[str, Path]) -> Path:
    """The model folder a mode decodes with; one that holds no model, or a damaged one, is a clear error."""
    path = paths[MODE_MODEL[mode]]
    if not (path / "config.json").is_file():
        raise ConfigError(f"evaluate.modes includes {mode!r}, but {path} holds no model (run its stage first: "
                          f"dvc repro {MODE_MODEL[mode]})")
    check_model_folder(path, made_by=MODE_MODEL[mode])
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
                          opts.value_feedback, opts.latent_unit, opts.frames_per_block, opts.latent_call, loaded)
    tok = load_tokenizer(path)
    check_tokenizer(tok, cache_dir, path)
    return LoadedMode(mode, load_causal_lm(path, torch.float32).eval(), tok)


def mode_lines(loaded: LoadedMode, examples: list[dict[str, Any]], cfg: EvaluateConfig) -> list | None:
    """Each example's program lines as token ids (constrained actions), or None (direct, or evaluate.constrain_actions off)."""
    if not cfg.constrain_actions or loaded.mode == "direct":
        return None
    return [program_action_lines(loaded.tokenizer, e["program"]) for e in examples]


def decode_mode(loaded: LoadedMode, examples: list[dict[str, Any]], cfg: EvaluateConfig, lines: list | None, *,
                desc: str, forced: list | None = None, override=None) -> list:
    """Every example decoded by one mode (codi.evaluation.decoding.iter_decode), in order; `forced`: teacher-forced
    action lines; `override`: one constant latent input (the ablation)."""
    return list(iter_decode(loaded.mode, loaded.model, loaded.tokenizer, [e["prompt_ids"] for e in examples],
                            projector=loaded.projector, latent_steps=loaded.latent_steps,
                            max_new_tokens=cfg.max_new_tokens, max_frames=cfg.max_frames, batch_size=cfg.batch_size,
                            progress=desc, action_lines=lines, forced_actions=forced,
                            value_feedback=loaded.value_feedback, latent_override=override,
                            latent_unit=loaded.latent_unit, frames_per_block=loaded.frames_per_block,
                            latent_call=loaded.latent_call))


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


@dataclass
class LatentFeed:
    """What the latent mode's free decoding hands the units after it: the constant of the ablation (None when no
    latent was fed), and the statistics of the latents it fed (codi.evaluation.metrics.latent_diagnostics)."""

    mean_latent: Any
    norms: list[float]
    cosines: list[float]
    embedding_norm: float
    positions: list[int]  # generated positions per example: what a batch of the ablation will cost, roughly


@dataclass
class TimedDecodes:
    """The timed unit's result: every mode's free decoding, and the latent mode's LatentFeed (None without it)."""

    modes: dict[str, ModeResult]
    latent: LatentFeed | None


def decode_timed(modes: tuple[str, ...], examples: list[dict[str, Any]], cfg: EvaluateConfig, paths: dict[str, Path],
                 cache_dir: Path) -> TimedDecodes:
    """The free decoding of `modes`, interleaved batch by batch (batch k of each mode, then batch k + 1), so that
    whatever else loads the machine (the other units, other jobs) falls on every mode alike and no mode alone pays
    the process's warm-up: the modes' times, and so the wall speedup, compare like with like. Each mode decodes the
    same batches as it would alone, so its results are those of its own decode_mode."""
    from tqdm.auto import tqdm

    from codi.evaluation.decoding import decode

    loaded = {m: load_mode_model(m, paths, cache_dir) for m in modes}
    lines = {m: mode_lines(loaded[m], examples, cfg) for m in modes}
    prompts = [e["prompt_ids"] for e in examples]
    results: dict[str, list] = {m: [] for m in modes}
    seconds = dict.fromkeys(modes, 0.0)
    for s in tqdm(range(0, len(prompts), cfg.batch_size), desc="decode " + ", ".join(modes) + " (interleaved)",
                  unit="batch"):
        for m in modes:
            one = loaded[m]
            t0 = time.time()
            results[m].extend(decode(m, one.model, one.tokenizer, prompts[s:s + cfg.batch_size], projector=one.projector,
                                     latent_steps=one.latent_steps, max_new_tokens=cfg.max_new_tokens,
                                     max_frames=cfg.max_frames, value_feedback=one.value_feedback,
                                     latent_unit=one.latent_unit, frames_per_block=one.frames_per_block,
                                     latent_call=one.latent_call,
                                     action_lines=None if lines[m] is None else lines[m][s:s + cfg.batch_size]))
            seconds[m] += time.time() - t0
    out = {}
    for m in modes:
        out[m] = ModeResult(m, score_mode(results[m], examples), [r.text for r in results[m]], seconds[m])
        print(f"evaluate {m}: {len(examples)} examples in {seconds[m]:.1f}s, output accuracy {out[m].accuracy:.3f}")
    feed = None
    if "latent" in modes:
        fed = results["latent"]
        tok = loaded["latent"].tokenizer
        emb = loaded["latent"].model.get_input_embeddings().weight[:len(tok)]
        feed = LatentFeed(mean_latent(fed) if any(r.latent_count for r in fed) else None,
                          [r.latent_norm for r in fed if r.latent_norm is not None],
                          [r.latent_cosine for r in fed if r.latent_cosine is not None],
                          float(emb.detach().float().norm(dim=-1).mean()), [r.positions for r in fed])
    return TimedDecodes(out, feed)


@dataclass(frozen=True)
class WorkUnit:
    """An independent piece of the evaluation: modes' free decoding (`decode`; several modes interleaved,
    `decode_timed`), the latent decoding with teacher-forced actions (`forced`), the examples [start, stop) of the
    constant-latent ablation (`constant`: it needs the free latent decoding's mean latent), or the latent probe
    (`probe`)."""

    kind: str
    modes: tuple[str, ...] = ("latent",)
    start: int = 0
    stop: int = 0


TIMED_MODES = ("explicit", "latent")  # the wall speedup compares these two: they are decoded interleaved


def work_units(cfg: EvaluateConfig) -> list[WorkUnit]:
    """The units that need nothing from another, longest first: explicit's and latent's decoding, interleaved (the
    speedup compares them), then latent's forced actions and probe, then the other modes (direct's short answers).
    The constant-latent ablation follows the latent decoding (`ablation_units`)."""
    timed = tuple(m for m in cfg.modes if m in TIMED_MODES)
    units = [WorkUnit("decode", timed)] if timed else []
    if "latent" in cfg.modes:
        units.append(WorkUnit("forced"))
        if cfg.probe_train_examples > 0:
            units.append(WorkUnit("probe"))
    return units + [WorkUnit("decode", (m,)) for m in cfg.modes if m not in TIMED_MODES]


def ablation_units(cfg: EvaluateConfig, positions: list[int]) -> list[WorkUnit]:
    """The constant-latent ablation in up to evaluate.processes parts, each a run of whole batches (so that every
    part decodes the batches the whole would), balanced by what the free latent decoding of those batches cost
    (`positions`, generated positions per example): none without the latent mode or evaluate.ablate_latents."""
    if "latent" not in cfg.modes or not cfg.ablate_latents or not positions:
        return []
    bs = cfg.batch_size
    costs = [sum(positions[b:b + bs]) for b in range(0, len(positions), bs)]
    bounds = balanced_bounds(costs, min(cfg.processes, len(costs)))
    return [WorkUnit("constant", ("latent",), lo * bs, min(hi * bs, len(positions)))
            for lo, hi in zip(bounds, bounds[1:])]


def balanced_bounds(costs: list[float], parts: int) -> list[int]:
    """Boundaries 0 = b_0 < b_1 < ... < b_k = len(costs) that cut `costs` into k <= `parts` non-empty consecutive
    runs, each cut where the running total comes nearest to its share of the whole."""
    total, n = float(sum(costs)), len(costs)
    bounds, running = [0], 0.0
    for k in range(1, parts):
        target = total * k / parts
        cut = bounds[-1] + 1  # at least one batch per part
        running = sum(costs[:cut])
        while cut < n - (parts - k) and abs(running + costs[cut] - target) <= abs(running - target):
            running += costs[cut]
            cut += 1
        if cut >= n:
            break
        bounds.append(cut)
    return bounds + [n]


def run_unit(unit: WorkUnit, examples: list[dict[str, Any]], cfg: EvaluateConfig, paths: dict[str, Path],
             cache_dir: Path, boot: Bootstrap, override=None) -> Any:
    """One unit, in this process: TimedDecodes, the forced rows, a part's ablated rows, or the probe's report."""
    if unit.kind == "decode":
        return decode_timed(unit.modes, examples, cfg, paths, cache_dir)
    loaded = load_mode_model("latent", paths, cache_dir)
    if unit.kind == "probe":
        return latent_probe(loaded, examples, cache_dir, cfg)
    if unit.kind == "forced":
        tok = loaded.tokenizer
        rows = score_mode(decode_mode(loaded, examples, cfg, mode_lines(loaded, examples, cfg),
                                      desc="latent, forced actions",
                                      forced=[true_action_lines(tok, e["frames"]) for e in examples]), examples)
        print(f"evaluate latent with teacher-forced actions: output accuracy "
              f"{sum(r['correct'] for r in rows) / max(len(rows), 1):.3f}")
        return rows
    if unit.kind == "constant":
        part = examples[unit.start:unit.stop]
        return score_mode(decode_mode(loaded, part, cfg, mode_lines(loaded, part, cfg),
                                      desc=f"latent, constant latents (examples {unit.start}-{unit.stop - 1})",
                                      override=override), part)
    raise ValueError(f"unknown work unit {unit!r}")


def run_units(examples: list[dict[str, Any]], cfg: EvaluateConfig, paths: dict[str, Path], cache_dir: Path,
              boot: Bootstrap) -> dict[WorkUnit, Any]:
    """Every unit's result: in this process (evaluate.processes 1), or in a pool of spawned processes (each with
    evaluate.torch_threads threads; the CPU kernel pins reach them through the environment). The ablation's parts
    are submitted when the timed unit has given their constant, and take the processes that are free then."""
    units = work_units(cfg)
    for unit in units:  # a missing model is said at once, before any process starts
        for mode in unit.modes:
            mode_folder(mode, paths)

    def then_ablation(done: dict[WorkUnit, Any]) -> tuple[list[WorkUnit], Any]:
        feed = done[units[0]].latent if units[0].kind == "decode" else None
        if feed is None or feed.mean_latent is None:  # no latent mode, or none fed: nothing to replace
            return [], None
        return ablation_units(cfg, feed.positions), feed.mean_latent

    if cfg.processes <= 1:
        done = {unit: run_unit(unit, examples, cfg, paths, cache_dir, boot) for unit in units}
        more, override = then_ablation(done)
        done.update({unit: run_unit(unit, examples, cfg, paths, cache_dir, boot, override) for unit in more})
        return done
    with ProcessPoolExecutor(cfg.processes, mp_context=multiprocessing.get_context("spawn"), initializer=set_threads,
                             initargs=(cfg.torch_threads,)) as pool:
        futures = {unit: pool.submit(run_unit, unit, examples, cfg, paths, cache_dir, boot) for unit in units}
        try:
            done = {units[0]: futures[units[0]].result()}
            more, override = then_ablation(done)
            futures.update({unit: pool.submit(run_unit, unit, examples, cfg, paths, cache_dir, boot, override)
                            for unit in more})
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
    done = run_units(examples, cfg, paths, cache_dir, boot)
    decoded = {m: r for u in done if u.kind == "decode" for m, r in done[u].modes.items()}
    modes: dict[str, ModeResult] = {m: decoded[m] for m in cfg.modes}
    if "latent" in modes:
        latent = modes["latent"]
        forced = done[WorkUnit("forced")]
        feed = next(done[u].latent for u in done if u.kind == "decode" and "latent" in u.modes)
        latent.diagnostics = latent_diagnostics(forced, feed.norms, feed.cosines, feed.embedding_norm, boot)
        parts = sorted((u for u in done if u.kind == "constant"), key=lambda u: u.start)
        if cfg.ablate_latents:  # none fed (no LINE frame written): nothing to replace, the rows are latent's own
            latent.ablated_rows = [r for u in parts for r in done[u]] if parts else latent.rows
            print(f"evaluate latent with constant latents: output accuracy "
                  f"{sum(r['correct'] for r in latent.ablated_rows) / len(examples):.3f}")
        latent.probe = done.get(WorkUnit("probe"))
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
