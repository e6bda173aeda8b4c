"""The per-example oracle of the codi model, and tiny fixtures to test and benchmark it.

`oracle_forward(model, examples, ss_prob, ss_rng)` computes what the reference design computes
(docs/design/codi-model.md, "The reference design"), one example at a time and one model call per segment, on
the weights of a `codi.modeling.CodiModel`. It is deliberately plain: the reference's loop, the
transformers 5 API (`cache=`), nothing of the batched code under test but the weights. One documented
extension: kd_target="logit" with the shared-weight teacher targets lm_head(teacher last hidden), detached.
Scheduled sampling: one uniform per post-latent segment, examples then segments in order, from `ss_rng`.
The options beyond the reference, as specified (docs/design/codi-model.md, "CodiModel"): latent_share (the first
round(share * n) LINE frames latent), kd_positions action_line (KD at the separator and its line's tokens),
kd_norm teacher_std (each layer's term / the std of the batch's teacher anchors), and the reconstruction loss
(a decoder reads a frame's latents + <|line_sep|> and writes its locals + <|action_sep|>). KD and
reconstruction average over the examples that have a latent frame.
`latent_block` is the lockstep decoder form of the training recurrence, for the consistency tests.
`codi_model(base, ids, latent_steps, **options)` builds a CodiModel with the reference's options, some replaced.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from codi.infra.config import build
from codi.modeling import CodiModel, CodiOptions, LossWeights
from codi.modeling.latent import PaddedRows, latent_recurrence
from codi.tracing.tokens import TraceTokenIds

# The reference design's options (CodiOptions has no defaults: params.yaml or a saved folder sets them).
REFERENCE_OPTIONS = dict(kd_layers=None, kd_target="hidden", kd_temp=2.0, single_anchor=False, kd_norm="none",
                         kd_positions="action_sep", recon_weight=0.0, recon_decoder="shared",
                         latent_curriculum_frac=0.0, mix_explicit_prob=0.0, projector_dropout=0.0,
                         value_weight=0.0, value_feedback="none", value_kd_weight=0.0, stage_steps=0,
                         stage_reset_optimizer=False, stage_smoothing=0.0, stage_mix_prob=0.0, latent_unit="locals",
                         frames_per_block=1, latent_call=False,
                         unit_stage_steps=0)


def codi_model(base, token_ids, latent_steps, *, frozen_teacher=None, teacher_checkpointing=False,
               teacher_ce_weight=1.0, student_ce_weight=1.0, kd_weight=1.0, **options) -> CodiModel:
    """A CodiModel with the reference's options, `options` replaced; they are checked as params.yaml's are
    (ConfigError naming `codi.<key>`)."""
    opts = build(CodiOptions, {**REFERENCE_OPTIONS, "latent_steps": latent_steps, **options}, prefix="codi.",
                 source="test")
    weights = build(LossWeights, dict(teacher_ce_weight=teacher_ce_weight, student_ce_weight=student_ce_weight,
                                      kd_weight=kd_weight), prefix="", source="test")
    return CodiModel(base, token_ids, opts, weights, frozen_teacher=frozen_teacher,
                     teacher_checkpointing=teacher_checkpointing)


def _uniform(rng):
    if isinstance(rng, random.Random):
        return rng.random()
    return float(torch.rand((), generator=rng, device=rng.device))


def _kd_layers(model):
    layers = model.options.kd_layers
    if model.options.kd_target == "logit" or (model.frozen_teacher is not None and layers is None):
        layers = [-1]
    return layers


def _select(hs, layers):
    return hs[1:] if layers is None else tuple(hs[layer] for layer in layers)


def _teacher(model, full, labels, kd_pos):
    base, head, layers = model.model, model.model.lm_head, _kd_layers(model)
    pos = torch.tensor(kd_pos, dtype=torch.long, device=full.device)
    tch = model.frozen_teacher
    if tch is not None:  # frozen teacher: KD targets only, no teacher CE
        if next(tch.parameters()).device != full.device:
            tch.to(full.device)
        with torch.no_grad():
            if model.options.kd_target == "logit":
                return None, [tch(input_ids=full[None], use_cache=False).logits[0, pos]]
            hs = tch(input_ids=full[None], use_cache=False, output_hidden_states=True).hidden_states
            return None, [h[0, pos] for h in _select(hs, layers)]
    with torch.no_grad():
        hs = base(input_ids=full[None], use_cache=False, output_hidden_states=True).hidden_states
        if model.options.kd_target == "logit":  # the extension: the shared teacher's own logits
            kd = [head(hs[-1][0, pos])]
        else:
            kd = [h[0, pos] for h in _select(hs, layers)]
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        logits = base(input_ids=full[None], use_cache=False).logits
    finally:
        base.activation_checkpointing_disable()
        base.disable_input_require_grads()
    ce = F.cross_entropy(logits[0, :-1], labels[1:], ignore_index=-100)
    return ce, kd


def _latent_block(model, cache, latents=None):
    """latent_start, the latents, latent_end; appends the latents' input embeddings to `latents`."""
    body, head, emb = model.model.model, model.model.lm_head, model.model.get_input_embeddings()
    ids, dev = model.token_ids, emb.weight.device
    o = body(inputs_embeds=emb(torch.tensor([[ids.latent_start]], device=dev)), cache=cache, use_cache=True)
    cache, h = o.cache, o.last_hidden_state[:, -1:]
    block = []
    for _ in range(model.options.latent_steps):
        x = model.projector(h)
        block.append(x[0, 0])
        o = body(inputs_embeds=x, cache=cache, use_cache=True)
        cache, h = o.cache, o.last_hidden_state[:, -1:]
    if latents is not None:
        latents.append(torch.stack(block) if block else None)
    o = body(inputs_embeds=emb(torch.tensor([[ids.latent_end]], device=dev)), cache=cache, use_cache=True)
    return o.cache, head(o.last_hidden_state[:, -1])


