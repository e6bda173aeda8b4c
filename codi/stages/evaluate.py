"""Stage `evaluate`: explicit-trace vs latent vs no-trace decoding on held-out problems.

    python -m codi evaluate      # metrics/eval.{json,md}, eval_by_{source,difficulty,split}.json, predictions, plots

The evaluation itself is codi.evaluation.core (no files written): this stage loads the examples, runs it and
writes the reports (codi.evaluation.writer.write_reports). Each mode decodes greedily (codi.evaluation.decoding):
`explicit` = the sft model writes the trace, `latent` = the codi model writes it with a latent block per LINE
frame (exactly the latent_steps it was trained with), `direct` = the sft_direct baseline writes only the answer.
Scores: codi.evaluation.metrics. For the latent mode, what the latents carry (codi.evaluation.probe): the
constant-latent ablation (evaluate.ablate_latents) and the latent probe (evaluate.probe_train_examples), in
eval.json's latent_ablation / latent_probe and eval.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from codi.evaluation.core import evaluate, load_examples
from codi.evaluation.writer import write_reports
from codi.infra.device import set_threads
from codi.infra.kernels import check_cpu_kernels, describe_kernels
from codi.schemas.evaluate import EvaluateConfig
from codi.schemas.kernels import KernelsConfig


@dataclass(frozen=True)
class EvaluateParams:
    """What this stage reads from params.yaml (the codi model's options come from its folder)."""

    evaluate: EvaluateConfig
    kernels: KernelsConfig


def run(params: EvaluateParams, cache: Path, sft: Path, codi: Path, direct: Path, metrics: Path, predictions: Path,
        plots: Path) -> int:
    cfg = params.evaluate
    check_cpu_kernels(params.kernels.cpu)
    print(f"evaluate: {describe_kernels(params.kernels.cpu)}")
    set_threads(cfg.torch_threads)
    examples = load_examples(cache, cfg.splits, cfg.max_examples)
    result = evaluate(examples, cfg, {"sft": sft, "codi": codi, "sft_direct": direct}, cache)
    print(write_reports(result, cfg, metrics, predictions, plots))
    return 0
