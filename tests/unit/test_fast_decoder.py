"""LeanDecoder (codi.modeling.fast_decoder) computes exactly what the decoder body computes, outputs and gradients bit
for bit, in every kind of call a codi step and a decoder make (teacher pass, padded rounds over a cache, hidden
states asked for, compaction, left-padded prefill, grouped-query heads, no biases); where it would not be exact (hooks,
checkpointing, other attention, wrapped projections, dropout) the body runs."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from codi.evaluation.decoding import decoding_cache  # noqa: E402
from codi.modeling.fast_decoder import LeanDecoder, applies, causal_mask  # noqa: E402
from codi.modeling.latent import PaddedRows  # noqa: E402
from codi.modeling.model import activation_checkpointing  # noqa: E402
from tests.codi_oracle import TOKEN_IDS, batch_with_values, codi_model, tiny_base  # noqa: E402

torch.set_num_threads(1)


def llama_base(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=512, attn_implementation="sdpa",
                      pad_token_id=TOKEN_IDS.pad)
    return LlamaForCausalLM(cfg).train()


BASES = {"qwen2 gqa": lambda: tiny_base(seed=1), "qwen2 mha": lambda: tiny_base(seed=2, kv_heads=4),
         "llama, no biases": lambda: llama_base(seed=3)}


def codi_like_calls(run, body) -> list[torch.Tensor]:
    """A teacher pass (right padding, no mask, its cache and a hidden layer kept), then rounds continuing rows of
    different prefix lengths over that cache: single- and multi-slot blocks, idle rows, a hidden layer asked for,
    a compaction. Every output, in order."""
    gen = torch.Generator().manual_seed(0)
    n, width, h = 4, 12, body.config.hidden_size
    ids = torch.randint(5, 90, (n, width), generator=gen)
    pos = torch.arange(width).expand(n, width)
    out = run(input_ids=ids, position_ids=pos, use_cache=True, output_hidden_states=[1])
    outputs = [out.last_hidden_state, out.hidden_states[1]]
    rows = PaddedRows.after_prefix(run, out.cache, torch.tensor([12, 7, 9, 4]))
    for k, (slots, idle) in enumerate([(1, None), (5, 2), (1, 0), (3, None), (1, 3), (4, 1)]):
        real = torch.ones(n, slots, dtype=torch.bool)
        real[:, slots - 1] = torch.arange(n) != 1  # a row ends a slot early
        if idle is not None:
            real[idle] = False
        embeds = torch.randn(n, slots, h, generator=gen)
        last, hs = rows.step(embeds, real, hidden_layers=[2] if k == 3 else None)
        outputs.append(last)
        if hs is not None:
            outputs.append(hs[2])
        if k == 2:
            rows.compact(min_saving=0.0)
    return outputs


@pytest.mark.parametrize("name", list(BASES))
def test_codi_calls_equal_the_body_outputs_and_gradients(name):
    base = BASES[name]()
    body = base.model
    assert applies(body)
    results = []
    for lean in (False, True):
        base.zero_grad(set_to_none=True)
        run = LeanDecoder(body) if lean else body
        outputs = codi_like_calls(run, body)
        sum((o.float() ** 2).mean() for o in outputs).backward()
        results.append((outputs, {k: p.grad.clone() for k, p in base.named_parameters() if p.grad is not None}))
    (ref_out, ref_grad), (out, grad) = results
    assert len(ref_out) == len(out) == 9
    for a, b in zip(out, ref_out):
        assert torch.equal(a, b)
    assert ref_grad.keys() == grad.keys() and len(grad) > 10
    for key in ref_grad:
        assert torch.equal(grad[key], ref_grad[key]), key


@pytest.mark.parametrize("name", ["qwen2 gqa", "qwen2 mha"])
def test_decoding_calls_equal_the_body(name):
    """evaluate's decoder: a left-padded prefill (a padding mask at an empty cache) and one-token steps on its
    growing cache, without grad."""
    base = BASES[name]().eval()
    body = base.model
    gen = torch.Generator().manual_seed(1)
    lengths = [6, 3, 5]
    mask = torch.zeros(3, 6, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, 6 - n:] = 1
    ids = torch.randint(5, 90, (3, 6), generator=gen)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    steps = [torch.randn(3, 1, body.config.hidden_size, generator=gen) for _ in range(4)]
    results = []
    with torch.no_grad():
        for run in (body, LeanDecoder(body)):
            cache, m, nxt = decoding_cache(base), mask, mask.sum(1)
            outs = [run(input_ids=ids, attention_mask=m, position_ids=positions, cache=cache, use_cache=True)
                    .last_hidden_state]
            for x in steps:
                m = torch.cat([m, m.new_ones(3, 1)], dim=1)
                outs.append(run(inputs_embeds=x, attention_mask=m, position_ids=nxt[:, None], cache=cache,
                                use_cache=True).last_hidden_state)
                nxt = nxt + 1
            results.append(outs)
    for a, b in zip(results[1], results[0]):
        assert torch.equal(a, b)


def test_the_mask_is_what_sdpa_needs():
    """None where sdpa's causal flag (or nothing) is exact; else causal and the key real."""
    pad = torch.tensor([[True, True, False, True], [True, True, True, True]])
    assert causal_mask(None, 4, 0) is None
    assert causal_mask(torch.ones(2, 5, dtype=torch.bool), 1, 4) is None
    one = causal_mask(pad, 1, 3)
    assert one.shape == (2, 1, 1, 4) and one[0, 0, 0].tolist() == [True, True, False, True]
    block = causal_mask(pad, 2, 2)
    assert block.shape == (2, 1, 2, 4)
    assert block[0, 0].tolist() == [[True, True, False, False], [True, True, False, True]]
    assert block[1, 0].tolist() == [[True, True, True, False], [True, True, True, True]]


