"""What the training stages share: TrainingArguments from params, resumable checkpoints, atomic model
writes, wandb set-up, loss history (metrics + plots), and the device/precision/optimizer policy.

    args = training_arguments(cfg, output_dir=ckpt.run_dir, run_name=name, report_to=report)
    ckpt = CheckpointDir("checkpoints/sft", fingerprint)   # resume only the same run
    resume = ckpt.prepare()                                 # last *complete* checkpoint or None
    with atomic_dir("models/sft") as tmp: model.save_pretrained(tmp)

Checkpoints: a stage run is identified by a fingerprint of everything that determines its result
(its params, the cache's content hashes, the starting model). `checkpoints/<stage>/run.json` records
it. A rerun with the same fingerprint (after a kill) resumes from the newest checkpoint that is
complete; any other fingerprint refuses to resume, says what changed, and starts from step 0 — a
checkpoint is never continued under different data, model shape or hyperparameters.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from codi.config import TrainConfig, WandbConfig

log = logging.getLogger("codi.training")
CHECKPOINT_PREFIX = "checkpoint-"


# ------------------------------------------------------------------------------- device policy
def use_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def resolve_precision(precision: str) -> dict[str, bool]:
    """`auto`: bf16 where the GPU supports it, fp32 on CPU (bf16 matmuls on CPU are slow and lossy)."""
    import torch
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def resolve_optimizer(optimizer: str) -> str:
    """`auto`: paged 8-bit AdamW on a GPU with bitsandbytes installed, AdamW otherwise."""
    if optimizer != "auto":
        return optimizer
    if use_cuda():
        try:
            import bitsandbytes  # noqa: F401
            return "paged_adamw_8bit"
        except ImportError:
            pass
    return "adamw_torch"


def set_threads(n: int) -> None:
    """One intra-op thread is several times faster than two for tiny models on these CPUs."""
    import torch
    if n > 0 and not use_cuda():
        torch.set_num_threads(n)


def training_arguments(cfg: TrainConfig, output_dir: Path, run_name: str, report_to: list[str],
                       has_eval: bool, **extra: Any):
    """Every TrainingArguments value from the params section; nothing hard-coded that a user would tune."""
    from transformers import TrainingArguments

    keep_best = cfg.keep == "best" and has_eval
    kw: dict[str, Any] = dict(
        output_dir=str(output_dir),
        run_name=run_name,
        max_steps=cfg.max_steps,
        num_train_epochs=cfg.epochs,
        learning_rate=cfg.lr,
        lr_scheduler_type=cfg.lr_schedule,
        warmup_steps=cfg.warmup_ratio,  # a float < 1 is a ratio of the total steps in transformers 5
        weight_decay=cfg.weight_decay,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.eval_batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        max_grad_norm=cfg.max_grad_norm,
        optim=resolve_optimizer(cfg.optimizer),
        **resolve_precision(cfg.precision),
        activation_checkpointing=cfg.gradient_checkpointing,
        seed=cfg.seed,
        data_seed=cfg.seed,
        logging_strategy="steps",
        logging_steps=cfg.logging_steps,
        logging_first_step=True,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=cfg.eval_steps,
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit or None,
        load_best_model_at_end=keep_best,
        metric_for_best_model="eval_loss" if keep_best else None,
        greater_is_better=False if keep_best else None,
        report_to=report_to,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        # gloo for CPU processes under torchrun; the Trainer picks nccl on GPUs. Single process: none.
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not use_cuda() else None,
        ddp_find_unused_parameters=False,
        disable_tqdm=False,
        use_cpu=not use_cuda(),
    )
    kw.update(extra)  # stage-specific settings (e.g. codi's own checkpointing) win
    return TrainingArguments(**kw)


def grouped_trainer_class():
    """HF Trainer whose train sampler groups examples of similar length (prompt + trace tokens).

    The cache knows every example's length without touching the token buffers; HF's own
    group_by_length only knows `datasets.Dataset` columns or items with `input_ids`."""
    from transformers import Trainer
    from transformers.trainer_pt_utils import LengthGroupedSampler

    class GroupedTrainer(Trainer):
        group_by_length = True

        def _get_train_sampler(self, train_dataset=None):
            ds = train_dataset if train_dataset is not None else self.train_dataset
            if not self.group_by_length or not hasattr(ds, "lengths"):
                return super()._get_train_sampler(train_dataset)
            return LengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                        lengths=ds.lengths)

    return GroupedTrainer


# --------------------------------------------------------------------------------- fingerprints
FINGERPRINT_NAMES = {"cache": "the cache (data/cache/manifest.json)", "model_config": "the starting model's config",
                     "model_weights": "the starting model's weights", "params": "the stage's params section",
                     "weights": "the loss weights alpha, beta, gamma", "stage": "the stage"}


def _describe_change(key: str, old: Any, new: Any) -> str:
    """One fingerprint difference in words: short values shown old -> new, digests only named."""
    what = FINGERPRINT_NAMES.get(key, key)
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return f"{what} changed ({', '.join(f'{k}: {old.get(k)!r} -> {new.get(k)!r}' for k in keys)})"
    if isinstance(old, str) and len(old) >= 32:  # a digest: the values say nothing to a person
        return f"{what} changed"
    return f"{what} changed ({old!r} -> {new!r})"


def file_digest(path: Path, full_limit: int = 1 << 30) -> str:
    """sha256 of a file; files over `full_limit` bytes hash their size, head and tail (model shards)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= full_limit:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            h.update(f.read(1 << 20))
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read())
    return h.hexdigest()


