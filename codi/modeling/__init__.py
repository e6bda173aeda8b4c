"""The CODI model (stage 2b): the reference design, batched, plus save/load (docs/design/codi-model.md, "CodiModel").

    from codi.modeling import CodiModel, ss_ramp, save_codi_model, load_codi_model
    model = CodiModel(base, token_ids(tok), params.codi.options, params.loss_weights)
    out = model(examples, ss_prob=ss_ramp(step, max_steps, cfg.ss_prob, cfg.ss_ramp_frac), ss_rng=rng)
    save_codi_model(model, tok, "models/codi", extra={"step": step})
    loaded = load_codi_model("models/codi")        # LoadedCodi(model, projector, tokenizer, config)

Modules: plan (checks, rounds, ss_ramp), latent (projector, PaddedRows, latent_input, latent_recurrence), losses (the KD and CE terms), model
(CodiModel.forward: the loss; split_causal_lm), io (the saved folder); base_model (the base LM and its
tokenizer) and lora (peft plumbing). The options (CodiOptions, LossWeights) are codi.schemas.options, stdlib only.
codi.evaluation.decoding shares latent_input and split_causal_lm. Inside codi/, import the submodule that
defines a name (the stages' code dependencies are their static import closure: codi/infra/provenance.py).
"""

import importlib
from typing import Any

# Lazy: importing codi.modeling (or a leaf such as codi.modeling.base_model) imports no torch until a name of a
# torch module is asked for.
_HOME = {
    "LoadedCodi": "io", "SavedCodiConfig": "io", "load_codi_model": "io", "read_codi_config": "io",
    "save_codi_model": "io",
    "PaddedRows": "latent", "build_projector": "latent", "latent_input": "latent", "latent_recurrence": "latent",
    "CodiModel": "model", "activation_checkpointing": "model", "split_causal_lm": "model",
    "ExamplePlan": "plan", "check_example": "plan", "draw_uniform": "plan", "plan_example": "plan", "ss_ramp": "plan",
}
_SCHEMAS = {"CodiOptions", "LossWeights"}  # the options' one type lives in codi.schemas.options

__all__ = sorted([*_HOME, *_SCHEMAS])


def __getattr__(name: str) -> Any:
    if name in _SCHEMAS:
        return getattr(importlib.import_module("codi.schemas.options"), name)
    if name in _HOME:
        return getattr(importlib.import_module(f"codi.modeling.{_HOME[name]}"), name)
    raise AttributeError(f"module 'codi.modeling' has no attribute {name!r}")
