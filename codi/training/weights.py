"""Full fine-tuning or LoRA: one strategy for the causal LM a training stage trains, and for what its folders
hold of it. Both trainers use it (LengthGroupedTrainer for sft / sft_direct, CodiTrainer for codi).

    weights = load_weights(Path("models/base"), torch.float32, cfg.lora)   # FullWeights or LoraWeights
    weights.adapt(token_ids(tok), start=Path("models/base"), gradient_checkpointing=False)   # LoRA: adapters
    weights.lm                       # the causal LM (codi wraps it in CodiModel)
    weights.trainable                # what an HF Trainer trains (the PeftModel under LoRA)
    weights.write_hf_folder(trainer, folder)      # sft's final folder: HF format (+ adapter/ under LoRA)
    weights.final_lm(folder)                      # codi's final folder: the LM to write (merged under LoRA)
    weights.save_checkpoint(folder)               # the LM's trainable weights in a codi checkpoint
    weights.load_checkpoint(folder)               # ... and back (a resume, keep: best)

Full: every weight of the LM trains; a folder holds the whole model. LoRA (codi.modeling.lora, docs/LORA.md):
adapters on a frozen base; a final folder is the merged model plus `adapter/`, a checkpoint the adapter alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from codi.infra.hf import load_causal_lm
from codi.modeling.lora import ADAPTER_DIR, LoraRun, apply_lora, load_for_lora, trainable_summary
from codi.schemas.lora import LoraConfig
from codi.tracing.tokens import TraceTokenIds

if TYPE_CHECKING:
    from transformers import Trainer

MODEL_FILES = "model*.safetensors"  # a full checkpoint's LM weights (save_pretrained's names, sharded or not)


class FullWeights:
    """Every weight of the LM trains; a folder holds the whole model."""

    def __init__(self, lm: Any):
        self.lm = lm

    @property
    def trainable(self) -> Any:
        return self.lm

    def adapt(self, ids: TraceTokenIds, start: Path, gradient_checkpointing: bool) -> None:
        """Nothing to add: the LM trains as it is."""

    def describe(self, model: Any) -> str | None:
        return None

    def write_hf_folder(self, trainer: Trainer, folder: str | Path) -> None:
        trainer.save_model(str(folder))  # HF format, as a checkpoint holds it (with the tokenizer and the args)

    def final_lm(self, folder: str | Path) -> Any | None:
        return None  # the trained LM itself

    def save_checkpoint(self, folder: str | Path) -> bool:
        return False  # the caller writes the whole model (a codi checkpoint is a codi model folder)

    def load_checkpoint(self, folder: str | Path) -> None:
        """The LM's weights from a checkpoint's safetensors files; a mismatch is an error naming the folder."""
        from safetensors.torch import load_file

        state: dict[str, Any] = {}
        for f in sorted(Path(folder).glob(MODEL_FILES)):
            state.update(load_file(str(f)))
        result = self.lm.load_state_dict(state, strict=False)
        tied = ({k for k in result.missing_keys if k.endswith("lm_head.weight")}
                if self.lm.config.tie_word_embeddings else set())
        if set(result.missing_keys) - tied or result.unexpected_keys:
            raise ValueError(f"{folder}: weights do not match the model (missing "
                             f"{sorted(set(result.missing_keys) - tied)[:3]}, unexpected {result.unexpected_keys[:3]})")
        self.lm.tie_weights()


class LoraWeights:
    """Adapters (and trainable new-token rows) on a frozen base, loaded by load_for_lora (4-bit under QLoRA)."""

    def __init__(self, lm: Any, cfg: LoraConfig):
        self._start_lm, self.cfg = lm, cfg
        self.run: LoraRun | None = None

    def adapt(self, ids: TraceTokenIds, start: Path, gradient_checkpointing: bool) -> None:
        """Freeze the LM and add the adapters (their initialisation draws from torch's RNG: seed first)."""
        self.run = apply_lora(self._start_lm, self.cfg, ids, start=start, gradient_checkpointing=gradient_checkpointing)

    def _adapted(self) -> LoraRun:
        if self.run is None:
            raise RuntimeError("LoraWeights: call adapt() before training or saving")
        return self.run

    @property
    def lm(self) -> Any:
        """The causal LM with the adapters injected (it shares every module with the PeftModel)."""
        return self._adapted().model if self.run is not None else self._start_lm

    @property
    def trainable(self) -> Any:
        return self._adapted().peft

    def describe(self, model: Any) -> str | None:
        return f"LoRA r={self.cfg.r}: {trainable_summary(model)}"

    def write_hf_folder(self, trainer: Trainer, folder: str | Path) -> None:
        self._adapted().save(folder, trainer.processing_class)  # merged model + tokenizer, the adapter in adapter/

    def final_lm(self, folder: str | Path) -> Any:
        run = self._adapted()
        return run.merged(run.save_adapter(Path(folder) / ADAPTER_DIR))

    def save_checkpoint(self, folder: str | Path) -> bool:
        self._adapted().save_adapter(folder)  # the adapter, not a merged copy of the frozen base
        return True

    def load_checkpoint(self, folder: str | Path) -> None:
        self._adapted().load_adapter_state(folder)


Weights = FullWeights | LoraWeights


def load_weights(start: Path, dtype: Any, cfg: LoraConfig) -> Weights:
    """The start model of a training stage, full or (`cfg.enabled`) ready for adapters."""
    if cfg.enabled:
        return LoraWeights(load_for_lora(start, dtype, cfg), cfg)
    return FullWeights(load_causal_lm(start, dtype))
