"""The decoder body's forward as a codi step needs it: Hugging Face's operations, without their per-call Python.

    decoder = LeanDecoder.of(body) or body        # once a training step (or decoding batch)
    out = decoder(inputs_embeds=x, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    out.last_hidden_state, out.cache, out.hidden_states      # as body(...) returns them

A codi step calls the decoder body 2 + F x latent_steps times, and evaluate's decoder once a position, most calls on
a handful of rows. At such sizes a call's cost is its operations and autograd nodes, not its arithmetic, and
Hugging Face's Qwen2/Llama forward makes many: a view around every projection's matmul, a transpose of every weight
at every call, rotate_half's four operations for q and again for k, the causal-mask factory, the output-capture and
kwarg decorators. LeanDecoder runs the same arithmetic operations, in the same order, on the same tensors: the
projections as the addmm each F.linear makes, on [rows, hidden] views of the layer's input, with the weights
transposed once a step; rotate_half(x) * sin as roll(x) * sin with its first half negated (product for product the
same floats: (-a) * b == a * (-b)); the sdpa mask built once a call, as create_causal_mask builds it. Its outputs and,
in training, its gradients are bit-identical to the body's (tests/unit/test_fast_decoder.py compares them with
torch.equal); a default codi step records 1,751 autograd nodes instead of 2,420.

It runs only where it is exact (`applies`): a Qwen2Model or LlamaModel body of full-attention sdpa layers with the
default rotary embedding and SiLU MLPs, every projection a plain nn.Linear, no module hooks (FSDP, PEFT and user
hooks add them; Hugging Face's inert output-capturing hooks are allowed), no activation checkpointing, no attention
dropout in training. Anything else goes through the body's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa

_SUPPORTED_BODIES = ("Qwen2Model", "LlamaModel")
_SUPPORTED_NORMS = ("Qwen2RMSNorm", "LlamaRMSNorm")


@dataclass
class DecoderOutput:
    """What the body's forward returns, as the call sites read it."""

    last_hidden_state: torch.Tensor
    cache: Any = None
    hidden_states: tuple | None = None


def _structure(body: nn.Module) -> tuple[nn.Module, ...] | None:
    """The body's modules whose hooks must be absent, or None where its structure is not one LeanDecoder computes
    exactly. Looked at anew every time: wrapping a model (PEFT, FSDP) replaces modules or their classes."""
    cfg = getattr(body, "config", None)
    if type(body).__name__ not in _SUPPORTED_BODIES or cfg is None:
        return None
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(cfg, "is_causal", True) is not True:
        return None
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"]):
        return None
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "hidden_act", None) != "silu":
        return None
    rope = getattr(cfg, "rope_parameters", None) or {}
    rotary = getattr(body, "rotary_emb", None)
    if rope.get("rope_type", "default") != "default" or rotary is None or getattr(rotary, "attention_scaling", None) != 1.0:
        return None
    layers = list(body.layers[: cfg.num_hidden_layers])
    if len(layers) != cfg.num_hidden_layers or type(body.norm).__name__ not in _SUPPORTED_NORMS:
        return None
    modules: list[nn.Module] = [body, body.norm, rotary]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(m) is not nn.Linear for m in linears) or any(type(m).__name__ not in _SUPPORTED_NORMS for m in norms):
            return None
        if type(mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
            return None
        if getattr(attn, "sliding_window", None) is not None:
            return None
        modules.extend((layer, attn, mlp, mlp.act_fn, *linears, *norms))
    return tuple(modules)


def _global_hooks() -> bool:
    from torch.nn.modules import module as m
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks or getattr(m, "_global_forward_hooks_always_called", None))


def applies(body: nn.Module) -> bool:
    """Whether LeanDecoder computes exactly what `body(...)` computes (module doc): the structure, and what can
    change between steps (hooks, activation checkpointing, dropout)."""
    modules = _structure(body)
    if modules is None or _global_hooks():
        return False
    for m in modules:
        if (any(not _inert(h) for h in m._forward_hooks.values()) or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None)):
            return False
    if body.training and getattr(body.config, "attention_dropout", 0.0):
        return False
    return not any(getattr(layer, "gradient_checkpointing", False) for layer in body.layers)


