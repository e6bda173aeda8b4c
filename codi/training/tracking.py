"""Where a training stage's metrics go while it runs: wandb (offline unless configured) and dvclive.

    report_to = setup_wandb(params.wandb, "sft", {"sft": to_dict(cfg)}, is_main)   # -> TrainingArguments.report_to
    callback = LiveMetrics("dvclive/sft", resume_step=None)                        # a Trainer callback
    ... train ...; finish_wandb(report_to)

dvclive writes `<dir>/metrics.json` and `<dir>/plots/metrics/**.tsv` at every logging step, keyed by the
optimizer step, so `dvc exp show` and `dvc plots show` see a run in progress.

Either target can be off, and then its package is never imported (a GPU machine without dvc, dvclive or
wandb, such as benchmarks/gpu_check.sh's, trains all the same): wandb with `wandb.mode: disabled` or
WANDB_MODE=disabled, dvclive with CODI_DVCLIVE=off. The stage says at its start what it does not log and why. A
target that is on but whose package is missing stops the stage before training, naming the switch.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.integrations import DVCLiveCallback

from codi.infra.config import UserError
from codi.schemas.wandb import WandbConfig

DVCLIVE_SWITCH = "CODI_DVCLIVE"  # "off": no dvclive files (not a param: where logs go never retrains)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def note(message: str) -> None:
    """One line on stderr at a stage's start: what it does not log, and why."""
    print(f"note: {message}", file=sys.stderr, flush=True)


def experiment_name() -> str:
    """The DVC experiment this run belongs to (`dvc exp run` sets DVC_EXP_NAME), else `workspace`."""
    return os.environ.get("DVC_EXP_NAME") or "workspace"


def setup_wandb(cfg: WandbConfig, stage: str, config: dict[str, Any], is_main: bool) -> list[str]:
    """Start the stage's wandb run (never a prompt) and return TrainingArguments' `report_to`.

    One run per training stage per DVC experiment, named `<experiment>-<stage>`, grouped by the experiment,
    with the params the stage read as its config. WANDB_MODE in the environment wins over params."""
    env = os.environ.get("WANDB_MODE")
    mode = env or cfg.mode
    if mode == "disabled":
        if is_main:
            why = "WANDB_MODE=disabled in the environment" if env else "params wandb.mode = disabled"
            note(f"wandb is off ({why}): this {stage} run logs to no wandb run")
        return []
    if not _installed("wandb"):
        raise UserError(f"wandb.mode = {mode}{' (WANDB_MODE)' if env else ''}, but the wandb package is not installed: "
                        "install it (pip install wandb), or turn wandb off with `wandb.mode: disabled` in the params "
                        "file or WANDB_MODE=disabled")
    if not is_main:
        return ["wandb"]  # the HF callback only logs on the main process
    os.environ["WANDB_MODE"] = mode
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_DIR", str(Path.cwd()))
    os.environ["WANDB_CONSOLE"] = "off"  # the stage's own stdout goes to DVC/Prefect logs, not a wrapper
    import wandb

    exp = experiment_name()
    wandb.init(project=cfg.project, entity=cfg.entity or None, name=f"{exp}-{stage}", group=exp,
               job_type=stage, config=config, mode=mode, reinit="finish_previous",
               settings=wandb.Settings(silent=True, console="off"))
    return ["wandb"]


def finish_wandb(report_to: list[str]) -> str | None:
    """End the stage's wandb run; returns the folder it was written to (None without wandb)."""
    if "wandb" not in report_to:
        return None
    import wandb

    run = wandb.run
    where = getattr(run, "dir", None) if run else None
    if run:
        run.finish()
    return where


NOT_PLOTTED = frozenset({"epoch", "total_flos", "num_input_tokens_seen", "runtime", "samples_per_second",
                         "steps_per_second"})  # bookkeeping, not curves


def dvclive_on() -> bool:
    """Whether dvclive logging is on: CODI_DVCLIVE unset, `on` or `1`; `off` or `0` turns it off."""
    value = os.environ.get(DVCLIVE_SWITCH, "on").strip().lower()
    if value not in ("on", "1", "off", "0"):
        raise UserError(f"{DVCLIVE_SWITCH}={os.environ[DVCLIVE_SWITCH]!r}: expected on or off")
    return value in ("on", "1")


class NoLiveMetrics(TrainerCallback):
    """What LiveMetrics is when dvclive is off: a callback that writes nothing."""

    def __init__(self, directory: Path):
        self.directory = directory


class LiveMetrics(DVCLiveCallback):
    """transformers' dvclive callback, keyed by the optimizer step, with `train/` and `eval/` names and no params dump.

    Its own set-up would log all ~150 TrainingArguments as dvclive params (the stage's params are already in
    params.yaml and the wandb config). The Trainer's end-of-run summary (train_runtime, ...) goes to
    `summary/` in metrics.json only. A resumed run keeps the rows up to its checkpoint's step and drops the
    rows the interrupted run logged after it. With CODI_DVCLIVE=off it is a NoLiveMetrics (dvclive is not
    imported) and the stage says so."""

    def __new__(cls, directory: str | Path, resume_step: int | None):
        if dvclive_on():
            if not _installed("dvclive"):
                raise UserError(f"dvclive is not installed, so this stage cannot write {directory}: install it "
                                f"(pip install dvclive), or set {DVCLIVE_SWITCH}=off to train without dvclive logs")
            return super().__new__(cls)
        note(f"dvclive is off ({DVCLIVE_SWITCH}=off in the environment): no per-step metrics in {directory} "
             "(the stage's metrics JSON and loss plot are still written)")
        return NoLiveMetrics(Path(directory))

    def __init__(self, directory: str | Path, resume_step: int | None):
        from dvclive import Live

        self.directory = Path(directory)
        if resume_step is not None:
            drop_rows_after(self.directory, resume_step)
        live = Live(dir=str(self.directory), resume=resume_step is not None, report=None, save_dvc_exp=False,
                    dvcyaml=None, monitor_system=False)
        super().__init__(live=live, log_model=False)

    def setup(self, args, state, model) -> None:
        self._initialized = True

    def on_log(self, args, state, control, model=None, logs=None, **kwargs) -> None:
        if not state.is_world_process_zero or not logs:
            return
        from dvclive.plots import Metric

        self.live.step = state.global_step
        final = "train_loss" in logs  # the Trainer's end-of-run summary (step logs carry `loss`)
        for key, value in logs.items():
            if not Metric.could_log(value):
                continue
            if final:
                self.live.log_metric(f"summary/{key.removeprefix('train_')}", value, plot=False)
            elif key.startswith("eval_"):
                name = key.removeprefix("eval_")
                self.live.log_metric(f"eval/{name}", value, plot=name not in NOT_PLOTTED)
            else:
                name = key.removeprefix("train_")
                self.live.log_metric(f"train/{name}", value, plot=name not in NOT_PLOTTED)
        self.live.next_step()


def drop_rows_after(directory: Path, step: int) -> None:
    """Remove the rows of every dvclive metrics tsv under `directory` whose step is past `step`."""
    for tsv in (directory / "plots" / "metrics").rglob("*.tsv"):
        with open(tsv, newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
        if not rows:
            continue
        kept = [r for r in rows if int(float(r["step"])) <= step]
        with open(tsv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t")
            w.writeheader()
            w.writerows(kept)