def _line_len(model, trace, j):
    """KD anchors of a latent frame whose <|action_sep|> is trace[j]: 1, or (action_line) the separator and
    the tokens of its line up to the next <|frame_sep|>."""
    if model.options.kd_positions == "action_sep":
        return 1
    fs = model.token_ids.frame_sep
    rest = trace[j + 1:].tolist()
    return 1 + (rest.index(fs) if fs in rest else len(rest))


def _student(model, prompt, trace, spans, ss_prob, ss_rng, latents, kd_m):
    base, emb, layers = model.model, model.model.get_input_embeddings(), _kd_layers(model)
    segs, prev, kd = [], 0, False
    for i, j in spans:
        segs.append(("text", trace[prev:i + 1], kd))
        segs.append(("latent", None, False))
        prev, kd = j, True
    segs.append(("text", trace[prev:], kd))
    last = len(segs) - 1

    out = base(inputs_embeds=emb(prompt[None]), use_cache=True)
    cache, prev_logits = out.cache, out.logits[:, -1]  # predicts trace[0]
    ce_logits, ce_targets, kd_vecs = [], [], []
    for s, (kind, ids, kd) in enumerate(segs):
        if kind == "latent":  # prev_logits predicted the dropped locals: replaced, never trained
            cache, prev_logits = _latent_block(model, cache, latents)
            continue
        inp = ids
        if kd and ss_prob > 0 and _uniform(ss_rng) < ss_prob:
            end = ids.numel() if s == last else ids.numel() - 1
            c = DynamicCache()
            for li, layer in enumerate(cache.layers):
                c.update(layer.keys.detach(), layer.values.detach(), li)
            with torch.no_grad():
                pred = base(inputs_embeds=emb(ids[None]), cache=c, use_cache=True).logits[0].argmax(-1)
            inp = ids.clone()
            inp[1:end] = pred[:end - 1]
        ce_logits.append(prev_logits)
        ce_targets.append(ids[:1])
        out = base(inputs_embeds=emb(inp[None]), cache=cache, use_cache=True, output_hidden_states=kd)
        cache, logits = out.cache, out.logits[0]
        if ids.numel() > 1:
            ce_logits.append(logits[:-1])
            ce_targets.append(ids[1:])
        prev_logits = logits[-1:]
        if kd:  # the segment's first token is the frame's <|action_sep|> (its line follows)
            m = kd_m.pop(0)
            kd_vecs.append([h[0, :m] for h in _select(out.hidden_states, layers)])
    ce = F.cross_entropy(torch.cat(ce_logits), torch.cat(ce_targets))
    if not kd_vecs:
        return ce, None
    s_kd = [torch.cat([v[layer] for v in kd_vecs]) for layer in range(len(kd_vecs[0]))]  # per layer [A, H]
    return ce, s_kd


