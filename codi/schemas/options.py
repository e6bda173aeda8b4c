"""The CODI options: one frozen type from params.yaml to CodiModel to the saved codi_config.json and back.

    opts = params.codi.options                  # CodiOptions: the `codi` section's model options
    weights = LossWeights(params.alpha, params.beta, params.gamma)
    model = CodiModel(base, ids, opts, weights)
    read_codi_config("models/codi").options     # the same type, read back from a saved folder

An option is validated once, by its field's declaration here (type, range, choices) and `__post_init__`
(checks between options), whether it comes from params.yaml or from a saved folder. Checks that need the
model (layer range, vocabulary) are CodiModel's. A new option is added in params.yaml's `codi` section,
here, and where it is used: codi/modeling/io.py saves and loads every field of CodiOptions (a folder saved
before the option existed needs the option's reference value among io.py's defaults for older formats).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from codi.infra.config import ConfigError, option


@dataclass(frozen=True)
class CodiOptions:
    """The CODI design's options: what CodiModel computes, and the schedule it was trained with."""

    latent_steps: int = option("recurrent latents per LINE frame (between latent_start and latent_end)", ge=0)
    latent_unit: Literal["locals", "frame"] = option(
        "what a latent block stands for (research VI): locals: a LINE frame's locals, the text resumes at its "
        "<|action_sep|> (the reference) | frame: its locals and executed line, the text resumes at its <|frame_sep|>")
    frames_per_block: int = option(
        "LINE frames one latent block stands for (research VI; latent_unit frame): up to this many consecutive ones; "
        "frame j of a block has its value slot at the hidden feeding latent latent_steps - frames_per_block + j "
        "(1: the last latent's, the reference)", ge=1)
    unit_stage_steps: int = option(
        "the unit curriculum (research VI, item 4; Coconut, iCoT-SI): blocks stand first for the locals unit, then for "
        "whole frames one a block, then for the configured unit (frames_per_block, latent_call), each earlier unit "
        "lasting this many optimizer steps (codi.modeling.plan.unit_ladder); 0 = off; needs latent_unit frame", ge=0)
    latent_call: bool = option(
        "the entry call's frame is latent too (research VI; latent_unit frame): the student writes <|call_sep|> and a "
        "block, the first one, grouped with the LINE frames after it up to frames_per_block; it assigns no value "
        "(false: the call frame is text, the reference)")
    kd_layers: list[int] | None = option("hidden-state layers KD aligns (index into hidden_states: 0 = embeddings, "
                                         "-1 = last); null = all layers (frozen teacher or logit KD: the last)",
                                         nonempty=True)
    kd_target: Literal["hidden", "logit"] = option("hidden: smooth L1 on hidden states; logit: KL on lm_head logits")
    kd_temp: float = option("temperature of logit KD", gt=0)
    single_anchor: bool = option("KD on the last frame only (vanilla CODI ablation)")
    kd_norm: Literal["none", "teacher_std"] = option("none (the reference) | teacher_std: each KD layer's smooth-L1 term "
                                                     "divided by the detached std of the teacher's hidden states at that "
                                                     "layer over the micro-batch's anchors (CODI's public code)")
    kd_positions: Literal["action_sep", "action_line", "answer"] = option(
        "KD anchors of a latent frame: its <|action_sep|> (the reference) | action_line: also every token of its line | "
        "answer: CODI's own anchor, only the token before the answer (the entry return frame's <|arg_sep|>)")
    recon_weight: float = option("weight of the step-level reconstruction loss (SIM-CoT): a decoder reads a LINE frame's "
                                 "latents and must write its locals; 0 = off", ge=0.0)
    recon_decoder: Literal["shared", "copy"] = option("the reconstruction decoder: the model's own weights | an auxiliary "
                                                      "copy of the sft model, trained alongside and dropped at inference")
    latent_curriculum_frac: float = option("the share of latent LINE frames (the first ones of each example) ramps from 0 "
                                           "to 1 over this share of the steps; 0 = all latent from step 0", ge=0.0, le=1.0)
    mix_explicit_prob: float = option("share of each example's LINE frames (the last ones) kept explicit after the ramp",
                                      ge=0.0, lt=1.0)
    projector_dropout: float = option("dropout on the thought projector's input in training (CODI's prj_dropout); "
                                      "0 = none (the reference)", ge=0.0, lt=1.0)
    stage_steps: int = option("the stage curriculum (research IV, lever c; Coconut, iCoT-SI): stage s = 1, 2, ... lasts "
                              "this many optimizer steps and makes the first s LINE frames of every example latent "
                              "(all from the stage past the longest); 0 = off", ge=0)
    stage_reset_optimizer: bool = option("stage curriculum (stage_steps or unit_stage_steps): reset the optimizer's "
                                         "state at each stage switch")
    stage_smoothing: float = option("stage curriculum: probability that a batch makes one more frame latent than its "
                                    "stage (iCoT-SI's removal smoothing)", ge=0.0, le=1.0)
    stage_mix_prob: float = option("stage curriculum: probability that a batch uses an earlier stage, drawn uniformly "
                                   "(Coconut's stage mixing)", ge=0.0, le=1.0)
    value_weight: float = option("weight of the value CE (research IV, lever a): the value slot's hidden (the one that "
                                 "feeds a block's last latent) must predict, through the tied head, the first token of "
                                 "the value the previous line assigned (codi.data.values); 0 = off", ge=0.0)
    value_feedback: Literal["none", "soft", "hard"] = option(
        "what the value slot's prediction adds to the last latent's input: none | soft: the probability-weighted "
        "embedding | hard: the argmax token's embedding, straight-through in training")
    value_kd_weight: float = option("weight of the value KD (lever b): smooth L1 between the value slot's hidden states "
                                    "and the teacher's at the token before the assigned value, layers 1..L (no "
                                    "embeddings), each divided by the teacher's std (PCCoT); 0 = off; latent_steps >= 2",
                                    ge=0.0)

    def __post_init__(self) -> None:
        if self.latent_unit == "frame" and self.kd_positions == "action_line":
            raise ConfigError("codi.kd_positions = 'action_line' anchors KD on each latent frame's line, which "
                              "codi.latent_unit = 'frame' makes latent (use action_sep: the frame's <|frame_sep|>)")
        if self.frames_per_block > 1 and self.latent_unit != "frame":
            raise ConfigError(f"codi.frames_per_block = {self.frames_per_block}: a block of several LINE frames needs "
                              "codi.latent_unit = 'frame' (in the locals unit the frames' lines lie between them)")
        if self.latent_call and self.latent_unit != "frame":
            raise ConfigError("codi.latent_call = true makes the call frame's line latent too: it needs "
                              f"codi.latent_unit = 'frame' (got {self.latent_unit!r})")
        if self.unit_stage_steps > 0 and self.latent_unit != "frame":
            raise ConfigError(f"codi.unit_stage_steps = {self.unit_stage_steps}: the unit curriculum leads from the "
                              f"locals unit to the frame unit, but codi.latent_unit is {self.latent_unit!r}")
        if self.unit_stage_steps > 0 and self.stage_steps > 0:
            raise ConfigError("codi.unit_stage_steps > 0 (the unit curriculum) and codi.stage_steps > 0 (the frame "
                              "curriculum) both schedule the stages: set one of them to 0")
        if self.frames_per_block > 1 and self.latent_steps <= self.frames_per_block:
            raise ConfigError(f"codi.frames_per_block = {self.frames_per_block}: each frame of a block needs a latent "
                              f"of its own after latent_start: codi.latent_steps must exceed it (got {self.latent_steps})")
        if self.kd_norm == "teacher_std" and self.kd_target != "hidden":
            raise ConfigError("codi.kd_norm = 'teacher_std' normalises hidden-state KD; codi.kd_target is "
                              f"{self.kd_target!r} (use kd_norm none)")
        if self.recon_weight > 0 and self.latent_steps == 0:
            raise ConfigError("codi.recon_weight > 0 reconstructs each frame's locals from its latents, but "
                              "codi.latent_steps = 0 makes no latents")
        for key in ("value_weight", "value_kd_weight"):
            if getattr(self, key) > 0 and self.latent_steps == 0:
                raise ConfigError(f"codi.{key} > 0 supervises a latent block's value slot, but codi.latent_steps = 0 "
                                  "makes no latents")
        if self.value_feedback != "none" and self.latent_steps == 0:
            raise ConfigError(f"codi.value_feedback = {self.value_feedback!r} feeds a block's last latent, but "
                              "codi.latent_steps = 0 makes no latents")
        if self.stage_steps > 0 and self.latent_curriculum_frac > 0:
            raise ConfigError("codi.stage_steps > 0 (the stage curriculum) and codi.latent_curriculum_frac > 0 (the "
                              "ramp) both schedule the latent frames: set one of them to 0")
        if self.value_kd_weight > 0 and self.latent_steps < 2:
            raise ConfigError("codi.value_kd_weight > 0 aligns every layer at the value slot, a latent of its own: "
                              f"it needs codi.latent_steps >= 2 (got {self.latent_steps})")

    @property
    def uses_values(self) -> bool:
        """Whether training reads each example's `value_pos` (codi.data.values)."""
        return self.value_weight > 0 or self.value_kd_weight > 0

    def at_unit(self, unit: tuple[str, int, bool]) -> "CodiOptions":
        """These options with the block unit (latent_unit, frames_per_block, latent_call) of one unit-curriculum stage."""
        latent_unit, frames_per_block, latent_call = unit
        return dataclasses.replace(self, latent_unit=latent_unit, frames_per_block=frames_per_block,
                                   latent_call=latent_call, unit_stage_steps=0 if latent_unit == "locals" else
                                   self.unit_stage_steps)

    @classmethod
    def of(cls, obj: Any) -> "CodiOptions":
        """The options of `obj` (a CodiConfig, which has every field of this type and more)."""
        return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class LossWeights:
    """L = teacher_ce_weight*L_teacher + student_ce_weight*L_student + kd_weight*L_kd (params.yaml's alpha, beta,
    gamma; the reconstruction's weight is an option)."""

    teacher_ce_weight: float = option("alpha: weight of the teacher's CE on the explicit trace", ge=0.0)
    student_ce_weight: float = option("beta: weight of the student's CE around its latent frames", ge=0.0)
    kd_weight: float = option("gamma: weight of the KD loss", ge=0.0)
