"""Resumable checkpoints of one training run, identified by a fingerprint of everything that decides its result.

    fingerprint = run_fingerprint("sft", "codi.stages.sft", to_dict(cfg), cache_manifest, {"start_model": base})
    resume = CheckpointDir("checkpoints/sft", fingerprint).prepare()   # last *complete* checkpoint, or None

A rerun with the same fingerprint (after a kill) resumes; any change (params, cache, a starting model, the
code the stage imports, the torch/transformers versions) refuses to resume, says what changed, and starts
from step 0: a checkpoint is never continued under other data, model, hyperparameters or code.

    root = checkpoint_root(Path("checkpoints/sft"), "sft", fingerprint)   # where that folder is

A checkpoint whose save was interrupted (a kill: no readable trainer_state.json, the file written last) is skipped
for the one before it. A checkpoint that was saved whole but is damaged since (a file missing, truncated, or a
torch.save archive failing its CRC; DDP's files or FSDP's sharded ones) stops the stage with one error naming the
file and saying what to delete (CorruptCheckpoint, exit 2): resuming from an older one would hide the damage.

A DVC experiment run with `--temp`, from the queue, or by the experiments flow runs in a temporary copy of the
repository (`<repo>/.dvc/tmp/exps/[standalone/]tmp*`) that a kill leaves behind and the next run does not reuse: its
checkpoints live in the repository's own `checkpoints/exps/<stage>-<fingerprint digest>/`, where the rerun of
the same experiment (same params, data and code: the same fingerprint) finds them and resumes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codi.infra.config import UserError
from codi.infra.files import file_sha256, write_json
from codi.infra.provenance import code_digest, stage_code_files

CHECKPOINT_PREFIX = "checkpoint-"
RUN_FILE = "run.json"
WHAT = {"stage": "the stage", "params": "the stage's params", "weights": "the loss weights alpha, beta, gamma",
        "cache": "the cache (its manifest)", "code": "the code the stage imports", "libraries": "the libraries",
        "start_model": "the starting model", "frozen_teacher": "the frozen teacher"}


def model_fingerprint(model_dir: Path) -> dict[str, str]:
    """Config (shape) and weights digests of a HF model folder."""
    weights = hashlib.sha256()
    for p in sorted(p for p in Path(model_dir).iterdir() if p.suffix in (".safetensors", ".bin")):
        weights.update(f"{p.name}\0{file_sha256(p)}\0".encode())
    return {"config": file_sha256(Path(model_dir) / "config.json"), "weights": weights.hexdigest()}


def run_fingerprint(stage: str, stage_module: str, params: dict[str, Any], cache_manifest: Path,
                    models: dict[str, Path | None], **more: Any) -> dict[str, Any]:
    """What determines a training stage's result: its params, the cache, its starting models, its code."""
    import torch
    import transformers

    return {
        "stage": stage, "params": params, **more,
        "cache": file_sha256(cache_manifest),
        **{role: model_fingerprint(path) if path else None for role, path in models.items()},
        "code": code_digest(stage_code_files(stage_module)),
        "libraries": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def dvc_temp_copy_repo(cwd: Path) -> Path | None:
    """The repository whose DVC experiment runs in the temporary copy `cwd`, or None (not such a copy)."""
    parts = cwd.resolve().parts
    for i in range(1, len(parts) - 3):
        # the queue's copies are exps/tmp*, `--temp`'s exps/standalone/tmp* (dvc/repo/experiments/executor)
        if parts[i:i + 3] == (".dvc", "tmp", "exps") and any(p.startswith("tmp") for p in parts[i + 3:i + 5]):
            return Path(*parts[:i])
    return None


def checkpoint_root(requested: Path, stage: str, fingerprint: dict[str, Any], cwd: Path | None = None) -> Path:
    """`requested`, or in a DVC experiment's temporary copy, a folder of the repository that outlives it."""
    repo = dvc_temp_copy_repo(Path(cwd) if cwd is not None else Path(os.getcwd()))
    if repo is None:
        return Path(requested)
    return repo / "checkpoints" / "exps" / f"{stage}-{fingerprint_digest(fingerprint)}"


def describe_change(key: str, old: Any, new: Any) -> str:
    """One fingerprint difference in words: files and params by name, digests only named."""
    what = WHAT.get(key, key)
    if key == "code" and isinstance(old, dict) and isinstance(new, dict):
        files = [f"{f} {'added' if f not in old else 'removed' if f not in new else 'modified'}"
                 for f in sorted(set(old) | set(new)) if old.get(f) != new.get(f)]
        return f"{what} changed ({', '.join(files)})"
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        shown = [k if _is_digest(old.get(k)) or _is_digest(new.get(k)) else f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
                 for k in keys]
        return f"{what} changed ({', '.join(shown)})"
    if _is_digest(old) or _is_digest(new):
        return f"{what} changed"
    return f"{what} changed ({old!r} -> {new!r})"


def _is_digest(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


@dataclass
class CheckpointDir:
    """`root/run.json` + `root/checkpoint-N/`: resume the same run, never a different one."""

    root: Path
    fingerprint: dict[str, Any]

    def prepare(self) -> str | None:
        """Path of the checkpoint to resume from, or None for a fresh start (the folder reset)."""
        self.root = Path(self.root)
        run_file = self.root / RUN_FILE
        old = None
        if run_file.is_file():
            try:
                old = json.loads(run_file.read_text())
            except ValueError:
                print(f"warning: {run_file} is unreadable: starting from step 0")
        if old is not None and old != self.fingerprint:
            changed = sorted(k for k in set(old) | set(self.fingerprint) if old.get(k) != self.fingerprint.get(k))
            reasons = "; ".join(describe_change(k, old.get(k), self.fingerprint.get(k)) for k in changed)
            print(f"refusing to resume from {self.root}: {reasons}; starting from step 0")
            old = None
        if old is None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True)
            write_json(run_file, self.fingerprint, sort_keys=True)
            return None
        for ckpt in sorted(self.checkpoints(), key=checkpoint_step, reverse=True):
            problem = interrupted_save(ckpt)
            if problem is not None:  # killed while saving: the checkpoint before it is the last complete one
                print(f"warning: skipping incomplete checkpoint {ckpt}: {problem}")
                continue
            damaged = damaged_file(ckpt)
            if damaged is not None:  # saved whole, damaged since: resuming from an older one would hide it
                raise corrupt_checkpoint(damaged[0], damaged[1], ckpt, self.root, self.fingerprint.get("stage"))
            print(f"resuming from {ckpt}")
            return str(ckpt)
        return None

    def checkpoints(self) -> list[Path]:
        return [p for p in Path(self.root).glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and checkpoint_step(p) >= 0]


def corrupt_checkpoint(file: Path, problem: str, ckpt: Path, root: Path, stage: str | None) -> CorruptCheckpoint:
    """The one-line error of a damaged checkpoint: the file, and the two ways out."""
    stage = stage or "training"
    return CorruptCheckpoint(f"{file}: {problem}: checkpoint {ckpt} of the {stage} stage is corrupted; delete "
                             f"{root} to restart the {stage} stage from step 0 (or delete {ckpt} alone to resume "
                             "from the checkpoint before it)")


def checkpoint_step(p: str | Path) -> int:
    """The step of a `checkpoint-N` folder; -1 for any other name."""
    try:
        return int(Path(p).name[len(CHECKPOINT_PREFIX):])
    except ValueError:
        return -1


class CorruptCheckpoint(UserError):
    """A checkpoint whose save completed (trainer_state.json is written last) but whose files are damaged since."""


def checkpoint_problem(ckpt: Path, extra_files: tuple[str, ...] = ()) -> str | None:
    """Why `ckpt` cannot be resumed from (None if it can): an interrupted save, or missing or damaged files."""
    interrupted = interrupted_save(ckpt)
    if interrupted is not None:
        return interrupted
    damaged = damaged_file(ckpt, extra_files)
    return None if damaged is None else damaged[1]


def interrupted_save(ckpt: Path) -> str | None:
    """Why the save of `ckpt` did not finish (None if it did). HF's get_last_checkpoint takes the highest number
    without looking; a kill during a save leaves a folder without a readable trainer_state.json, the file the
    Trainer writes last, once every rank's files are on disk."""
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return "trainer_state.json missing or unreadable"
    if not isinstance(state, dict) or state.get("global_step") != checkpoint_step(ckpt):
        return f"trainer_state.json says step {state.get('global_step') if isinstance(state, dict) else state!r}"
    return None


def damaged_file(ckpt: Path, extra_files: tuple[str, ...] = ()) -> tuple[Path, str] | None:
    """The first missing, truncated or corrupted file of `ckpt` and what is wrong with it ("<name> <how>"); None
    if every file checks out. torch.save files are zip archives whose members carry a CRC (all checked);
    safetensors files carry their header length; a sharded (FSDP) checkpoint's .metadata lists every byte range.
    A LoRA run's checkpoint (adapter_config.json present) holds the adapter's weights instead of the model's
    config: adapter_model.safetensors is its model weights (codi.modeling.lora)."""
    from codi.training.fsdp import SHARDED_DIR, sharded_checkpoint_problem

    sharded = (ckpt / SHARDED_DIR).is_dir()
    adapter = (ckpt / "adapter_config.json").is_file()
    required = () if sharded else ("adapter_model.safetensors" if adapter else "config.json",)
    for name in (*required, *extra_files):
        if not (ckpt / name).is_file():
            return ckpt / name, f"{name} missing"
    if sharded:
        bad = sharded_checkpoint_problem(ckpt / SHARDED_DIR)
        if bad is not None:
            return bad[0], f"{bad[0].relative_to(ckpt)} {bad[1]}"
    else:
        weights = sorted(ckpt.glob("*.safetensors"))
        if not weights:
            return ckpt, "no model weights"
        for w in weights:
            if not _safetensors_complete(w):
                return w, f"{w.name} truncated"
    for name in ("scheduler.pt",) if sharded else ("optimizer.pt", "scheduler.pt"):
        if not (ckpt / name).exists() or not _zip_intact(ckpt / name):
            return ckpt / name, f"{name} missing or truncated"
    rng = sorted(ckpt.glob("rng_state*.pth"))
    if not rng:
        return ckpt, "RNG state missing or truncated"
    for r in (*rng, *sorted(ckpt.glob("sampler_state*.pth"))):
        if not _zip_intact(r):
            return r, f"{r.name} truncated"
    return None


def _zip_intact(path: Path) -> bool:
    """A torch.save archive whose every member reads back with its CRC."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def _safetensors_complete(path: Path) -> bool:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return size >= 8 + n + end
    except (OSError, ValueError, KeyError, TypeError):
        return False