def _kd_loss(model, s_kd, t_kd, std):
    s, t = torch.stack(s_kd), torch.stack(t_kd).detach()  # [L, A, H] or (logit) [1, A, V]
    if model.options.kd_target == "logit":
        temp = model.options.kd_temp
        sl, tl = model.model.lm_head(s).flatten(0, -2) / temp, t.flatten(0, -2) / temp
        return F.kl_div(F.log_softmax(sl, -1), F.softmax(tl, -1), reduction="batchmean") * temp * temp
    if std is None:
        return F.smooth_l1_loss(s, t)
    return (F.smooth_l1_loss(s, t, reduction="none") / std[:, None, None]).mean()


def _recon(model, trace, spans, latents):
    """Reconstruction CE of one example: per latent frame a fresh decoder pass over [its latents,
    <|line_sep|>, its locals], trained on the locals then <|action_sep|>; mean over all the example's tokens."""
    lm = model.recon_model if model.recon_model is not None else model.model
    emb = lm.get_input_embeddings()
    logits, targets = [], []
    for (i, j), lat in zip(spans, latents):
        inp = torch.cat([lat, emb(trace[i:j])])  # latents, <|line_sep|>, the locals
        out = lm(inputs_embeds=inp[None], use_cache=False).logits[0]
        logits.append(out[lat.shape[0]:])
        targets.append(trace[i + 1:j + 1])
    return F.cross_entropy(torch.cat(logits), torch.cat(targets))


def oracle_forward(model, examples, ss_prob=0.0, ss_rng=None, latent_share=1.0):
    """The reference design, example by example, on `model`'s weights. Returns the same dict as CodiModel."""
    dev = model.model.get_input_embeddings().weight.device
    tl = sl = 0.0
    per_ex = []  # (student kd [L][A, H] or None, teacher kd, example index, latents, spans, trace)
    for e, ex in enumerate(examples):
        prompt, trace = torch.tensor(ex["prompt_ids"], device=dev), torch.tensor(ex["trace_ids"], device=dev)
        spans = [tuple(s) for s in ex["spans"]]
        spans = spans[:min(len(spans), math.floor(latent_share * len(spans) + 0.5))]
        full = torch.cat([prompt, trace])
        labels = torch.cat([torch.full((len(prompt),), -100, device=dev), trace])
        ms = [_line_len(model, trace, j) for _, j in spans]
        kd_pos = [len(prompt) + j + d for (_, j), m in zip(spans, ms) for d in range(m)]
        t_ce, t_kd = _teacher(model, full, labels, kd_pos)
        latents = []
        s_ce, s_kd = _student(model, prompt, trace, spans, ss_prob, ss_rng, latents, list(ms))
        if s_kd is not None and model.options.single_anchor:  # the last latent frame's anchors
            t_kd, s_kd = [t[-ms[-1]:] for t in t_kd], [s[-ms[-1]:] for s in s_kd]
        tl = tl + (t_ce if t_ce is not None else 0.0)
        sl = sl + s_ce
        per_ex.append((s_kd, t_kd, latents, spans, trace))
    std = None
    if model.options.kd_norm == "teacher_std":  # the population: every kept teacher anchor of the batch, per layer
        pop = [torch.stack(t) for s, t, *_ in per_ex if s is not None]  # [L, A_e, H]
        flat = torch.cat(pop, dim=1).detach().float()
        std = flat.reshape(flat.shape[0], -1).std(dim=1).clamp(min=1e-6)
    kl = rl = 0.0
    for s_kd, t_kd, latents, spans, trace in per_ex:
        if s_kd is None:
            continue
        kl = kl + _kd_loss(model, s_kd, t_kd, std)
        if model.options.recon_weight > 0:
            rl = rl + _recon(model, trace, spans, latents)
    n = len(examples)
    n_latent = max(1, sum(s is not None for s, *_ in per_ex))
    zero = torch.tensor(0.0, device=dev)
    kl = kl if torch.is_tensor(kl) else zero
    rl = rl if torch.is_tensor(rl) else zero
    loss = (model.weights.teacher_ce_weight * tl / n + model.weights.student_ce_weight * sl / n + model.weights.kd_weight * kl / n_latent
            + (model.options.recon_weight * rl / n_latent if model.options.recon_weight > 0 else 0.0))
    t_log = (tl / n).detach() if torch.is_tensor(tl) else torch.tensor(0.0, device=dev)
    return {"loss": loss, "teacher_loss": t_log, "student_loss": (sl / n).detach(),
            "kd_loss": (kl / n_latent).detach(), "recon_loss": (rl / n_latent).detach()}


