"""The `sft` and `sft_direct` sections: a training stage's hyperparameters (`codi` extends them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from codi.infra.config import ConfigError, option
from codi.schemas.lora import LoraConfig


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of a training stage (the `sft` and `sft_direct` sections; `codi` extends it)."""

    max_steps: int = option("optimizer steps; -1 = use epochs", ge=-1)
    epochs: float = option("passes over the train split when max_steps = -1", gt=0)
    lr: float = option("peak learning rate", gt=0)
    lr_schedule: Literal["cosine", "linear", "constant", "constant_with_warmup"] = option("learning-rate schedule")
    warmup_ratio: float = option("share of steps spent warming up", ge=0.0, lt=1.0)
    weight_decay: float = option("AdamW weight decay", ge=0.0)
    batch_size: int = option("examples per device per step", ge=1)
    grad_accum: int = option("micro-batches accumulated per optimizer step", ge=1)
    max_grad_norm: float = option("gradient clipping norm; 0 = off", ge=0.0)
    eval_batch_size: int = option("examples per device per validation step", ge=1)
    eval_steps: int = option("validate every this many steps (and at the end)", ge=1)
    save_steps: int = option("checkpoint every this many steps (and at the end)", ge=1)
    logging_steps: int = option("log every this many steps", ge=1)
    save_total_limit: int = option("checkpoints kept on disk; 0 = all", ge=0)
    keep: Literal["best", "last"] = option("final model: lowest validation loss, or the last step")
    optimizer: Literal["auto", "adamw_torch", "paged_adamw_8bit", "adafactor", "sgd"] = option(
        "auto = paged 8-bit AdamW on a GPU with bitsandbytes, AdamW otherwise")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = option("auto = bf16 where the GPU supports it, fp32 on CPU")
    gradient_checkpointing: bool = option("recompute activations in backward (saves memory); codi: the teacher's CE pass")
    group_by_length: bool = option("batch examples of similar length together (less padding: ~2x faster here)")
    torch_threads: int = option("torch intra-op threads on CPU; 0 = torch's default (1 is fastest for tiny models)", ge=0)
    cpu_processes: int = option("data-parallel CPU processes (gloo) when there is no GPU; global batch = "
                                    "batch_size x processes x grad_accum", ge=1)
    strategy: Literal["ddp", "fsdp"] = option(
        "how several processes share the model: ddp = every process holds all of it (the gradients all-reduced); "
        "fsdp = FSDP2 (fully_shard): parameters, gradients and optimizer state sharded over the processes, "
        "checkpoints sharded (torch.distributed.checkpoint), the final folder a plain HF one; docs/SCALE.md")
    seed: int = option("seed of weights-independent randomness (data order, dropout)")
    lora: LoraConfig = option("LoRA / QLoRA adapters instead of full fine-tuning (r = 0: off); docs/LORA.md")

    def __post_init__(self) -> None:
        if self.keep == "best" and self.save_steps % self.eval_steps:
            raise ConfigError(f"save_steps = {self.save_steps} with keep = 'best': expected a multiple of "
                              f"eval_steps ({self.eval_steps}); the best model must have been saved")
        if self.strategy == "fsdp" and self.lora.enabled:
            # The adapters would be plain tensors beside the sharded base, and a LoRA checkpoint is the adapter
            # alone: FSDP's sharded checkpoint and its gathered final folder are written for full fine-tuning.
            raise ConfigError("strategy = 'fsdp' with lora.r > 0: FSDP trains every weight (full fine-tuning); "
                              "use strategy: ddp for LoRA")


@dataclass(frozen=True)
class SftConfig(TrainConfig):
    """`sft` (stage 1): the training hyperparameters plus the weighting of the trace's tokens."""

    computed_weight: float = option("loss weight of the tokens the trace computes (the locals a LINE frame does not copy "
                                    "from the frame before, return/exception VALUEs) against the rest; 1 = plain CE", gt=0)
