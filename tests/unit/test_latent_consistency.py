"""Training and evaluation compute the same latent block: the latent decoder (codi.evaluation.decoding, one position
at a time), the training recurrence in lockstep (tests.codi_oracle.latent_block over codi.modeling's
PaddedRows + latent_recurrence) and the reference's per-example block (the oracle) give the same latent_end
hidden state, hence the same prediction after the block."""

from __future__ import annotations

import torch
from torch import nn

from codi.evaluation.decoding import decode
from codi.modeling import PaddedRows
from codi.tracing.tokens import token_ids
from tests.codi_oracle import _latent_block as oracle_block
from tests.codi_oracle import codi_model, latent_block
from tests.unit.test_decoding import _encode, _model, _tokenizer


class ScriptedHead(nn.Module):
    """An lm_head that makes the decoder emit `script` whatever the hidden state, recording the hidden
    states it is shown (the body and the projector still compute for real)."""

    def __init__(self, real: nn.Module, script: list[int], vocab: int):
        super().__init__()
        self.real, self.script, self.vocab, self.seen = real, list(script), vocab, []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.seen.append(h.detach().clone())
        out = torch.full((h.shape[0], self.vocab), -1e4)
        out[:, self.script.pop(0)] = 0.0
        return out


def test_decoder_training_primitive_and_reference_agree_on_the_latent_block():
    torch.manual_seed(0)
    tok = _tokenizer()
    ids = token_ids(tok)
    for latent_steps in (1, 3):
        base = _model(tok, seed=latent_steps)
        codi = codi_model(base, ids, latent_steps).eval()
        prompt = _encode(tok, "<|trace_context_start|>def f(a):\n    b = a + 1\n    return b\n\n# call: f(2)\n<|frame_sep|>")
        prefix = _encode(tok, '<|call_sep|>{"a": "2"}<|action_sep|>def f(a):\n<|frame_sep|><|line_sep|>')
        real_head = base.lm_head
        script = prefix + [ids.action_sep, ids.eos]
        base.lm_head = ScriptedHead(real_head, script, len(tok))
        try:
            [res] = decode("latent", base, tok, [prompt], projector=codi.projector, latent_steps=latent_steps,
                           max_new_tokens=200, max_frames=10)
            decoder_h = base.lm_head.seen[len(prefix)][0]  # the hidden shown after the block: latent_end's
        finally:
            base.lm_head = real_head
        assert res.latent_blocks == 1 and res.positions == len(prefix) + latent_steps + 2 + 2

        with torch.no_grad():
            full = torch.tensor([prompt + prefix])
            out = base.model(input_ids=full, use_cache=True)
            ref_logits = oracle_block(codi, out.cache)[1][0]
            rows = PaddedRows(base.model, batch_size=1, device="cpu")
            rows.step(base.get_input_embeddings()(full), torch.ones_like(full, dtype=torch.bool))
            train_h = latent_block(rows, codi.projector, base.get_input_embeddings(), ids.latent_start,
                                   ids.latent_end, latent_steps, torch.tensor([True]), ids.pad)[0]
            torch.testing.assert_close(train_h, decoder_h, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(real_head(decoder_h), ref_logits, rtol=1e-5, atol=1e-5)
