"""CodiModel: the reference stage-2b design, batched in lockstep (frame k of every example together).

    model = CodiModel(base, token_ids(tok), params.codi.options, params.loss_weights)   # codi.schemas.options
    out = model(examples, ss_prob=ss_ramp(...), ss_rng=rng, latent_share=latent_share(...))
    out["loss"].backward()        # out also holds teacher_loss, student_loss, kd_loss, recon_loss (detached)

One teacher pass, then the student in rounds on PaddedRows: 2 + F * max(1, latent_steps) model calls per
batch (F = most latent LINE frames of an example), whatever its size; one more for the reconstruction.
The student's first round starts from the teacher's keys and values of the shared prefix (the prompt and the
trace up to the first latent frame's `<|line_sep|>`): same weights, same inputs, so the same numbers, and the
gradient flows through the teacher's graph as it did through the student's own (`_reuses_prefix` says when).
Every decoder call of a step goes through `CodiModel.decoder()`: codi.modeling.fast_decoder.LeanDecoder, the body's
outputs and gradients bit for bit with fewer operations and autograd nodes a call, where it applies.
Equal to the per-example oracle (tests/unit/test_modeling_equivalence.py). Design: docs/design/codi-model.md, "CodiModel".
"""

from __future__ import annotations

import copy
import random
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from codi.modeling.fast_decoder import LeanDecoder
from codi.modeling.latent import PaddedRows, build_projector, latent_input, latent_recurrence, value_feedback
from codi.modeling.losses import kd_hidden_per_example, kd_logit_per_example, per_example_mean, teacher_std, token_ce
from codi.modeling.plan import ExamplePlan, draw_uniform, plan_example
from codi.schemas.options import CodiOptions, LossWeights
from codi.tracing.tokens import TraceTokenIds

if TYPE_CHECKING:  # an annotation only: evaluate loads codi models without the training schema
    from codi.schemas.codi import CodiConfig


def split_causal_lm(model: nn.Module, what: str) -> tuple[nn.Module, nn.Module, int]:
    """(decoder body, lm_head, number of hidden states) of a HF causal LM; ValueError naming `what`."""
    prefix = getattr(model, "base_model_prefix", None)
    body = getattr(model, prefix, None) if prefix else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if body is None or head is None or not hasattr(model, "config"):
        raise ValueError(f"{what}: expected a Hugging Face causal LM (body + lm_head), got {type(model).__name__}")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "final_logit_softcapping", None):
        raise ValueError(f"{what}: models with final_logit_softcapping are not supported (logits = lm_head(hidden) here)")
    return body, head, int(cfg.num_hidden_layers) + 1


def _resolve_layers(layers: Sequence[int], n_states: int) -> tuple[int, ...]:
    return tuple(layer % n_states for layer in layers)


