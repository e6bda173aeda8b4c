"""Params: the whole params.yaml, one section schema each from codi/schemas/ (codi/infra/config.py loads it).

    $ python -m codi params          # every key, its value, type and doc
    from codi.infra.config import load_params
    params = load_params("params.yaml")          # a Params

A stage reads only its own sections (the dataclass its `run` takes), so that it depends only on their schemas;
every section is still checked before any stage starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from codi.infra.config import option
from codi.schemas.codi import CodiConfig, TopLevelWeights
from codi.schemas.evaluate import EvaluateConfig
from codi.schemas.extract import ExtractConfig
from codi.schemas.kernels import KernelsConfig
from codi.schemas.model import ModelConfig
from codi.schemas.pipeline import PipelineConfig
from codi.schemas.precompute import PrecomputeConfig
from codi.schemas.train import SftConfig, TrainConfig
from codi.schemas.wandb import WandbConfig


@dataclass(frozen=True)
class Params(TopLevelWeights):
    """The whole params.yaml: alpha, beta, gamma, then a section per stage, kernels, wandb and pipeline."""

    extract: ExtractConfig = option("stage extract")
    precompute: PrecomputeConfig = option("stage precompute")
    model: ModelConfig = option("the base model")
    sft: SftConfig = option("stage sft")
    sft_direct: TrainConfig = option("stage sft_direct")
    codi: CodiConfig = option("stage codi")
    evaluate: EvaluateConfig = option("stage evaluate")
    kernels: KernelsConfig = option("which CPU kernels torch computes with (every stage that runs torch)")
    wandb: WandbConfig = option("wandb logging")
    pipeline: PipelineConfig = option("the Prefect deployment")
