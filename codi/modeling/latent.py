"""The latent-block primitives shared by training and decoding, and the padded batch state they run on.

    rows = PaddedRows(body, batch_size=B, device=dev)   # body = base.model (the decoder stack, no lm_head)
    last, _ = rows.step(embeds, real)                   # append a block: embeds [B, n, H], real [B, n] bool
    x = latent_input(projector, h)                      # the next latent's input embedding
    h = latent_recurrence(rows, projector, h, steps, active)   # `steps` latents in lockstep -> h [B, H]

CodiModel runs latent_recurrence; codi.evaluation.decoding feeds latent_input one position at a time. A padded row
computes exactly what it would alone (2-D mask + explicit position_ids; no fully masked attention row).
Design: docs/design/codi-model.md, "CodiModel" (PaddedRows, compaction) and "Decoding".
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import torch
from torch import nn
from transformers import DynamicCache


def build_projector(hidden_size: int, *, dtype: torch.dtype, device: torch.device | str,
                    dropout: float = 0.0) -> nn.Sequential:
    """The CODI thought projector: Linear(h,h,no bias) -> GELU -> Linear(h,h,no bias) -> LayerNorm(h), with
    dropout on its input when `dropout` > 0 (CODI's prj_dropout; active in training mode only)."""
    layers: dict[str, nn.Module] = {"0": nn.Linear(hidden_size, hidden_size, bias=False), "1": nn.GELU(),
                                    "2": nn.Linear(hidden_size, hidden_size, bias=False), "3": nn.LayerNorm(hidden_size)}
    if dropout > 0:
        # named, not numbered: the weights keep their keys ("0.weight", ...), so every saved projector loads;
        # absent at 0, where even a no-op dropout would draw random numbers and move every later draw
        layers = {"dropout": nn.Dropout(dropout), **layers}
    return nn.Sequential(OrderedDict(layers)).to(device=device, dtype=dtype)


def identity_projector_(projector: nn.Sequential) -> nn.Sequential:
    """Set both linear maps of a thought projector to the identity, in place (no random draw: a run's later draws
    are those of the default init). The latent then starts as LayerNorm(GELU(h)) of the last hidden state h."""
    with torch.no_grad():
        for name in ("0", "2"):
            weight = projector.get_submodule(name).weight
            weight.copy_(torch.eye(*weight.shape, dtype=weight.dtype, device=weight.device))
    return projector


def detached_cache(cache: DynamicCache | None) -> DynamicCache | None:
    """A new cache holding detached views of `cache`'s keys/values (no copy; the original is untouched)."""
    if cache is None:
        return None
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.detach(), layer.values.detach(), i)
    return out


