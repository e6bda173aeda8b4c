"""LoRA and QLoRA adapters (peft) for the training stages, and the folders they write.

    check_lora(cfg.lora, "sft")                                   # before any work: QLoRA needs CUDA + bitsandbytes
    model = load_for_lora(base, torch.float32, cfg.lora)           # 4-bit NF4 when lora.quantize = 4bit
    run = apply_lora(model, cfg.lora, token_ids(tok), start=base, gradient_checkpointing=cfg.gradient_checkpointing)
    run.peft          # the PeftModel (train it; sft hands it to the Trainer)
    run.model         # the same causal LM with the adapters injected (codi wraps it in CodiModel)
    merged = run.merged(run.save_adapter(tmp))    # a plain HF model: the start model with the adapter merged
    run.save(folder, tokenizer)                   # merged model + tokenizer in `folder`, the adapter in folder/adapter
    lm = load_unmerged("models/sft")              # start model + folder/adapter, not merged: the same logits

What trains: the adapters (low-rank A, B on `target_modules`), and with `train_new_tokens` the embedding rows of
the tokens codi-trace adds to a real base (every TraceTokenIds id: the trace tokens, pad and eos), as peft
TrainableTokens; a tied head follows the embedding, an untied head gets its own trainable rows for the same ids.
Every other weight of the base is frozen. The codi stage's projector is not part of the base and trains in full.

A stage's final folder is the merged model, so the next stage and evaluate read it as they read a fully
trained one; the adapter beside it (`adapter/`, peft's own format, its base the stage's start model) is the
unmerged form. The merged model is built from a fresh load of the start model (on the CPU, in `merged_dtype`),
never by merging in place: the training model is left as it is, and a 4-bit base is merged at full precision
rather than requantised. Checkpoints hold the adapter (the Trainer's own for a peft model; CodiTrainer's adds
the projector), and codi.training.checkpoints accepts them as complete. Options and recipes: docs/LORA.md.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codi.infra.config import ConfigError
from codi.infra.hf import load_causal_lm
from codi.schemas.lora import ALL_LINEAR, LoraConfig
from codi.tracing.tokens import TraceTokenIds

ADAPTER_DIR = "adapter"             # a LoRA stage's adapter, inside its model folder
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def qlora_problem() -> str | None:
    """Why 4-bit loading cannot run here (None if it can)."""
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU and bitsandbytes (make install-gpu)"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "needs bitsandbytes (make install-gpu)"
    return None


def check_lora(cfg: LoraConfig, section: str) -> None:
    """ConfigError naming `<section>.lora.quantize` when QLoRA is asked for on a machine that cannot run it.

    Not a schema check: params.yaml is machine-independent, and every stage checks the whole file."""
    if cfg.quantize == "4bit" and (why := qlora_problem()):
        raise ConfigError(f"{section}.lora.quantize = '4bit': {why}")


def load_for_lora(path: str | Path, dtype: Any, cfg: LoraConfig):
    """The start model of a LoRA run: as `load_causal_lm(path, dtype)`, or 4-bit NF4 (QLoRA) on this process's GPU.

    QLoRA (Dettmers et al.): NF4 weights, double-quantised constants, bf16 compute; prepare_model_for_kbit_training
    (in apply_lora) then casts the remaining non-quantised weights (norms, embeddings) to fp32 for stable training."""
    if cfg.quantize == "none":
        return load_causal_lm(path, dtype)
    if why := qlora_problem():  # the stage checked already; a direct caller gets the same sentence
        raise ConfigError(f"lora.quantize = '4bit': {why}")
    import os

    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    # A 4-bit model cannot be moved after loading: each DDP process loads it onto its own GPU.
    device = {"": int(os.environ.get("LOCAL_RANK", "0"))}
    try:
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.bfloat16,
                                                    device_map=device)
    except (OSError, ValueError, KeyError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: not a causal LM that transformers can load in 4-bit ({why})") from None


def new_token_ids(ids: TraceTokenIds) -> list[int]:
    """The embedding rows trained in full under LoRA: every token id codi-trace relies on (sorted, unique)."""
    return sorted(set(ids.as_dict().values()))


def _module_name(model, module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")


def peft_config(cfg: LoraConfig, model, ids: TraceTokenIds):
    """peft's LoraConfig for `cfg` on `model` (a HF causal LM)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType

    tokens: Any = None
    if cfg.train_new_tokens:
        rows = new_token_ids(ids)
        tied = model.get_output_embeddings() is None or (
            model.get_output_embeddings().weight is model.get_input_embeddings().weight)
        # Tied: peft wraps the head too, sharing the embedding's trainable rows. Untied: the head's rows for the
        # same ids are trained as well, or the model could read the new tokens but never learn to emit them.
        tokens = rows if tied else {_module_name(model, model.get_input_embeddings()): rows,
                                    _module_name(model, model.get_output_embeddings()): rows}
    return PeftLoraConfig(
        task_type=TaskType.CAUSAL_LM, r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
        target_modules=ALL_LINEAR if cfg.target_modules == [ALL_LINEAR] else list(cfg.target_modules),
        use_rslora=cfg.rslora, trainable_token_indices=tokens)


