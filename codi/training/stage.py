"""The frame of every training stage (sft, sft_direct, codi): what happens before a stage builds its model, and
after it trained. A stage keeps only what is its own: building its model, and its summary.

    start = begin("sft", cfg, params.kernels, start=Path("models/base"), cache=Path("data/cache"), argv=argv,
                  missing="run the precompute stage first")
    if isinstance(start, int):          # relaunched as cfg.cpu_processes workers: their exit status
        return start
    start.train, start.val, start.tokenizer   # the cache's splits, and the start model's tokenizer, checked
    ...                                        # the stage builds its model and a TrainingJob; train() runs it
    return finish(done, summary, metrics, plots / "loss.png", curves, title, line)

begin: QLoRA's machine check, the relaunch into CPU workers (codi.infra.launch), the start model's folder (whole:
codi.infra.hf.check_model_folder), the torch threads, the splits (checked against the cache's manifest; an empty
train split is an error naming the file) and the tokenizer (it must be the one that made the cache). finish: the
metrics JSON, the loss curve PNG and the summary line, on the main process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codi.data.cache import CacheDataset, check_tokenizer
from codi.infra.config import ConfigError
from codi.infra.device import set_threads
from codi.infra.files import write_json
from codi.infra.hf import check_model_folder
from codi.infra.kernels import check_cpu_kernels, describe_kernels
from codi.infra.launch import maybe_relaunch
from codi.modeling.lora import check_lora
from codi.schemas.kernels import KernelsConfig
from codi.schemas.train import TrainConfig
from codi.tracing.tokens import load_tokenizer
from codi.training.loop import TrainingRun, training_splits
from codi.training.summary import save_loss_png

START_MADE_BY = {"sft": "precompute", "sft_direct": "precompute", "codi": "sft"}  # the stage that writes each start model


@dataclass(frozen=True)
class StageStart:
    """What every training stage starts from: the cache's train and val splits and the start model's tokenizer."""

    train: CacheDataset
    val: CacheDataset
    tokenizer: Any


def begin(stage: str, cfg: TrainConfig, kernels: KernelsConfig, start: Path, cache: Path, argv: list[str],
          missing: str) -> StageStart | int:
    """The checks and set-up every training stage shares; an int is the exit status of the relaunched workers
    (this process only waited for them). `missing` says what to do when `start` holds no model."""
    check_lora(cfg.lora, stage)
    if (code := maybe_relaunch(cfg.cpu_processes, argv)) is not None:
        return code
    check_cpu_kernels(kernels.cpu)  # in every worker: each computes with the pinned kernels
    if os.environ.get("RANK", "0") == "0":
        print(f"{stage}: {describe_kernels(kernels.cpu)}", flush=True)
    if not (start / "config.json").is_file():
        raise ConfigError(f"{start}: no model here ({missing})")
    check_model_folder(start, made_by=START_MADE_BY[stage])
    set_threads(cfg.torch_threads)
    train_ds, val_ds = training_splits(cache)
    tok = load_tokenizer(start)
    check_tokenizer(tok, cache, start)
    return StageStart(train_ds, val_ds, tok)


def finish(done: TrainingRun, summary: dict[str, Any], metrics: Path, loss_png: Path, curves: Sequence[str],
           title: str, line: str) -> int:
    """The end of a training stage on the main process: the metrics JSON, the loss curves, the summary line."""
    write_json(metrics, summary)
    save_loss_png(done.history, tuple(curves), loss_png, title)
    print(line + (f"; wandb run in {done.wandb_dir}" if done.wandb_dir else ""))
    return 0
