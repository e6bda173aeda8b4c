"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the training stages: `<stage>.strategy: fsdp`.

    shard_model(model, device_type="cpu")           # every decoder layer its own group, the rest the root's
    save_sharded(folder / SHARDED_DIR, model, optimizer)      # torch.distributed.checkpoint, every rank its shard
    load_sharded_model(folder / SHARDED_DIR, model)           # ... and back (a resume, keep: best)
    load_sharded_optimizer(folder / SHARDED_DIR, model, optimizer)
    full = full_state_dict(model)                   # every rank calls it; rank 0 gets the whole CPU state dict
    sharded_checkpoint_problem(folder / SHARDED_DIR)     # (file, what is wrong) of a truncated one, or None

sft: each decoder layer (the classes the model names in `_no_split_modules`, e.g. Qwen2DecoderLayer) is one FSDP
group, its parameters gathered for its forward and backward only; the root group holds the rest: the embedding and
the tied LM head (one Parameter, so one group: tying survives the sharding) and the final norm.
codi: one group, the whole CodiModel (LM, tied head, thought projector, an auxiliary decoder or frozen teacher),
sharded at rest (parameters, gradients, optimizer state: 1/N each between steps) and gathered once per forward.
CodiModel calls the LM's layers a number of times that depends on the batch (the teacher pass, then the latent
steps of each LINE frame), so per-layer groups would all-gather a different number of times on each rank and
deadlock. The projector and the tied head are sharded like everything else: nothing is kept replicated.

Works on CPU (gloo) and CUDA (NCCL): the mesh is the process group's device type.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

SHARDED_DIR = "sharded"  # a checkpoint's model + optimizer state, one .distcp file per rank and a .metadata


def _layer_classes(model: torch.nn.Module) -> set[str]:
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def shard_model(model: torch.nn.Module, device_type: str, layer_groups: bool = True) -> int:
    """Shard `model` in place over the default process group; the number of FSDP groups (layers + the root).

    `layer_groups` False: one group, the root, for a model that runs its layers a data-dependent number of times
    per batch (CodiModel): each call of a layer group all-gathers, so ranks with different batches would wait on
    each other forever; the root gathers once per forward and reduce-scatters once per backward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    layer_classes = _layer_classes(model)
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes] if layer_groups else []
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return len(layers) + 1


def fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one


def save_sharded(folder: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Every rank writes its shard of the model and optimizer state (a collective: all ranks call it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, _inner(optimizer))
    dcp.save(state, checkpoint_id=str(folder))


def load_sharded_model(folder: Path, model: torch.nn.Module) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"])


def load_sharded_optimizer(folder: Path, model: torch.nn.Module, optimizer: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    inner = _inner(optimizer)
    state = {"optim": get_optimizer_state_dict(model, inner)}
    dcp.load(state, checkpoint_id=str(folder))
    set_optimizer_state_dict(model, inner, state["optim"])


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU on rank 0 ({} elsewhere); every rank must call it (all-gathers).

    A tied parameter (the LM head tied to the embedding) comes back as a copy of its own under each name; only its
    first name is kept, as a plain model's save_pretrained keeps it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            full.pop(name, None)
    return full


def sharded_checkpoint_problem(folder: Path) -> tuple[Path, str] | None:
    """The file of a sharded checkpoint that is missing or cut short, and how; None if every byte the metadata
    lists is there. The .metadata (written last, by rank 0) lists each tensor's file, offset and length."""
    from torch.distributed.checkpoint import FileSystemReader

    meta_file = folder / ".metadata"
    if not meta_file.is_file():
        return meta_file, "missing"
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, ImportError,
            IndexError, KeyError, RuntimeError) as e:
        return meta_file, f"unreadable ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        f = folder / name
        if not f.is_file():
            return f, "missing"
        if f.stat().st_size < end:
            return f, f"truncated ({f.stat().st_size} bytes, the metadata needs {end})"
    return None