def oracle_latent_block(model, prefix_ids):
    """Logits after a latent block appended to `prefix_ids` (one example): the reference's _latent_block."""
    out = model.model(input_ids=torch.tensor([prefix_ids], device=model.model.device), use_cache=True)
    return _latent_block(model, out.cache)[1][0]


# ------------------------------------------------------------------- fixtures: tiny model, examples
TOKEN_IDS = TraceTokenIds(trace_context_start=0, frame_sep=1, call_sep=2, line_sep=3, return_sep=4,
                          exception_sep=5, action_sep=6, arg_sep=7, latent_start=8, latent_end=9, pad=10, eos=11)
FIRST_PLAIN = 12  # ids >= this are ordinary text tokens


def tiny_base(seed=0, vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, attn="sdpa",
              tie=True, init=0.1):
    """A random fp32 Qwen2ForCausalLM in train mode (no dropout)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      tie_word_embeddings=tie, initializer_range=init, pad_token_id=TOKEN_IDS.pad,
                      eos_token_id=TOKEN_IDS.eos, attn_implementation=attn)
    return Qwen2ForCausalLM(cfg).train()


def make_example(rng, n_line, vocab=96, prompt_len=(4, 10), locals_len=(1, 6), code_len=(1, 6),
                 other_frames=True):
    """A synthetic trace in the grammar's shape with `n_line` LINE frames and their spans.

    other_frames=False makes the LINE frames back to back (no call/return frames between them)."""
    ids = TOKEN_IDS

    def plain(lo_hi):
        return [rng.randrange(FIRST_PLAIN, vocab) for _ in range(rng.randint(*lo_hi))]

    prompt = [ids.trace_context_start] + plain(prompt_len) + [ids.frame_sep]
    trace = [ids.call_sep] + plain(locals_len) + [ids.action_sep] + plain(code_len) + [ids.frame_sep]
    spans = []
    for _ in range(n_line):
        if other_frames and rng.random() < 0.3:
            trace += [ids.return_sep, ids.action_sep] + plain(code_len) + [ids.arg_sep] + plain((1, 3)) + [ids.frame_sep]
        i = len(trace)
        trace += [ids.line_sep] + plain(locals_len)
        spans.append((i, len(trace)))
        trace += [ids.action_sep] + plain(code_len) + [ids.frame_sep]
    trace += [ids.return_sep, ids.action_sep] + plain(code_len) + [ids.arg_sep] + plain((1, 3)) + [ids.frame_sep, ids.eos]
    return {"prompt_ids": prompt, "trace_ids": trace, "spans": spans}


def latent_block(rows: PaddedRows, projector: nn.Module, embed: nn.Module, latent_start: int, latent_end: int,
                 steps: int, active: torch.Tensor, pad: int) -> torch.Tensor:
    """A whole latent block on `rows` in lockstep: latent_start, `steps` latents, latent_end.

    The decoder form of the training recurrence, for the consistency tests (codi.evaluation.decoding feeds the same
    `latent_input` one position at a time, because its rows advance independently).

    Returns the post-norm hidden [B, H] at latent_end (apply lm_head for the next-token logits).
    Inactive rows get padding slots; their returned hidden is meaningless."""
    active = active.to(device=rows.device, dtype=torch.bool)
    B = rows.batch_size

    def token_block(tok: int) -> torch.Tensor:
        ids = torch.where(active, torch.tensor(tok, device=rows.device), torch.tensor(pad, device=rows.device))
        last, _ = rows.step(embed(ids.view(B, 1)), active[:, None])
        return last[:, 0]

    h = token_block(latent_start)
    latent_recurrence(rows, projector, h, steps, active)
    return token_block(latent_end)


def batch_with_values(frames=(2, 3, 1), seed=0) -> list[dict]:
    """make_example batches whose spans carry a `value_pos` (the value options' contract): the token after each
    span's `<|line_sep|>` with probability 0.8, else -1."""
    rng = random.Random(seed)
    out = []
    for n in frames:
        ex = make_example(rng, n)
        ex["value_pos"] = [i + 1 if rng.random() < 0.8 else -1 for i, _ in ex["spans"]]
        out.append(ex)
    return out