def model_fingerprint(model_dir: Path) -> dict[str, str]:
    """Config (shape) and weights digests of a HF model folder."""
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    w = hashlib.sha256()
    for p in weights:
        w.update(p.name.encode())
        w.update(file_digest(p).encode())
    return {"model_config": file_digest(model_dir / "config.json"), "model_weights": w.hexdigest()}


@dataclass
class CheckpointDir:
    """`root/run.json` + `root/checkpoint-N/`: resume the same run, never a different one."""

    root: Path
    fingerprint: dict[str, Any]

    def prepare(self) -> str | None:
        """Path of the checkpoint to resume from, or None for a fresh start (the folder reset)."""
        run_file = self.root / "run.json"
        old = None
        if run_file.is_file():
            try:
                old = json.loads(run_file.read_text())
            except ValueError:
                log.warning("%s is unreadable: starting fresh", run_file)
        if old is not None and old != self.fingerprint:
            changed = sorted(k for k in set(old) | set(self.fingerprint) if old.get(k) != self.fingerprint.get(k))
            print(f"refusing to resume from {self.root}: {'; '.join(_describe_change(k, old.get(k), self.fingerprint.get(k)) for k in changed)}"
                  "; starting from step 0")
            old = None
        if old is None:
            if self.root.exists():
                shutil.rmtree(self.root)
            self.root.mkdir(parents=True)
            tmp = run_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.fingerprint, indent=2, sort_keys=True))
            tmp.replace(run_file)
            return None
        for ckpt in sorted(self.checkpoints(), key=_step, reverse=True):
            problem = checkpoint_problem(ckpt)
            if problem is None:
                print(f"resuming from {ckpt}")
                return str(ckpt)
            log.warning("skipping incomplete checkpoint %s: %s", ckpt, problem)
            print(f"warning: skipping incomplete checkpoint {ckpt}: {problem}")
        return None

    def checkpoints(self) -> list[Path]:
        return [p for p in self.root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and _step(p) >= 0]

    def last_complete(self) -> Path | None:
        for ckpt in sorted(self.checkpoints(), key=_step, reverse=True):
            if checkpoint_problem(ckpt) is None:
                return ckpt
        return None


def _step(p: Path) -> int:
    try:
        return int(p.name[len(CHECKPOINT_PREFIX):])
    except ValueError:
        return -1


def checkpoint_problem(ckpt: Path, extra_files: tuple[str, ...] = ()) -> str | None:
    """Why `ckpt` cannot be resumed from (None if it can): missing or truncated files.

    HF's get_last_checkpoint takes the highest number without looking; a kill during a save leaves a
    folder that makes the resume crash. torch.save files are zip archives, so a truncated optimizer
    or RNG state fails `zipfile.is_zipfile`; safetensors files carry their header length."""
    state = ckpt / "trainer_state.json"
    try:
        st = json.loads(state.read_text())
    except (OSError, ValueError):
        return "trainer_state.json missing or unreadable"
    if st.get("global_step") != _step(ckpt):
        return f"trainer_state.json says step {st.get('global_step')}"
    for name in ("config.json", *extra_files):
        if not (ckpt / name).is_file():
            return f"{name} missing"
    weights = list(ckpt.glob("*.safetensors"))
    if not weights:
        return "no model weights"
    for w in weights:
        if not _safetensors_ok(w):
            return f"{w.name} truncated"
    for name in ("optimizer.pt", "scheduler.pt"):
        if not zipfile.is_zipfile(ckpt / name) if (ckpt / name).exists() else True:
            return f"{name} missing or truncated"
    rng = list(ckpt.glob("rng_state*.pth"))
    if not rng or not all(zipfile.is_zipfile(r) for r in rng):
        return "RNG state missing or truncated"
    return None


def _safetensors_ok(path: Path) -> bool:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return size >= 8 + n + end
    except (OSError, ValueError, KeyError, TypeError):
        return False


# ------------------------------------------------------------------------------ atomic outputs
@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Write a folder under a temporary name, then move it into place: a kill mid-save never leaves a
    folder at `final` that looks complete."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    tmp.replace(final)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------------- logging
def experiment_name() -> str:
    """The DVC experiment this run belongs to (`dvc exp run` sets DVC_EXP_NAME), else `workspace`."""
    return os.environ.get("DVC_EXP_NAME") or "workspace"


def setup_wandb(cfg: WandbConfig, stage: str, config: dict[str, Any], is_main: bool) -> list[str]:
    """Start the stage's wandb run (offline unless configured; never a prompt) and return `report_to`.

    One run per training stage per DVC experiment, named `<experiment>-<stage>` and grouped by the
    experiment, with the params the stage read as its config. WANDB_MODE in the environment wins
    over params (a user's explicit choice for this shell)."""
    mode = os.environ.get("WANDB_MODE") or cfg.mode
    if mode == "disabled":
        return []
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
    if "wandb" not in report_to:
        return None
    import wandb
    run = wandb.run
    where = getattr(run, "dir", None) if run else None
    if run:
        run.finish()
    return where


def save_loss_history(history: list[dict[str, Any]], keys: tuple[str, ...], tsv: Path, png: Path,
                      title: str) -> None:
    """The Trainer's log history as a tsv (DVC plots) and a PNG (people)."""
    tsv.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for h in history:
        if "step" not in h:
            continue
        vals = {k: h[k] for k in keys if k in h}
        if vals:
            rows.append({"step": h["step"], **vals})
    cols = ["step", *keys]
    lines = ["\t".join(cols)]
    for r in rows:
        lines.append("\t".join("" if r.get(c) is None else f"{r[c]:.6g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols))
    tsv.write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, markersize=3, label=k)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