class PaddedRows:
    """Batched incremental state over a decoder body: shared KV slots, a padding mask, per-row positions.

    `body` is the decoder stack (`base.model` for Qwen2/Llama): called with inputs_embeds, it returns
    `last_hidden_state` (post final norm) and the grown cache."""

    def __init__(self, body: nn.Module, batch_size: int, device: torch.device | str):
        self.body = body
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)  # [B, S] True = real
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # [B]

    @classmethod
    def after_prefix(cls, body: nn.Module, cache: DynamicCache, lengths: torch.Tensor) -> "PaddedRows":
        """Rows that continue a prefix already in `cache`: row b's first lengths[b] slots are real (a right-padded
        batch's keys and values, e.g. the teacher's), the rest padding, and its next position is lengths[b]."""
        rows = cls(body, len(lengths), lengths.device)
        rows.cache = cache
        rows.mask = torch.arange(int(lengths.max()), device=lengths.device)[None] < lengths[:, None]
        rows.next_pos = lengths
        return rows

    @property
    def length(self) -> int:
        """Slots in the cache (padding included)."""
        return self.mask.shape[1]

    def _inputs(self, embeds: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if embeds.dim() != 3 or embeds.shape[0] != self.batch_size or real.shape != embeds.shape[:2]:
            raise ValueError(f"PaddedRows.step: embeds {tuple(embeds.shape)} and real {tuple(real.shape)} "
                             f"must be [B={self.batch_size}, n, H] and [B, n]")
        real = real.to(device=self.device, dtype=torch.bool)
        if self.length == 0 and not bool(real[:, 0].all()):
            # A row whose first slot is padding would have a fully masked attention row (NaN).
            raise ValueError("PaddedRows.step: the first block must start with a real token in every row")
        mask = torch.cat([self.mask, real], dim=1)  # [B, S + n]
        # Position of a real token = real tokens before it in its row; padding gets the next one (unused).
        pos = self.next_pos[:, None] + real.long().cumsum(1) - real.long()  # [B, n]
        return mask, pos

    def step(self, embeds: torch.Tensor, real: torch.Tensor,
             hidden_layers: Sequence[int] | None = None) -> tuple[torch.Tensor, tuple | None]:
        """Append a block. Returns (last_hidden_state [B, n, H], hidden_states tuple or None).

        `hidden_layers` (non-negative indices into HF `hidden_states`) asks for those layers only; the
        other entries of the returned tuple are None."""
        mask, pos = self._inputs(embeds, real)
        out = self.body(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, cache=self.cache,
                        use_cache=True, output_hidden_states=list(hidden_layers) if hidden_layers else None)
        self.cache, self.mask = out.cache, mask
        self.next_pos = self.next_pos + real.to(self.device).long().sum(1)
        return out.last_hidden_state, (out.hidden_states if hidden_layers else None)

    def compact(self, min_saving: float = 0.1) -> bool:
        """Move each row's real slots to the front of the cache and drop the slots that are then
        padding in every row, when that shortens the cache by at least `min_saving`; True if done.

        Exact: keys already carry their rotary phase and the mask follows them, so attention sees the
        same keys and values; the real slots keep their order, so causality is unchanged. Shortens
        every later call's attention (and the keys/values it saves for backward)."""
        counts = self.mask.sum(1)  # [B]
        width = int(counts.max())
        if self.cache is None or width > (1.0 - min_saving) * self.length:
            return False
        # Stable sort of "is padding" puts each row's real slots first, in their order.
        order = torch.sort((~self.mask).to(torch.uint8), dim=1, stable=True).indices[:, :width]  # [B, W']
        for layer in self.cache.layers:
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.mask = torch.arange(width, device=self.device)[None] < counts[:, None]
        return True

    @torch.no_grad()
    def peek(self, embeds: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """last_hidden_state [B, n, H] of a block run on a detached copy of the cache, without grad and
        without changing this state (scheduled sampling's look-ahead)."""
        mask, pos = self._inputs(embeds, real)
        out = self.body(inputs_embeds=embeds.detach(), attention_mask=mask, position_ids=pos,
                        cache=detached_cache(self.cache), use_cache=True)
        return out.last_hidden_state


def latent_input(projector: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """The input embedding of the next latent: projector(post-norm hidden at the position before it), computed
    in the projector's dtype and returned in the hidden's. Training and the latent decoder both call it."""
    params = list(projector.parameters()) if isinstance(projector, nn.Module) else []
    dtype = params[0].dtype if params else hidden.dtype
    return projector(hidden.to(dtype)).to(hidden.dtype)


def latent_recurrence(rows: PaddedRows, projector: nn.Module, h: torch.Tensor, steps: int,
                      active: torch.Tensor, inputs: list[torch.Tensor] | None = None,
                      outputs: list[torch.Tensor] | None = None, last_layers: Sequence[int] | None = None,
                      last_states: list[tuple] | None = None, states_from: int | None = None,
                      feedback: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      feedback_from: int = 0) -> torch.Tensor:
    """Run `steps` recurrent latents: each step feeds projector(h) and takes the new post-norm hidden.

    h: [B, H], the last hidden of the position before the first latent (latent_start's). active: [B]
    bool; inactive rows get a padding slot (zero input, masked) and keep their h. Returns h [B, H].
    `inputs`, when given, receives each step's latent input [B, H] (zero for inactive rows); `outputs` each
    step's new h; `last_states` the hidden_states tuple of the last step's call, with `last_layers` asked for (of
    every step from `states_from` on, when given). `feedback(h)` [B, H], when given, is added to the input of every
    step from `feedback_from` on (codi.value_feedback for the frames of a multi-frame block)."""
    active = active.to(device=rows.device, dtype=torch.bool)
    first_state = steps - 1 if states_from is None else states_from
    for step in range(steps):
        x = latent_input(projector, h)
        if feedback is not None and step >= feedback_from:
            x = x + feedback(h)
        x = torch.where(active[:, None], x, torch.zeros((), dtype=h.dtype, device=h.device))
        if inputs is not None:
            inputs.append(x)
        final = step >= first_state and last_states is not None
        last, hs = rows.step(x[:, None], active[:, None], hidden_layers=last_layers if final else None)
        if final:
            last_states.append(hs)
        h = torch.where(active[:, None], last[:, 0], h)
        if outputs is not None:
            outputs.append(h)
    return h


def value_feedback(head: nn.Module, embedding: torch.Tensor, hidden: torch.Tensor, mode: str) -> torch.Tensor:
    """codi.value_feedback: the embedding of the value slot's prediction, added to the last latent's input.

    hidden [B, H] (the value slot's post-norm hidden) -> [B, H] in hidden's dtype: soft = softmax(head(hidden))
    @ embedding; hard = the argmax row of `embedding`, with the soft one's gradient (straight-through)."""
    probs = torch.softmax(head(hidden).float(), dim=-1)  # [B, V]
    weight = embedding.float()[:probs.shape[-1]]
    if mode == "soft":
        return (probs @ weight).to(hidden.dtype)
    if mode == "hard":
        hard = torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).to(probs.dtype)
        return ((hard + probs - probs.detach()) @ weight).to(hidden.dtype)
    raise ValueError(f"value_feedback: expected 'soft' or 'hard', got {mode!r}")