def test_a_cache_without_a_padding_mask_equals_the_body():
    """A block over a cache with no mask given: the causal mask alone, offset by the cache."""
    base = tiny_base(seed=6)
    body = base.model
    ids = torch.randint(5, 90, (2, 9), generator=torch.Generator().manual_seed(2))
    outs = []
    for run in (body, LeanDecoder(body)):
        first = run(input_ids=ids[:, :5], position_ids=torch.arange(5).expand(2, 5), use_cache=True)
        outs.append(run(input_ids=ids[:, 5:], position_ids=torch.arange(5, 9).expand(2, 4), cache=first.cache,
                        use_cache=True).last_hidden_state)
    assert torch.equal(outs[0], outs[1])


def test_a_projection_wrapped_after_a_first_step_turns_it_off():
    """An adapter library wraps the projections of a model that has already run: the next step sees it."""
    body = tiny_base().model
    assert applies(body)
    old = body.layers[0].self_attn.v_proj
    body.layers[0].self_attn.v_proj = _WrappedLinear(old.in_features, old.out_features)
    assert not applies(body)


def test_a_mask_of_the_wrong_length_is_an_error():
    body = tiny_base().model
    with pytest.raises(ValueError, match=r"attention_mask \(2, 3\).*\[2, 4\]"):
        LeanDecoder(body)(inputs_embeds=torch.zeros(2, 4, 32), attention_mask=torch.ones(2, 3, dtype=torch.bool),
                           position_ids=torch.arange(4).expand(2, 4))


def test_hugging_face_output_hooks_do_not_turn_it_off():
    """transformers installs inert output-capturing hooks at the first forward that asks for hidden states."""
    body = tiny_base().model
    body(input_ids=torch.tensor([[5, 6, 7]]), output_hidden_states=[1])
    assert any(layer._forward_hooks for layer in body.layers)
    assert applies(body)


class _WrappedLinear(nn.Linear):
    """What an adapter library puts in a projection's place: not a plain Linear."""


@pytest.mark.parametrize("change", ["user hook", "checkpointing", "eager attention", "wrapped projection",
                                    "attention dropout", "sliding window"])
def test_where_it_would_not_be_exact_the_body_runs(change):
    base = tiny_base(attn="eager") if change == "eager attention" else tiny_base()
    if change == "sliding window":
        base = tiny_base()
        base.model.config.use_sliding_window = True
    body = base.model
    if change == "user hook":
        body.layers[0].mlp.register_forward_hook(lambda *a: None)
    if change == "wrapped projection":
        old = body.layers[1].self_attn.q_proj
        body.layers[1].self_attn.q_proj = _WrappedLinear(old.in_features, old.out_features)
    if change == "attention dropout":
        body.config.attention_dropout = 0.1
    if change == "checkpointing":
        with activation_checkpointing(base, True):
            assert not applies(body)
        assert applies(body)
        return
    assert not applies(body)
    assert LeanDecoder.of(body) is None
    model = codi_model(base, TOKEN_IDS, 2)
    assert model.decoder() is model.body


STEPS = {"the default's value terms": dict(value_weight=1.0, value_feedback="soft", value_kd_weight=1.0),
         "multi-frame blocks, reconstruction": dict(latent_unit="frame", frames_per_block=2, recon_weight=0.5),
         "checkpointed teacher, scheduled sampling": dict(teacher_checkpointing=True, ss_prob=0.5),
         "frozen teacher, logit KD, a copy decoder": dict(frozen_teacher=True, kd_target="logit", recon_weight=0.5,
                                                          recon_decoder="copy")}


@pytest.mark.parametrize("name", list(STEPS))
def test_codi_model_losses_and_gradients_equal_the_body_s(name):
    """CodiModel's whole step (teacher, prefix reuse, rounds, reconstruction) with LeanDecoder against the body's own
    forward: the same losses and gradients, bit for bit."""
    options = dict(STEPS[name])
    examples = batch_with_values((1, 3, 2, 4), seed=3)
    latent_steps = 3 if options.get("frames_per_block") else 2
    ss_prob = options.pop("ss_prob", 0.0)
    if options.pop("frozen_teacher", False):
        options["frozen_teacher"] = tiny_base(seed=9)
    runs = []
    for lean in (False, True):
        model = codi_model(tiny_base(seed=4), TOKEN_IDS, latent_steps, **options)
        model.lean_decoder = lean
        assert isinstance(model.decoder(), LeanDecoder) == lean
        out = model(examples, ss_prob=ss_prob, ss_rng=random.Random(0))
        out["loss"].backward()
        runs.append((out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (ref, ref_grad), (out, grad) = runs
    for key in ("loss", "teacher_loss", "student_loss", "kd_loss", "recon_loss", "value_loss", "value_kd_loss"):
        assert torch.equal(out[key], ref[key]), key
    assert ref_grad.keys() == grad.keys()
    for key in ref_grad:
        assert torch.equal(grad[key], ref_grad[key]), key
