"""The CODI model (stage 2b): the reference design, batched, plus save/load (docs/ARCHITECTURE.md, "CodiModel").

    from codi.modeling import CodiModel, ss_ramp, save_codi_model, load_codi_model
    model = CodiModel.from_config(base, token_ids(tok), params.codi, params.alpha, params.beta, params.gamma)
    out = model(examples, ss_prob=ss_ramp(step, max_steps, cfg.ss_prob, cfg.ss_ramp_frac), ss_rng=rng)
    save_codi_model(model, tok, "models/codi", extra={"step": step})
    loaded = load_codi_model("models/codi")        # LoadedCodi(model, projector, tokenizer, config)

Modules: plan (checks, rounds, ss_ramp), latent (projector, PaddedRows, latent_input, latent_recurrence),
losses, model (CodiModel, split_causal_lm), io. codi.decoding shares latent_input and split_causal_lm.
"""

from codi.modeling.io import (CodiArtifactConfig, LoadedCodi, load_codi_model, read_codi_config,
                              save_codi_model)
from codi.modeling.latent import PaddedRows, build_projector, latent_input, latent_recurrence
from codi.modeling.model import CodiModel, activation_checkpointing, split_causal_lm
from codi.modeling.plan import ExamplePlan, check_example, draw_uniform, plan_example, ss_ramp

__all__ = [
    "CodiArtifactConfig", "CodiModel", "ExamplePlan", "LoadedCodi", "PaddedRows", "activation_checkpointing",
    "build_projector", "check_example", "draw_uniform", "latent_input", "latent_recurrence", "load_codi_model",
    "plan_example", "read_codi_config", "save_codi_model", "split_causal_lm", "ss_ramp",
]