def _inert(hook: Any) -> bool:
    """Hugging Face's output-capturing hooks: installed on the layers at the first forward that captures outputs,
    they do nothing outside a capturing forward (which LeanDecoder never runs)."""
    return (getattr(hook, "__module__", "") == "transformers.utils.output_capturing"
            and getattr(hook, "__name__", "") == "output_capturing_hook")


def _past(cache: Any) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def causal_mask(attention_mask: torch.Tensor | None, q_length: int, past: int, batch: int = 1,
                device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The sdpa mask Hugging Face's create_causal_mask builds for a 2-D padding mask over the cache and the new tokens:
    None where sdpa's own causal flag (or no mask) is exact, else [B, 1, q, kv] bool = causal & the key is real
    (`batch` and `device` say where a causal mask without a padding mask goes)."""
    kv_length = past + q_length
    pad = None if attention_mask is None else attention_mask.to(dtype=torch.bool)
    device = pad.device if pad is not None else device
    # transformers.masking_utils._ignore_causal_mask_sdpa, for an untraced call without a local window
    if (q_length == 1 or kv_length == q_length) and (pad is None or bool(pad.all())):
        return None
    if past == 0 and (pad is None or (bool(pad[:, :q_length].all()) and bool((~pad[:, q_length:]).all()))):
        return None
    if pad is not None and q_length == 1:  # one query, after every key: causality masks nothing
        return pad[:, None, None, :]  # [B, 1, 1, kv]
    q_idx = (torch.arange(q_length, device=device) + past)[:, None]
    causal = (torch.arange(kv_length, device=device)[None, :] <= q_idx)[None, None]  # [1, 1, q, kv]
    return causal.expand(batch, -1, -1, -1) if pad is None else causal & pad[:, None, None, :]


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Qwen2RMSNorm.forward / LlamaRMSNorm.forward, operation for operation
    dtype = x.dtype
    if dtype != torch.float32:  # .to is a no-op in float32, skipped rather than dispatched
        x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * (x if dtype == torch.float32 else x.to(dtype))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
               scale: float, groups: int) -> torch.Tensor:
    """transformers.integrations.sdpa_attention.sdpa_attention_forward's call of sdpa, its grouped-query branches
    included (sdpa's own GQA, one query packed per key head, or the keys repeated)."""
    kwargs = {}
    if groups > 1:
        if use_gqa_in_sdpa(mask, k, v):
            kwargs["enable_gqa"] = True
        elif q.shape[2] == 1:
            q = q.reshape(q.shape[0], q.shape[1] // groups, groups, q.shape[-1])
        else:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=is_causal,
                                          **kwargs)


def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of a 2-D input, the weight transposed once a step: the addmm (mm) F.linear itself calls."""
    return torch.addmm(bias, x, weight_t) if bias is not None else torch.mm(x, weight_t)


class LeanDecoder:
    """The body's forward (module doc). Built once per training step or decoding batch (`of`): it holds the
    projections' transposed weights, views of the current parameters through which the gradient reaches them.
    Called with the arguments CodiModel, PaddedRows and the decoder give the body."""

    def __init__(self, body: nn.Module):
        self.body = body
        self.config = body.config
        self.layers = [_Layer.of(layer, body.config) for layer in body.layers[: body.config.num_hidden_layers]]

    @classmethod
    def of(cls, body: nn.Module) -> "LeanDecoder | None":
        """The lean forward of `body`, or None where it would not compute exactly what `body(...)` computes."""
        return cls(body) if applies(body) else None

    def __call__(self, *, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 cache: Any = None, use_cache: bool = False,
                 output_hidden_states: bool | Sequence[int] | None = None) -> DecoderOutput:
        body = self.body
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("LeanDecoder: give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = body.embed_tokens(input_ids)
        batch, q_length, _ = inputs_embeds.shape
        if use_cache and cache is None:
            cache = DynamicCache(config=body.config)
        past = _past(cache)
        if position_ids is None:
            position_ids = (torch.arange(q_length, device=inputs_embeds.device) + past)[None].expand(batch, -1)
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape != (batch, past + q_length)):
            raise ValueError(f"LeanDecoder: attention_mask {tuple(attention_mask.shape)}: expected the 2-D padding "
                             f"mask [{batch}, {past + q_length}] of the cache and the new tokens")
        if (attention_mask is None and cache is None and q_length > 1
                and not bool((torch.diff(position_ids, dim=-1) == 1).all())):
            raise ValueError("LeanDecoder: positions that restart (packed sequences) need an attention mask")
        mask = causal_mask(attention_mask, q_length, past, batch, inputs_embeds.device)
        is_causal = q_length > 1 and mask is None
        # Qwen2RotaryEmbedding.forward (default rope: attention_scaling 1), once a call for every layer
        freqs = position_ids[..., None].float() * body.rotary_emb.inv_freq.to(device=inputs_embeds.device,
                                                                               dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(dtype=inputs_embeds.dtype)[:, None]  # [B, 1, T, d]
        sin = emb.sin().to(dtype=inputs_embeds.dtype)[:, None]
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # rotate_half's sign, on sin
        wanted = (set(range(len(self.layers) + 1)) if output_hidden_states is True
                  else set(output_hidden_states or ()))
        states: list[torch.Tensor | None] = []
        hidden = inputs_embeds  # [B, T, H] between layers, as in the body: the same tensors take the same gradients
        for i, layer in enumerate(self.layers):
            states.append(hidden if i in wanted else None)
            hidden = layer(hidden, cos, signed_sin, mask, is_causal, cache)
        hidden = _rms_norm(body.norm, hidden)
        hidden_states = None
        if output_hidden_states:
            states.append(hidden if len(states) in wanted else None)
            hidden_states = tuple(states)
        return DecoderOutput(last_hidden_state=hidden, cache=cache if use_cache else None, hidden_states=hidden_states)


Projection = tuple[torch.Tensor, "torch.Tensor | None"]  # (transposed weight, bias)


@dataclass
class _Layer:
    """One Qwen2DecoderLayer / LlamaDecoderLayer, its projections' weights transposed for the step."""

    layer_idx: int
    head_dim: int
    heads: int
    kv_heads: int
    scaling: float
    input_norm: nn.Module
    post_norm: nn.Module
    q: Projection
    k: Projection
    v: Projection
    o: Projection
    gate: Projection
    up: Projection
    down: Projection

    @classmethod
    def of(cls, layer: nn.Module, config: Any) -> "_Layer":
        attn, mlp = layer.self_attn, layer.mlp
        return cls(attn.layer_idx, attn.head_dim, config.num_attention_heads, config.num_key_value_heads, attn.scaling,
                   layer.input_layernorm, layer.post_attention_layernorm,
                   *((m.weight.t(), m.bias) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                      mlp.gate_proj, mlp.up_proj, mlp.down_proj)))

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, mask: torch.Tensor | None,
                 is_causal: bool, cache: Any) -> torch.Tensor:
        """hidden [B, T, H] -> [B, T, H]: Qwen2DecoderLayer.forward's operations, in its order."""
        batch, q_length, _ = hidden.shape
        d, rows = self.head_dim, batch * q_length
        x = _rms_norm(self.input_norm, hidden).view(rows, -1)
        q = _linear(x, *self.q).view(batch, q_length, -1, d).transpose(1, 2)
        k = _linear(x, *self.k).view(batch, q_length, -1, d).transpose(1, 2)
        v = _linear(x, *self.v).view(batch, q_length, -1, d).transpose(1, 2)
        q = (q * cos) + (q.roll(d // 2, dims=-1) * signed_sin)  # apply_rotary_pos_emb, q then k
        k = (k * cos) + (k.roll(d // 2, dims=-1) * signed_sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = _attention(q, k, v, mask, is_causal, self.scaling, self.heads // self.kv_heads)
        out = out.reshape(batch, self.heads, q_length, d).transpose(1, 2).reshape(rows, self.heads * d)
        hidden = hidden + _linear(out, *self.o).view(batch, q_length, -1)
        x = _rms_norm(self.post_norm, hidden).view(rows, -1)
        down = _linear(F.silu(_linear(x, *self.gate)) * _linear(x, *self.up), *self.down)
        return hidden + down.view(batch, q_length, -1)