@dataclass
class LoraRun:
    """A model under LoRA training, and what it takes to write its folders."""

    peft: Any                   # peft.PeftModel around `model`
    cfg: LoraConfig
    start: Path                 # the folder the base was loaded from: the adapter's base
    merged_dtype: Any           # dtype of the merged model a stage writes

    @property
    def model(self):
        """The causal LM itself, adapters injected (what CodiModel wraps; it shares every module with `peft`)."""
        return self.peft.get_base_model()

    def adapter_state(self) -> dict[str, Any]:
        """The trainable weights as peft saves them (adapters and token rows)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.peft)

    def load_adapter_state(self, folder: str | Path) -> None:
        """Load adapter weights that `peft.save_pretrained` wrote into `folder` (a checkpoint, a model's adapter/)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        result = set_peft_model_state_dict(self.peft, load_file(str(Path(folder) / ADAPTER_WEIGHTS)))
        if result.unexpected_keys:
            raise ValueError(f"{folder}: adapter weights do not match the model (unexpected "
                             f"{result.unexpected_keys[:3]})")

    def save_adapter(self, folder: str | Path) -> Path:
        """The adapter in peft's format (adapter_config.json, adapter_model.safetensors) in `folder`."""
        self.peft.save_pretrained(str(folder))
        return Path(folder)

    def merged(self, adapter: str | Path):
        """A plain HF model on the CPU: a fresh load of the start model with the adapter saved in `adapter` merged
        in (from a file, not from memory: the merged model is exactly what loading the saved adapter gives)."""
        from peft import PeftModel

        base = load_causal_lm(self.start, self.merged_dtype)
        return PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()

    def save(self, folder: str | Path, tokenizer: Any | None = None) -> None:
        """The stage's folder: the merged model (and tokenizer) in `folder`, the adapter in `folder/adapter`."""
        folder = Path(folder)
        merged = self.merged(self.save_adapter(folder / ADAPTER_DIR))
        merged.save_pretrained(folder, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)


def apply_lora(model, cfg: LoraConfig, ids: TraceTokenIds, start: str | Path, gradient_checkpointing: bool,
               merged_dtype: Any = None) -> LoraRun:
    """Freeze `model` (loaded by load_for_lora from `start`) and add adapters and trainable token rows."""
    import torch
    from peft import get_peft_model, prepare_model_for_kbit_training

    if not cfg.enabled:
        raise ValueError("apply_lora: lora.r = 0 means no adapters; train the model itself")
    if cfg.quantize != "none":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        # Reentrant checkpointing drops the gradient of a segment whose inputs need none; with a frozen embedding
        # (train_new_tokens false) no input would, and the adapters inside would get no gradient.
        model.enable_input_require_grads()
    peft = get_peft_model(model, peft_config(cfg, model, ids))
    if merged_dtype is None:
        merged_dtype = torch.bfloat16 if cfg.quantize != "none" else model.get_input_embeddings().weight.dtype
    return LoraRun(peft=peft, cfg=cfg, start=Path(start), merged_dtype=merged_dtype)


def load_unmerged(folder: str | Path, base: str | Path | None = None, dtype: Any = None):
    """A LoRA stage's model unmerged: its start model (`base`, default: the one the adapter records) + `folder/adapter`.

    Gives the logits of the merged model in `folder` (up to float rounding); eval mode."""
    import torch
    from peft import PeftModel

    adapter = Path(folder) / ADAPTER_DIR
    try:
        recorded = json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{adapter}: no LoRA adapter here ({e})") from None
    model = load_causal_lm(base if base is not None else recorded, dtype if dtype is not None else torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).eval()


def trainable_summary(model) -> str:
    """`N of M parameters train (x%)`: the line a LoRA stage prints."""
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{train:,} of {total:,} parameters train ({100 * train / max(total, 1):.2f}%)"
