"""The CODI model (stage 2b): the reference design, batched, plus save/load (docs/ARCHITECTURE.md, "CodiModel").

    from codi.modeling import CodiModel, ss_ramp, save_codi_model, load_codi_model
    model = CodiModel(base, token_ids(tok), params.codi.options, params.loss_weights)
    out = model(examples, ss_prob=ss_ramp(step, max_steps, cfg.ss_prob, cfg.ss_ramp_frac), ss_rng=rng)
    save_codi_model(model, tok, "models/codi", extra={"step": step})
    loaded = load_codi_model("models/codi")        # LoadedCodi(model, projector, tokenizer, config)

Modules: options (CodiOptions, LossWeights: the one type of the options), plan (checks, rounds, ss_ramp),
latent (projector, PaddedRows, latent_input, latent_recurrence), losses (the KD and CE terms), model
(CodiModel.forward: the loss; split_causal_lm), io (the saved folder). codi.decoding shares latent_input
and split_causal_lm.
"""

from codi.modeling.io import LoadedCodi, SavedCodiConfig, load_codi_model, read_codi_config, save_codi_model
from codi.modeling.latent import PaddedRows, build_projector, latent_input, latent_recurrence
from codi.modeling.model import CodiModel, activation_checkpointing, split_causal_lm
from codi.modeling.options import CodiOptions, LossWeights
from codi.modeling.plan import ExamplePlan, check_example, draw_uniform, plan_example, ss_ramp

__all__ = [
    "CodiModel", "CodiOptions", "ExamplePlan", "LoadedCodi", "LossWeights", "PaddedRows", "SavedCodiConfig",
    "activation_checkpointing", "build_projector", "check_example", "draw_uniform", "latent_input",
    "latent_recurrence", "load_codi_model", "plan_example", "read_codi_config", "save_codi_model", "split_causal_lm",
    "ss_ramp",
]