@contextmanager
def activation_checkpointing(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Temporarily set HF activation checkpointing (non-reentrant) on or off for `module`'s layers.

    Sets the flags HF's GradientCheckpointingLayer reads, without `activation_checkpointing_enable`'s
    side effects (input-grad hooks registered on every call)."""
    saved = []
    for m in module.modules():
        if hasattr(m, "gradient_checkpointing"):
            saved.append((m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func")))
            m.gradient_checkpointing = enabled
            if enabled:
                m._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    try:
        yield
    finally:
        for m, flag, func in saved:
            m.gradient_checkpointing = flag
            if func is not None:
                m._gradient_checkpointing_func = func


class CodiModel(nn.Module):
    """Shared-weight (or frozen) teacher + latent student over one base causal LM (docs/design/codi-model.md, "CodiModel")."""

    def __init__(self, base: nn.Module, token_ids: TraceTokenIds, options: CodiOptions, weights: LossWeights, *,
                 frozen_teacher: nn.Module | None = None, teacher_checkpointing: bool = True,
                 reuse_prefix: bool = True, lean_decoder: bool = True):
        """`options` and `weights` are checked where they are parsed (codi.schemas.options); this checks what
        needs the models: the trace token ids against the vocabulary, kd_layers against the layers, and a
        frozen teacher's sizes. ValueError names the key. `reuse_prefix` False makes the student compute the
        shared prefix itself even where it could reuse the teacher's (benchmarks, tests); `lean_decoder` False runs every
        decoder call through the body's own forward instead of codi.modeling.fast_decoder.LeanDecoder (the same
        numbers: benchmarks, tests)."""
        super().__init__()
        body, head, n_states = split_causal_lm(base, "base")
        if not isinstance(token_ids, TraceTokenIds):
            raise ValueError(f"token_ids: expected a TraceTokenIds, got {type(token_ids).__name__}")
        options = CodiOptions.of(options)  # the options alone, also when given a whole CodiConfig
        vocab = base.get_input_embeddings().weight.shape[0]
        for name, tid in token_ids.as_dict().items():
            if not 0 <= tid < vocab:
                raise ValueError(f"token_ids.{name} = {tid}: outside the base's embedding table ({vocab} rows); "
                                 "resize the embeddings after add_trace_tokens")

        kd_target, kd_layers = options.kd_target, options.kd_layers
        t_states = n_states
        if frozen_teacher is not None:
            _, t_head, t_states = split_causal_lm(frozen_teacher, "codi.frozen_teacher")
            if kd_target == "hidden" and frozen_teacher.config.get_text_config().hidden_size != base.config.get_text_config().hidden_size:
                raise ValueError("codi.frozen_teacher: hidden KD needs the teacher's hidden_size to equal the base's")
            if kd_target == "logit" and t_head.weight.shape[0] != head.weight.shape[0]:
                raise ValueError("codi.frozen_teacher: logit KD needs the teacher's vocabulary size to equal the base's")
            if options.value_kd_weight > 0:
                raise ValueError("codi.value_kd_weight > 0 aligns the shared-weight teacher's layers 1..L: set "
                                 "codi.frozen_teacher to \"\" or value_kd_weight to 0")
        if kd_layers is not None:
            for x in kd_layers:
                for states, who in ((n_states, "the base"), (t_states, "the frozen teacher")):
                    if not -states <= x < states:
                        raise ValueError(f"codi.kd_layers = {kd_layers!r}: {x} is out of range for {who}'s "
                                         f"{states} hidden states (0 = embeddings, -1 = last)")
            if kd_target == "logit" and (_resolve_layers(kd_layers, n_states) != (n_states - 1,)
                                         or _resolve_layers(kd_layers, t_states) != (t_states - 1,)):
                raise ValueError(f"codi.kd_layers = {kd_layers!r}: logit KD is defined on the last layer only "
                                 "(use null or [-1])")
        if kd_layers is None:  # reference defaults: all layers; frozen teacher or logit KD: the last
            eff = [-1] if (kd_target == "logit" or frozen_teacher is not None) else list(range(1, n_states))
        else:
            eff = kd_layers

        self.model = base
        h = base.config.get_text_config().hidden_size
        ref = base.get_input_embeddings().weight
        self.projector = build_projector(h, dtype=ref.dtype, device=ref.device, dropout=options.projector_dropout)
        if options.latent_steps == 0:
            self.projector.requires_grad_(False)
        self.token_ids = token_ids
        self.options, self.weights = options, weights
        # The auxiliary reconstruction decoder (SIM-CoT): a copy of the starting model, trained with the rest
        # (a submodule: optimizer, DDP, checkpoints) and never saved into the final model folder.
        self.recon_model = (copy.deepcopy(base) if options.recon_weight > 0 and options.recon_decoder == "copy"
                            else None)
        # Recompute the teacher's layers in backward (memory of one layer instead of all); the
        # student keeps its KV cache either way. codi.gradient_checkpointing.
        self.teacher_checkpointing = bool(teacher_checkpointing)
        self.reuse_prefix = bool(reuse_prefix)
        self.lean_decoder = bool(lean_decoder)
        self.n_states = n_states
        self.student_layers = _resolve_layers(eff, n_states)   # indices into the base's hidden_states
        self.value_layers = tuple(range(1, n_states))          # value KD: layers 1..L (no embeddings; PCCoT)
        self.teacher_layers = _resolve_layers(eff, t_states)   # indices into the teacher's hidden_states
        # A list keeps the frozen teacher out of state_dict, parameters() (optimizer) and DDP.
        self._frozen: list[nn.Module] = []
        if frozen_teacher is not None:
            frozen_teacher.eval().requires_grad_(False)
            self._frozen.append(frozen_teacher)

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, base: nn.Module, token_ids: TraceTokenIds, cfg: CodiConfig, weights: LossWeights,
                    frozen_teacher: nn.Module | None = None) -> "CodiModel":
        """Build from the `codi` params section (its options and gradient_checkpointing) and the loss weights."""
        if bool(cfg.frozen_teacher) != (frozen_teacher is not None):
            raise ValueError(f"codi.frozen_teacher = {cfg.frozen_teacher!r}: pass the loaded teacher model exactly "
                             "when this path is set" if cfg.frozen_teacher else
                             "codi.frozen_teacher = '': a frozen teacher model was passed but the config names none")
        return cls(base, token_ids, cfg.options, weights, frozen_teacher=frozen_teacher,
                   teacher_checkpointing=cfg.gradient_checkpointing)

    @property
    def frozen_teacher(self) -> nn.Module | None:
        return self._frozen[0] if self._frozen else None

    @property
    def body(self) -> nn.Module:
        return getattr(self.model, self.model.base_model_prefix)

    @property
    def head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def decoder(self) -> Any:
        """What runs the decoder body in this step: LeanDecoder (codi.modeling.fast_decoder: the body's outputs and
        gradients bit for bit, with fewer operations and autograd nodes a call) where it applies, else the body.
        Built per step: it holds the projections' transposed weights, views of the current parameters."""
        lean = LeanDecoder.of(self.body) if self.lean_decoder else None
        return lean if lean is not None else self.body

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    # ----------------------------------------------------------------------------------- forward
    def forward(self, examples: Sequence[dict[str, Any]], ss_prob: float = 0.0,
                ss_rng: random.Random | torch.Generator | None = None, latent_share: float = 1.0,
                latent_count: int | None = None, value_scale: float = 1.0) -> dict[str, torch.Tensor]:
        """The loss dict of a batch. `latent_share` (codi.modeling.plan.latent_share) is the share of each
        example's LINE frames that are latent (the first ones), or `latent_count` of them when given (the stage
        curriculum, plan.stage_latent_count); KD and reconstruction average over the examples that have a latent
        frame (0 when none has). `value_scale` multiplies the value terms' weights (plan.value_ramp)."""
        if not examples:
            raise ValueError("examples: expected a non-empty batch")
        if isinstance(value_scale, bool) or not isinstance(value_scale, (int, float)) or not 0.0 <= value_scale <= 1.0:
            raise ValueError(f"value_scale = {value_scale!r}: expected a factor in [0, 1]")
        if isinstance(ss_prob, bool) or not isinstance(ss_prob, (int, float)) or not 0.0 <= ss_prob <= 1.0:
            raise ValueError(f"ss_prob = {ss_prob!r}: expected a probability in [0, 1]")
        if ss_prob > 0 and ss_rng is None:
            raise ValueError("ss_rng: scheduled sampling (ss_prob > 0) needs an explicit random.Random or torch.Generator")
        plans = self.plans(examples, latent_share, values=self.options.uses_values, latent_count=latent_count)
        # One draw per (example, post-latent segment), examples then segments in order (the oracle's order).
        flags = [[ss_prob > 0 and draw_uniform(ss_rng) < ss_prob for _ in range(p.n_spans)] for p in plans]
        n, dev = len(plans), self.device
        decoder = self.decoder()
        t_ce, t_kd, t_value, prefix = self._teacher(plans, keep_prefix=self._reuses_prefix(), decoder=decoder)
        s_ce, s_kd, latents, s_value = self._student(plans, flags, values=self.options.uses_values, prefix=prefix,
                                                     decoder=decoder)

        counts = [p.n_anchors for p in plans]
        if self.options.single_anchor:  # keep each example's last latent frame's anchors only
            keep, start = [], 0
            for p in plans:
                if p.n_spans:
                    last = p.anchor_counts[-1]
                    keep.extend(range(start + p.n_anchors - last, start + p.n_anchors))
                start += p.n_anchors
            sel = torch.tensor(keep, dtype=torch.long, device=dev)
            t_kd, s_kd = t_kd[sel], s_kd[sel]
            counts = [p.anchor_counts[-1] if p.n_spans else 0 for p in plans]
        anchor_ex = torch.repeat_interleave(torch.arange(n, device=dev), torch.tensor(counts, device=dev))
        if not sum(counts):  # no latent frame in the batch (latent curriculum at its start)
            kd = torch.zeros(n, device=dev)
        elif self.options.kd_target == "logit":  # s_kd: student last hidden [A, 1, H]; t_kd: teacher logits [A, 1, V]
            kd = kd_logit_per_example(self.head(s_kd[:, 0]), t_kd[:, 0], self.options.kd_temp, anchor_ex, n)
        else:
            kd = kd_hidden_per_example(s_kd, t_kd, anchor_ex, n,
                                       scale=teacher_std(t_kd) if self.options.kd_norm == "teacher_std" else None)

        zero = torch.zeros((), device=dev)
        has_latent = torch.tensor([p.n_spans > 0 for p in plans], device=dev)
        n_latent = has_latent.sum().clamp(min=1)
        t_loss = t_ce.mean() if t_ce is not None else zero
        s_loss, kd_loss = s_ce.mean(), kd.sum() / n_latent
        recon_loss = (self._recon(plans, latents, decoder).sum() / n_latent if self.options.recon_weight > 0
                      else zero)
        value_loss, value_kd_loss = self._value_losses(s_value, t_value, n) if self.options.uses_values else (zero, zero)
        w = self.weights
        loss = w.teacher_ce_weight * t_loss + w.student_ce_weight * s_loss + w.kd_weight * kd_loss
        if self.options.recon_weight > 0:
            loss = loss + self.options.recon_weight * recon_loss
        if self.options.value_weight > 0:  # value_scale 1.0 leaves the weight's float as it is
            loss = loss + value_scale * self.options.value_weight * value_loss
        if self.options.value_kd_weight > 0:
            loss = loss + value_scale * self.options.value_kd_weight * value_kd_loss
        return {"loss": loss, "teacher_loss": t_loss.detach(), "student_loss": s_loss.detach(),
                "kd_loss": kd_loss.detach(), "recon_loss": recon_loss.detach(), "value_loss": value_loss.detach(),
                "value_kd_loss": value_kd_loss.detach()}

    def plans(self, examples: Sequence[dict[str, Any]], latent_share: float = 1.0, values: bool = False,
               latent_count: int | None = None) -> list[ExamplePlan]:
        """Each example's plan (codi.modeling.plan.plan_example) under this model's options: its latent spans, and in
        a multi-frame block (codi.frames_per_block) the LINE frames each one stands for (`block_frames`)."""
        o = self.options
        return [plan_example(ex, e, self.token_ids, latent_share, o.kd_positions, values=values, latent_count=latent_count,
                             unit=o.latent_unit, frames_per_block=o.frames_per_block, latent_call=o.latent_call)
                for e, ex in enumerate(examples)]

    def _value_losses(self, s_value: "_ValueSlots", t_value: torch.Tensor | None, n: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(value CE, value KD), each the mean over the examples that have a value slot (0 when none has).
        Student slots arrive in (example, span) order, the teacher's targets in the same order."""
        dev = self.device
        zero = torch.zeros((), device=dev)
        if not s_value.keys:
            return zero, zero
        ex = torch.tensor([e for e, _ in s_value.keys], dtype=torch.long, device=dev)
        n_with = (torch.bincount(ex, minlength=n) > 0).sum().clamp(min=1)
        value_loss = value_kd_loss = zero
        if self.options.value_weight > 0:
            ce = token_ce(s_value.hidden, self.head, torch.tensor(s_value.targets, dtype=torch.long, device=dev))
            value_loss = per_example_mean(ce, ex, n).sum() / n_with
        if self.options.value_kd_weight > 0:
            kd = kd_hidden_per_example(s_value.states, t_value, ex, n, scale=teacher_std(t_value))
            value_kd_loss = kd.sum() / n_with
        return value_loss, value_kd_loss

    # ----------------------------------------------------------------------------------- teacher
    def _reuses_prefix(self) -> bool:
        """Whether this forward's student starts from the teacher's keys and values of the shared prefix.

        Exact only when the teacher is the student's own weights and the forward is deterministic: not under a
        frozen teacher (other weights), not with an active dropout (the student would see the teacher's mask, not
        a draw of its own), and not while the teacher is checkpointed for backward (a checkpointed layer keeps no
        cache: codi.gradient_checkpointing trades the reuse for memory)."""
        if not self.reuse_prefix or self.frozen_teacher is not None:
            return False
        if self.teacher_checkpointing and self.training and torch.is_grad_enabled():
            return False
        return not (self.training and _has_active_dropout(self.body))

    def _teacher(self, plans: list[ExamplePlan], keep_prefix: bool = False, decoder: Any = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, "_Prefix | None"]:
        """(per-example CE [n] or None under a frozen teacher, KD targets [A, L, H] or logits [A, 1, V], value KD
        targets [V, L, H] at the token before each latent span's assigned value, (example, span) order, or None,
        and with `keep_prefix` the shared prefix's keys, values and outputs for the student, else None)."""
        dev, n = self.device, len(plans)
        full = [p.prompt + p.trace for p in plans]
        width = max(map(len, full))
        ids = torch.full((n, width), self.token_ids.pad, dtype=torch.long)
        for e, f in enumerate(full):
            ids[e, :len(f)] = torch.tensor(f)
        # Right padding and no attention mask: under the causal mask a real token never sees the pads
        # after it, so real positions compute what they would alone, and sdpa keeps its causal fast
        # path (a padding mask makes it compute every block: ~1.5x slower teacher). Pad positions'
        # outputs are finite (they see real tokens) and never used.
        mask = None
        pos = torch.arange(width, device=dev).expand(n, width)
        ids = ids.to(dev)
        anchors = torch.tensor([e * width + a for e, p in enumerate(plans) for a in p.teacher_anchors],
                               dtype=torch.long, device=dev)
        value_kd = self.options.value_kd_weight > 0
        # The token before the value predicts it: the teacher's state there is the value being produced.
        before_value = torch.tensor([e * width + len(p.prompt) + v - 1 for e, p in enumerate(plans)
                                     for v in p.value_pos if v >= 0], dtype=torch.long, device=dev)

        teacher = self.frozen_teacher
        if teacher is not None:
            if next(teacher.parameters()).device != dev:
                teacher.to(dev)
            t_body, t_head, t_states = split_causal_lm(teacher, "codi.frozen_teacher")
            with torch.no_grad():
                out = t_body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                             output_hidden_states=self._requested(self.teacher_layers, t_states))
                if self.options.kd_target == "logit":
                    return None, t_head(out.last_hidden_state.flatten(0, 1)[anchors])[:, None], None, None
                return None, self._gather_layers(out, self.teacher_layers, t_states, anchors), None, None

        checkpointed = self.teacher_checkpointing and not keep_prefix
        run = self.body if checkpointed or decoder is None else decoder  # checkpointing is the body's own forward
        with activation_checkpointing(self.model, checkpointed):
            wanted = self.teacher_layers + (self.value_layers if value_kd else ())
            out = run(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=keep_prefix,
                            output_hidden_states=self._requested(wanted, self.n_states))
        prefix = _Prefix.of(plans, out.last_hidden_state, out.cache) if keep_prefix else None
        flat = out.last_hidden_state.flatten(0, 1)  # [n*T, H]
        # Position q predicts token q+1; trained on the trace: q from len(prompt)-1 to len(full)-2.
        rows = [(e, q) for e, p in enumerate(plans) for q in range(len(p.prompt) - 1, len(p.prompt) + len(p.trace) - 1)]
        idx = torch.tensor([e * width + q for e, q in rows], device=dev)
        tgt = ids.flatten()[idx + 1]
        ex = torch.tensor([e for e, _ in rows], device=dev)
        ce = per_example_mean(token_ce(flat[idx], self.head, tgt), ex, n)
        t_value = (self._gather_layers(out, self.value_layers, self.n_states, before_value).detach() if value_kd
                   else None)
        if self.options.kd_target == "logit":  # extension: shared teacher's own logits, detached
            return ce, self.head(flat[anchors]).detach()[:, None], t_value, prefix
        return ce, self._gather_layers(out, self.teacher_layers, self.n_states, anchors).detach(), t_value, prefix

    @staticmethod
    def _requested(layers: Sequence[int], n_states: int) -> list[int] | None:
        """hidden_states indices to ask HF for (the last one is last_hidden_state, always returned)."""
        want = sorted({x for x in layers if x != n_states - 1})
        return want or None

    @staticmethod
    def _gather_layers(out: Any, layers: Sequence[int], n_states: int, flat_idx: torch.Tensor) -> torch.Tensor:
        """Rows flat_idx of the given hidden-state layers -> [A, len(layers), H]."""
        picked = [(out.last_hidden_state if x == n_states - 1 else out.hidden_states[x]).flatten(0, 1)[flat_idx]
                  for x in layers]
        return torch.stack(picked, dim=1)

    # ----------------------------------------------------------------------------------- student
    def _student(self, plans: list[ExamplePlan], flags: list[list[bool]], values: bool = False,
                 block_states: dict[tuple[int, int], torch.Tensor] | None = None, prefix: "_Prefix | None" = None,
                 decoder: Any = None) -> tuple[torch.Tensor, torch.Tensor, dict[tuple[int, int], torch.Tensor], "_ValueSlots"]:
        """(per-example CE [n], student KD hiddens [A, L, H] in (example, span, anchor) order, when the
        reconstruction is on each latent span's latent inputs {(example, span): [latent_steps, H]}, and the value
        slots (`values`: the plans carry value_pos and a value loss is on)). `block_states`, when given, receives each latent span's post-norm outputs
        at latent_start and at every latent, {(example, span): [latent_steps + 1, H]} (the latent probe).

        The value slot of a block is the hidden that feeds its last latent: the last but one latent's output
        (latent_start's with one latent step).

        Round k >= 1 runs latent steps 1..latent_steps-1 as one-slot calls, then one call for
        [last latent, LE, text, LS]: the last latent's input (projector of the previous hidden) is
        known before that call, and LE attends to it causally within the call, so fusing it is exact.

        `prefix` (the teacher's, `_teacher(keep_prefix=True)`): round 0 starts from its keys and values, reads
        its CE hiddens from the teacher's outputs, and runs only the `<|latent_start|>` that ends it. `decoder`
        (CodiModel.decoder) runs the body's calls; built here when not given."""
        dev, n = self.device, len(plans)
        n_rounds = max(p.n_spans for p in plans) + 1
        offsets = [0]  # first anchor of each example in the teacher's (example, span, anchor) order
        for p in plans:
            offsets.append(offsets[-1] + p.n_anchors)
        span_first = [[sum(p.anchor_counts[:s]) for s in range(p.n_spans)] for p in plans]
        latents: dict[tuple[int, int], torch.Tensor] = {}
        decoder = self.decoder() if decoder is None else decoder
        rows = PaddedRows(decoder, n, dev)
        ce_hidden, ce_tgt, ce_ex = [], [], []
        kd_parts, kd_order = [], []
        h = None  # [n, H] post-norm hidden feeding the next latent (latent_start's, then each latent's)
        req = self._requested(self.student_layers, self.n_states)
        opts = self.options
        m = opts.frames_per_block
        value = _ValueSlots()
        value_states = values and opts.value_kd_weight > 0
        embedding = self.model.get_input_embeddings().weight
        zero = torch.zeros((), dtype=self.model.get_input_embeddings().weight.dtype, device=dev)
        with activation_checkpointing(self.model, False):
            for k in range(n_rounds):
                active = [e for e, p in enumerate(plans) if k < len(p.rounds)]
                act = torch.zeros(n, dtype=torch.bool)
                act[active] = True
                act = act.to(dev)
                fuse = 1 if k > 0 and self.options.latent_steps > 0 else 0  # slot 0 holds the round's last latent
                rows.compact()
                inputs: list[torch.Tensor] | None = [] if self.options.recon_weight > 0 else None
                if fuse and m > 1:  # a multi-frame block: frame j's value slot feeds latent L - m + j
                    h, outputs = self._multi_frame_latents(plans, rows, h, act, active, k - 1, inputs,
                                                           value if values else None, value_states, embedding)
                    x = latent_input(self.projector, h)
                    if opts.value_feedback != "none":
                        x = x + value_feedback(self.head, embedding, h, opts.value_feedback)
                    fused = torch.where(act[:, None], x, zero)  # idle rows: zero input
                    if inputs is not None:
                        block = torch.stack(inputs + [fused], dim=1)  # [n, latent_steps, H]
                        latents.update({(e, k - 1): block[e] for e in active})
                elif fuse:
                    outputs: list[torch.Tensor] | None = [h] if block_states is not None else None
                    last_states: list[tuple] | None = [] if value_states else None
                    h = latent_recurrence(rows, self.projector, h, self.options.latent_steps - 1, act, inputs,
                                          outputs=outputs, last_states=last_states,
                                          last_layers=self._requested(self.value_layers, self.n_states))
                    x = latent_input(self.projector, h)
                    if opts.value_feedback != "none":
                        x = x + value_feedback(self.head, embedding, h, opts.value_feedback)
                    fused = torch.where(act[:, None], x, zero)  # idle rows: zero input
                    if values:
                        value.add(plans, active, k - 1, h, last_states, self.value_layers, self.n_states)
                    if inputs is not None:
                        block = torch.stack(inputs + [fused], dim=1)  # [n, latent_steps, H]
                        latents.update({(e, k - 1): block[e] for e in active})
                if k == 0 and prefix is not None:
                    rows, h = self._prefix_round(plans, prefix, ce_hidden, ce_tgt, ce_ex, n_rounds > 1, decoder)
                    continue
                ids, real, replace, last_slot, tgt_idx, width = self._round_block(plans, flags, active, k, fuse)
                for e in active:
                    ce_tgt.extend(t for _, t in plans[e].rounds[k].targets)
                    ce_ex.extend([e] * len(plans[e].rounds[k].targets))
                ids, real = ids.to(dev), real.to(dev)

                def embed_block(block_ids: torch.Tensor) -> torch.Tensor:
                    emb = self.embed(block_ids)  # [n, W, H]
                    if not fuse:
                        return emb
                    return torch.cat([fused[:, None], emb[:, 1:]], dim=1)

                if replace is not None:
                    # Scheduled sampling: the student's own argmax on the ground truth (no grad, detached
                    # cache); slot t takes the prediction made at slot t-1. CE targets stay ground truth.
                    pred = self.head(rows.peek(embed_block(ids), real)).argmax(-1)  # [n, W]
                    shifted = torch.cat([ids[:, :1], pred[:, :-1]], dim=1)
                    ids = torch.where(replace.to(dev), shifted, ids)
                last, hs = rows.step(embed_block(ids), real, hidden_layers=req if k > 0 else None)
                if fuse and block_states is not None:
                    block = torch.stack(outputs + [last[:, 0]], dim=1)  # [n, latent_steps + 1, H]
                    block_states.update({(e, k - 1): block[e].detach() for e in active})
                ce_hidden.append(last.flatten(0, 1)[torch.tensor(tgt_idx, device=dev)])
                if k > 0:
                    slots = [(e, d, a) for e in active for d, a in enumerate(plans[e].rounds[k].anchors)]
                    anchor_idx = torch.tensor([e * width + fuse + a for e, _, a in slots], dtype=torch.long, device=dev)
                    kd_parts.append(self._gather_layers(_Out(last, hs), self.student_layers, self.n_states, anchor_idx))
                    kd_order.extend(offsets[e] + span_first[e][k - 1] + d for e, d, _ in slots)
                if k + 1 < n_rounds:
                    h = last[torch.arange(n, device=dev), last_slot.to(dev)]  # latent_start's hidden
        ce = token_ce(torch.cat(ce_hidden), self.head, torch.tensor(ce_tgt, device=dev))
        s_ce = per_example_mean(ce, torch.tensor(ce_ex, device=dev), n)
        value = value.ordered()
        if not kd_order:  # no latent frame in the batch (or no anchor: kd_positions answer, truncated traces)
            h_size = self.model.config.get_text_config().hidden_size
            return s_ce, torch.zeros(0, len(self.student_layers), h_size, device=dev), latents, value
        # Rounds collect anchors (round, example)-major; reorder to the teacher's (example, span, anchor) order.
        inv = [0] * len(kd_order)
        for at, g in enumerate(kd_order):
            inv[g] = at
        s_kd = torch.cat(kd_parts)[torch.tensor(inv, dtype=torch.long, device=dev)]
        return s_ce, s_kd, latents, value

    def _multi_frame_latents(self, plans: list[ExamplePlan], rows: PaddedRows, h: torch.Tensor, act: torch.Tensor,
                             active: list[int], span: int, inputs: list[torch.Tensor] | None,
                             value: "_ValueSlots | None", value_states: bool, embedding: torch.Tensor
                             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Latents 0 .. L-2 of a multi-frame block (codi.frames_per_block m > 1; the last latent is fused into the
        round's call): frame j's value slot is the hidden feeding latent L - m + j, and with codi.value_feedback
        the slot's prediction is added to that latent's input. Returns the hidden feeding the last latent and the
        hiddens feeding each latent [latent_start's, latent 0's, ..., latent L-2's]."""
        opts = self.options
        steps, m = opts.latent_steps, opts.frames_per_block
        outputs = [h]
        states: list[tuple] | None = [] if value_states else None
        feedback = None
        if opts.value_feedback != "none":
            def feedback(hidden: torch.Tensor) -> torch.Tensor:
                return value_feedback(self.head, embedding, hidden, opts.value_feedback)
        h = latent_recurrence(rows, self.projector, h, steps - 1, act, inputs, outputs=outputs, last_states=states,
                              last_layers=self._requested(self.value_layers, self.n_states), states_from=steps - m - 1,
                              feedback=feedback, feedback_from=steps - m)
        if value is not None:
            for j in range(m):  # outputs[t] feeds latent t; step t - 1 (states[j]) computed it
                t = steps - m + j
                value.add(plans, active, span, outputs[t], None if states is None else [states[j]], self.value_layers,
                          self.n_states, frame=j)
        return h, outputs

    def _prefix_round(self, plans: list[ExamplePlan], prefix: "_Prefix", ce_hidden: list, ce_tgt: list,
                      ce_ex: list, latents_follow: bool, decoder: Any) -> tuple[PaddedRows, torch.Tensor | None]:
        """Round 0 from the teacher's prefix: the rows start from its keys and values, the round's CE hiddens are
        the teacher's outputs at the same positions, and one call runs each row's `<|latent_start|>`. Returns
        the rows and latent_start's hidden [n, H] (None when no latent follows in the batch)."""
        dev = self.device
        rows = PaddedRows.after_prefix(decoder, prefix.cache,
                                       torch.tensor(prefix.lengths, dtype=torch.long, device=dev))
        width = prefix.hidden.shape[1]
        idx = []
        for e, p in enumerate(plans):  # round 0's slots are positions of prompt + trace, as in the teacher's row
            targets = p.rounds[0].targets
            ce_tgt.extend(t for _, t in targets)
            ce_ex.extend([e] * len(targets))
            idx.extend(e * width + slot for slot, _ in targets)
        ce_hidden.append(prefix.hidden.flatten(0, 1)[torch.tensor(idx, dtype=torch.long, device=dev)])
        if not latents_follow:
            return rows, None
        ends = torch.tensor([p.rounds[0].ends_in_latent for p in plans], dtype=torch.bool)
        ids = torch.where(ends, self.token_ids.latent_start, self.token_ids.pad)[:, None]
        last, _ = rows.step(self.embed(ids.to(dev)), ends[:, None].to(dev))
        return rows, last[:, 0]

    # ---------------------------------------------------------------------------- reconstruction
    @property
    def recon_lm(self) -> nn.Module:
        """The reconstruction decoder: the auxiliary copy (recon_decoder copy) or the model itself (shared)."""
        return self.recon_model if self.recon_model is not None else self.model

    def recon_inputs(self, plans: list[ExamplePlan], latents: dict[tuple[int, int], torch.Tensor]
                     ) -> tuple[torch.Tensor, list[list[int]], list[tuple[int, int]]]:
        """The reconstruction batch: one row per latent span, [latents, <|line_sep|> (or <|call_sep|>), locals...] right-padded
        ([S, W, H] input embeddings of the decoder), each row's targets (the locals and `<|action_sep|>`, read at
        slots latent_steps .. latent_steps + len - 1), and the (example, span) of each row."""
        keys = sorted(latents)
        dev, steps = self.device, self.options.latent_steps
        emb = self.recon_lm.get_input_embeddings()
        targets, markers = [], []
        for e, s in keys:
            i, r = plans[e].spans[s][0], plans[e].resume[s]
            targets.append(list(plans[e].trace[i + 1:r + 1]))  # what the block stands for, then the token resuming the text
            markers.append(plans[e].trace[i])  # <|line_sep|>; <|call_sep|> for a latent call frame (codi.latent_call)
        width = steps + max(map(len, targets))
        ids = torch.full((len(keys), width - steps), self.token_ids.pad, dtype=torch.long)
        for r, (marker, tgt) in enumerate(zip(markers, targets)):
            ids[r, :len(tgt)] = torch.tensor([marker] + tgt[:-1])  # teacher forcing
        block = torch.stack([latents[k] for k in keys]).to(emb.weight.dtype)  # [S, steps, H]
        return torch.cat([block, emb(ids.to(dev))], dim=1), targets, keys

    def _recon(self, plans: list[ExamplePlan], latents: dict[tuple[int, int], torch.Tensor],
               decoder: Any = None) -> torch.Tensor:
        """Per-example reconstruction CE [n] (codi.recon_weight, SIM-CoT's step-level supervision): a decoder
        reads only a LINE frame's latents and `<|line_sep|>`, and must write the frame's locals and
        `<|action_sep|>` (teacher-forced); mean over an example's reconstructed tokens, 0 without latent frames.
        One decoder call for every span of the batch (right padding, no mask: causal rows never see it), through the
        step's `decoder` when the reconstruction decoder is the model itself (recon_decoder shared)."""
        n, dev = len(plans), self.device
        if not latents:
            return torch.zeros(n, device=dev)
        inputs, targets, keys = self.recon_inputs(plans, latents)
        body, head, _ = split_causal_lm(self.recon_lm, "codi recon decoder")
        width = inputs.shape[1]
        pos = torch.arange(width, device=dev).expand(len(keys), width)
        with activation_checkpointing(self.recon_lm, False):
            if self.recon_model is not None or decoder is None:
                decoder = LeanDecoder.of(body) if self.lean_decoder else None
            run = decoder if decoder is not None else body
            hidden = run(inputs_embeds=inputs, position_ids=pos, use_cache=False).last_hidden_state  # [S, W, H]
        steps = self.options.latent_steps
        idx = torch.tensor([r * width + steps + q for r, t in enumerate(targets) for q in range(len(t))],
                           dtype=torch.long, device=dev)
        tgt = torch.tensor([x for t in targets for x in t], dtype=torch.long, device=dev)
        ex = torch.tensor([keys[r][0] for r, t in enumerate(targets) for _ in t], dtype=torch.long, device=dev)
        return per_example_mean(token_ce(hidden.flatten(0, 1)[idx], head, tgt), ex, n)

    @torch.no_grad()
    def reconstruct(self, examples: Sequence[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
        """The reconstruction probe: for every LINE frame of `examples` (all latent, the student reading the
        true trace), the reconstruction decoder's greedy locals from the frame's latents alone, against the
        truth. Returns (predicted, truth) per frame: the truth ends with `<|action_sep|>`, the prediction at its
        first `<|action_sep|>` or at the truth's length."""
        if self.options.recon_weight <= 0:
            raise ValueError("reconstruct: the model trains no reconstruction decoder (codi.recon_weight = 0)")
        was = self.training
        self.eval()
        try:
            plans = self.plans(examples)
            _, _, latents, _ = self._student(plans, [[False] * p.n_spans for p in plans])
            inputs, targets, _ = self.recon_inputs(plans, latents)
            body, head, _ = split_causal_lm(self.recon_lm, "codi recon decoder")
            emb = self.recon_lm.get_input_embeddings()
            steps, dev = self.options.latent_steps, self.device
            seq = inputs[:, :steps + 1]  # latents and <|line_sep|>; then greedy, one token per call
            preds: list[list[int]] = [[] for _ in targets]
            done = [False] * len(targets)
            for _ in range(max(map(len, targets))):
                pos = torch.arange(seq.shape[1], device=dev).expand(seq.shape[0], -1)
                last = body(inputs_embeds=seq, position_ids=pos, use_cache=False).last_hidden_state[:, -1]
                nxt = head(last).argmax(-1)  # [S]
                for r, tok in enumerate(nxt.tolist()):
                    if not done[r]:
                        preds[r].append(tok)  # capped at the truth's length: longer is wrong anyway
                        done[r] = tok == targets[r][-1] or len(preds[r]) == len(targets[r])  # the resuming token
                if all(done):
                    break
                seq = torch.cat([seq, emb(nxt)[:, None].to(seq.dtype)], dim=1)
            return list(zip(preds, targets))
        finally:
            self.train(was)

    def _round_block(self, plans: list[ExamplePlan], flags: list[list[bool]], active: list[int], k: int, fuse: int):
        """Host-side tensors of round k: ids [n, W] (slot 0 a placeholder when fused), real [n, W],
        scheduled-sampling replace mask [n, W] or None, last slot [n], flat CE slot indices, W."""
        n, pad = len(plans), self.token_ids.pad
        width = fuse + max(len(plans[e].rounds[k].tokens) for e in active)
        ids = torch.full((n, width), pad, dtype=torch.long)
        real = torch.zeros(n, width, dtype=torch.bool)
        replace = torch.zeros(n, width, dtype=torch.bool)
        last_slot = torch.zeros(n, dtype=torch.long)
        tgt_idx: list[int] = []
        for e in active:
            r = plans[e].rounds[k]
            end = fuse + len(r.tokens)
            ids[e, fuse:end] = torch.tensor(r.tokens)
            real[e, :end] = True
            last_slot[e] = end - 1
            a, b = r.ss_slots
            if k > 0 and flags[e][k - 1] and b > a:
                replace[e, fuse + a:fuse + b] = True
            tgt_idx.extend(e * width + fuse + slot for slot, _ in r.targets)
        return ids, real, (replace if bool(replace.any()) else None), last_slot, tgt_idx, width


    @torch.no_grad()
    def block_states(self, examples: Sequence[dict[str, Any]]) -> list[list[torch.Tensor]]:
        """The latent probe's view: for every LINE frame of `examples` (all latent, the student reading the true
        trace around them, so that block s is LINE frame s), the post-norm outputs at latent_start and at each
        latent, [latent_steps + 1, H] on the CPU, per example in span order."""
        if self.options.latent_steps == 0:
            raise ValueError("block_states: the model makes no latents (codi.latent_steps = 0)")
        was = self.training
        self.eval()
        try:
            plans = self.plans(examples)
            states: dict[tuple[int, int], torch.Tensor] = {}
            self._student(plans, [[False] * p.n_spans for p in plans], block_states=states)
            return [[states[(e, s)].float().cpu() for s in range(p.n_spans)] for e, p in enumerate(plans)]
        finally:
            self.train(was)


class _ValueSlots:
    """The student's value slots of a batch, gathered round by round and then put in (example, span) order:
    the post-norm hidden [V, H], the target token ids, and (value KD) the slot's layers 1..L [V, L, H]."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []
        self.targets: list[int] = []
        self._hidden: list[torch.Tensor] = []
        self._states: list[torch.Tensor] = []
        self.hidden: torch.Tensor | None = None
        self.states: torch.Tensor | None = None

    def add(self, plans: list[ExamplePlan], active: list[int], span: int, h: torch.Tensor,
            states: list[tuple | None] | None, layers: Sequence[int], n_states: int, frame: int = 0) -> None:
        """Round `span + 1`'s value slots of its block's frame `frame` (0 but in a multi-frame block): h [n, H] the
        slot's last-layer output; `states` (value KD only) holds the slot call's hidden_states tuple (the last layer
        is h itself). Keys are (example, index into value_pos): the teacher's order."""
        where = {e: plans[e].value_index(span, frame) for e in active}
        rows = [e for e in active if where[e] is not None and plans[e].value_pos[where[e]] >= 0]
        if not rows:
            return
        idx = torch.tensor(rows, dtype=torch.long, device=h.device)
        self.keys.extend((e, where[e]) for e in rows)
        self.targets.extend(plans[e].trace[plans[e].value_pos[where[e]]] for e in rows)
        self._hidden.append(h[idx])
        if states is not None:  # the value slot's call is one slot wide: position 0
            self._states.append(torch.stack([h if x == n_states - 1 else states[0][x][:, 0] for x in layers],
                                            dim=1)[idx])

    def ordered(self) -> "_ValueSlots":
        if not self.keys:
            return self
        order = sorted(range(len(self.keys)), key=self.keys.__getitem__)
        sel = torch.tensor(order, dtype=torch.long, device=self._hidden[0].device)
        self.keys = [self.keys[i] for i in order]
        self.targets = [self.targets[i] for i in order]
        self.hidden = torch.cat(self._hidden)[sel]
        self.states = torch.cat(self._states)[sel] if self._states else None
        return self


class _Prefix:
    """The teacher's share of the student's first round: each row's shared prefix length (round 0 without its
    closing `<|latent_start|>`; the whole row when no frame is latent), the keys and values of the first
    max(lengths) positions, and the teacher's post-norm outputs [n, T, H] (round 0's CE hiddens)."""

    def __init__(self, lengths: list[int], cache: DynamicCache, hidden: torch.Tensor):
        self.lengths, self.cache, self.hidden = lengths, cache, hidden

    @classmethod
    def of(cls, plans: list[ExamplePlan], hidden: torch.Tensor, cache: DynamicCache) -> "_Prefix":
        lengths = [len(p.rounds[0].tokens) - int(p.rounds[0].ends_in_latent) for p in plans]
        width = max(lengths)
        shared = DynamicCache()
        for i, layer in enumerate(cache.layers):  # views: the student's later blocks concatenate, never write in place
            shared.update(layer.keys[:, :, :width], layer.values[:, :, :width], i)
        return cls(lengths, shared, hidden)


def _has_active_dropout(module: nn.Module) -> bool:
    """Whether `module`'s forward draws random numbers in training mode: a Dropout with p > 0 or an attention
    dropout (config.attention_dropout) above 0."""
    cfg = getattr(module, "config", None)
    if cfg is not None and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


class _Out:
    """The two fields `_gather_layers` reads from a model output."""

    def __init__(self, last_hidden_state: torch.Tensor, hidden_states: tuple | None):
        self.last_hidden_state, self.hidden_states = last_hidden_state, hidden_states
