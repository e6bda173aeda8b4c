"""Where models run and in what precision: the `auto` settings of params.yaml resolved for this machine.

    set_threads(cfg.torch_threads); resolve_precision("auto"); resolve_optimizer("auto")

`auto` precision is bf16 where the GPU supports it and fp32 on CPU; `auto` optimizer is paged 8-bit AdamW
on a GPU with bitsandbytes installed, AdamW otherwise.
"""

from __future__ import annotations


def use_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def resolve_precision(precision: str) -> dict[str, bool]:
    """TrainingArguments' bf16/fp16 flags for `precision` (bf16 matmuls on CPU are slow and lossy: fp32 there)."""
    import torch
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def resolve_optimizer(optimizer: str) -> str:
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
    """One intra-op thread is several times faster than two for tiny models on these CPUs; 0 = torch's default."""
    import torch
    if n > 0 and not use_cuda():
        torch.set_num_threads(n)
