"""Where models run and in what precision: the `auto` settings of params.yaml resolved for this machine.

    set_threads(cfg.torch_threads); resolve_precision("auto"); resolve_optimizer("auto", "sft.optimizer")
    print(describe_resolution(cfg.optimizer, cfg.precision, "sft"))   # what a training stage logs at its start

`auto` precision is bf16 where the GPU supports it and fp32 on CPU; `auto` optimizer is paged 8-bit AdamW
on a GPU with bitsandbytes installed (`make install-gpu`), AdamW otherwise. Asking for an 8-bit optimizer
without bitsandbytes is an error that names the params key, never a silent fallback.
"""

from __future__ import annotations

from codi.infra.config import ConfigError

BNB_OPTIMIZERS = ("paged_adamw_8bit",)  # the optimizers of params.yaml's choice that need bitsandbytes


def use_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def resolve_precision(precision: str) -> dict[str, bool]:
    """TrainingArguments' bf16/fp16 flags for `precision` (bf16 matmuls on CPU are slow and lossy: fp32 there)."""
    import torch
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def have_bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_optimizer(optimizer: str, key: str = "optimizer") -> str:
    """The Trainer's `optim` for params.yaml's `optimizer` (`key` names it in errors, e.g. `sft.optimizer`)."""
    if optimizer in BNB_OPTIMIZERS and not have_bitsandbytes():
        raise ConfigError(f"{key} = {optimizer!r}: needs bitsandbytes, which is not installed (on a CUDA machine: "
                          "`make install-gpu`); or set it to auto or adamw_torch")
    if optimizer != "auto":
        return optimizer
    return "paged_adamw_8bit" if use_cuda() and have_bitsandbytes() else "adamw_torch"


def describe_resolution(optimizer: str, precision: str, section: str) -> str:
    """One line for a training stage's start: the optimizer and precision it trains with, and why."""
    import torch

    optim = resolve_optimizer(optimizer, f"{section}.optimizer")
    flags = resolve_precision(precision)
    prec = "bf16" if flags["bf16"] else "fp16" if flags["fp16"] else "fp32"
    gpu = use_cuda()
    where = f"CUDA ({torch.cuda.get_device_name(0)})" if gpu else "CPU"
    if optimizer != "auto":
        why_optim = "as set"
    elif not gpu:
        why_optim = "auto: no GPU"
    elif optim == "paged_adamw_8bit":
        why_optim = "auto: a GPU with bitsandbytes"
    else:
        why_optim = "auto: no bitsandbytes, so no 8-bit AdamW (make install-gpu)"
    if precision != "auto":
        why_prec = "as set"
    else:
        why_prec = "auto: " + ("the GPU supports bf16" if flags["bf16"] else "a GPU without bf16" if gpu else "CPU")
    return (f"{section}: optimizer {optim} ({section}.optimizer = {optimizer}, {why_optim}), precision {prec} "
            f"({section}.precision = {precision}, {why_prec}), on {where}")


def set_threads(n: int) -> None:
    """One intra-op thread is several times faster than two for tiny models on these CPUs; 0 = torch's default."""
    import torch
    if n > 0 and not use_cuda():
        torch.set_num_threads(n)
