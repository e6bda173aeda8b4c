"""The batched CodiModel equals the per-example oracle (tests/codi_oracle.py, the reference design):
loss and every sub-loss to 1e-5 relative, every gradient of base + projector to 1e-4."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.codi_oracle` without a conftest

from tests.codi_oracle import TOKEN_IDS, codi_model, make_example, oracle_forward, tiny_base  # noqa: E402

torch.set_num_threads(1)
LOSS_KEYS = ("loss", "teacher_loss", "student_loss", "kd_loss", "recon_loss")


def build(latent_steps=1, teacher=None, attn="sdpa", **kw):
    opts = dict(teacher_ce_weight=1.0, student_ce_weight=1.0, kd_weight=1.0)
    opts.update(kw)
    return codi_model(tiny_base(attn=attn), TOKEN_IDS, latent_steps, frozen_teacher=teacher, **opts)


def mixed_batch(seed=0, frames=(1, 3, 2, 4)):
    rng = random.Random(seed)
    return [make_example(rng, n) for n in frames]


def edge_batch(seed=1):
    rng = random.Random(seed)
    one_frame = make_example(rng, 1)
    back_to_back = make_example(rng, 4, other_frames=False)
    one_token_locals = make_example(rng, 3, locals_len=(1, 1), code_len=(1, 2))
    long_prompt = make_example(rng, 2, prompt_len=(80, 80))
    # A trace that opens with a LINE frame (span at i = 0) and a two-token segment between spans.
    t = TOKEN_IDS
    starts_with_line = {"prompt_ids": [t.trace_context_start, 20, 21, t.frame_sep],
                        "trace_ids": [t.line_sep, 30, t.action_sep, t.line_sep, 31, 32, t.action_sep, 40, t.eos],
                        "spans": [(0, 2), (3, 6)]}
    return [one_frame, back_to_back, one_token_locals, long_prompt, starts_with_line]


def grads(model):
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}


def run(fn, model):
    model.zero_grad(set_to_none=True)
    out = fn()
    out["loss"].backward()
    return {k: out[k].detach() for k in LOSS_KEYS}, grads(model)


def assert_equal_to_oracle(model, examples, ss_prob=0.0, seed=7, rng_kind="random", latent_share=1.0,
                           oracle_examples=None):
    """`oracle_examples`: what the oracle reads instead of `examples` (the same examples in its own contract)."""
    def rng():
        if rng_kind == "torch":
            return torch.Generator().manual_seed(seed)
        return random.Random(seed)

    o_out, o_grads = run(lambda: oracle_forward(model, oracle_examples or examples, ss_prob, rng(),
                                                latent_share=latent_share), model)
    b_out, b_grads = run(lambda: model(examples, ss_prob=ss_prob, ss_rng=rng(), latent_share=latent_share), model)
    for k in LOSS_KEYS:
        o, b = float(o_out[k]), float(b_out[k])
        # 1e-5 relative, with a 1e-6 absolute floor: a KD loss is a small difference of O(1) hiddens, so
        # fp32 rounding of the hiddens (~1e-6, from different matmul shapes) can exceed 1e-5 of it.
        assert abs(b - o) <= 1e-5 * abs(o) + 1e-6, f"{k}: batched {b!r} vs oracle {o!r}"
    assert o_grads.keys() == b_grads.keys()
    n_checked = 0
    for name in o_grads:
        go, gb = o_grads[name], b_grads[name]
        assert (go is None) == (gb is None), f"{name}: grad present in only one of oracle/batched"
        if go is None:
            continue
        scale = float(go.abs().max())
        torch.testing.assert_close(gb, go, rtol=1e-4, atol=1e-4 * scale + 1e-12, msg=lambda m: f"{name}: {m}")
        assert float((gb - go).norm()) <= 1e-4 * float(go.norm()) + 1e-12, name
        n_checked += 1
    assert n_checked > 0
    return o_out


OPTIONS = {
    "default": {},
    "kd_layers_explicit": dict(kd_layers=[0, 2]),
    "kd_layers_negative": dict(kd_layers=[-2, -1]),
    "single_anchor": dict(single_anchor=True),
    "logit_shared": dict(kd_target="logit", kd_temp=1.5),
    "weights": dict(teacher_ce_weight=0.5, student_ce_weight=2.0, kd_weight=3.0),
}


@pytest.mark.parametrize("latent_steps", [1, 3])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_options_match_oracle(option, latent_steps):
    model = build(latent_steps, **OPTIONS[option])
    out = assert_equal_to_oracle(model, mixed_batch())
    assert float(out["kd_loss"]) > 0 and float(out["teacher_loss"]) > 0


FROZEN = {
    "hidden_default": dict(),
    "hidden_explicit": dict(kd_layers=[1, -1]),
    "logit": dict(kd_target="logit"),
}


@pytest.mark.parametrize("latent_steps", [1, 3])
@pytest.mark.parametrize("option", sorted(FROZEN))
def test_frozen_teacher_matches_oracle(option, latent_steps):
    # A deeper teacher: negative kd_layers resolve against each model's own depth.
    teacher = tiny_base(seed=5, layers=3)
    model = build(latent_steps, teacher=teacher, **FROZEN[option])
    out = assert_equal_to_oracle(model, mixed_batch(seed=2))
    assert float(out["teacher_loss"]) == 0.0
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("latent_steps", [1, 3])
@pytest.mark.parametrize("ss_prob,rng_kind", [(1.0, "random"), (0.5, "random"), (0.5, "torch")])
def test_scheduled_sampling_matches_oracle(ss_prob, rng_kind, latent_steps):
    model = build(latent_steps)
    examples = mixed_batch(seed=3, frames=(2, 4, 1, 3))
    with_ss = assert_equal_to_oracle(model, examples, ss_prob=ss_prob, rng_kind=rng_kind)
    without = model(examples)
    # Sampling changed the student's inputs (so the test exercises it), never the teacher.
    assert float(with_ss["student_loss"]) != float(without["student_loss"])
    assert float(with_ss["teacher_loss"]) == pytest.approx(float(without["teacher_loss"]), rel=1e-6)


@pytest.mark.parametrize("latent_steps", [1, 3])
def test_span_edge_cases_match_oracle(latent_steps):
    model = build(latent_steps)
    assert_equal_to_oracle(model, edge_batch())
    assert_equal_to_oracle(model, edge_batch(), ss_prob=1.0)


def test_eager_attention_matches_oracle():
    assert_equal_to_oracle(build(2, attn="eager"), edge_batch(seed=4))


def test_single_example_batch_matches_oracle():
    assert_equal_to_oracle(build(1, single_anchor=True, kd_layers=[-1]), mixed_batch(frames=(3,)))


# ------------------------------------------------------------------ options beyond the reference
NEW_OPTIONS = {
    "kd_norm": dict(kd_norm="teacher_std"),
    "kd_norm_layers": dict(kd_norm="teacher_std", kd_layers=[0, -1]),
    "action_line": dict(kd_positions="action_line"),
    "action_line_single_anchor": dict(kd_positions="action_line", single_anchor=True),
    "action_line_logit": dict(kd_positions="action_line", kd_target="logit"),
    "recon_shared": dict(recon_weight=0.7),
    "recon_copy": dict(recon_weight=0.7, recon_decoder="copy"),
    "all": dict(kd_norm="teacher_std", kd_positions="action_line", recon_weight=0.5, recon_decoder="copy"),
}


@pytest.mark.parametrize("latent_steps", [1, 3])
@pytest.mark.parametrize("option", sorted(NEW_OPTIONS))
def test_new_options_match_oracle(option, latent_steps):
    model = build(latent_steps, **NEW_OPTIONS[option])
    out = assert_equal_to_oracle(model, mixed_batch())
    assert float(out["kd_loss"]) > 0
    assert (float(out["recon_loss"]) > 0) == (model.options.recon_weight > 0)


def test_the_options_change_the_loss_they_name():
    examples = mixed_batch()
    ref = build(1)(examples)
    assert float(build(1, kd_norm="teacher_std")(examples)["kd_loss"]) != pytest.approx(float(ref["kd_loss"]))
    assert float(build(1, kd_positions="action_line")(examples)["kd_loss"]) != pytest.approx(float(ref["kd_loss"]))
    with_recon = build(1, recon_weight=2.0)(examples)
    assert float(with_recon["loss"].detach()) == pytest.approx(
        float(ref["loss"].detach()) + 2.0 * float(with_recon["recon_loss"]), rel=1e-6)


@pytest.mark.parametrize("share", [0.0, 0.3, 0.5, 0.8])
def test_latent_curriculum_share_matches_oracle(share):
    model = build(2, recon_weight=0.5, kd_positions="action_line")
    out = assert_equal_to_oracle(model, mixed_batch(seed=5, frames=(1, 3, 2, 4)), latent_share=share)
    if share == 0.0:  # every frame explicit: no KD anchor, no latent, the student reads the whole trace
        assert float(out["kd_loss"]) == 0.0 and float(out["recon_loss"]) == 0.0


def test_latent_curriculum_with_scheduled_sampling_and_frozen_teacher_matches_oracle():
    model = build(1, teacher=tiny_base(seed=5, layers=3), kd_norm="teacher_std", recon_weight=0.3,
                  recon_decoder="copy")
    assert_equal_to_oracle(model, mixed_batch(seed=6, frames=(2, 4, 1, 3)), ss_prob=0.6, latent_share=0.6)


def test_a_share_of_zero_is_the_explicit_student():
    # No latent frame: the student's CE equals the teacher's (both read prompt + the whole trace).
    model = build(1)
    out = model(mixed_batch(), latent_share=0.0)
    assert float(out["student_loss"]) == pytest.approx(float(out["teacher_loss"]), rel=1e-5)


# ------------------------------------------------------------------------------------ slow grid
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("latent_steps", [0, 1, 2, 3])
def test_grid_matches_oracle(seed, latent_steps):
    rng = random.Random(100 + seed)
    frames = [rng.randint(1, 6) for _ in range(rng.randint(2, 6))]
    examples = [make_example(rng, n, locals_len=(1, 8), code_len=(1, 8)) for n in frames]
    for kw in ({}, dict(kd_layers=[-1], single_anchor=True), dict(kd_target="logit")):
        assert_equal_to_oracle(build(latent_steps, **kw), examples)
    for kw in ({}, dict(kd_layers=[-1], single_anchor=True)):  # every new option at once, on the same grid
        kw = dict(kw, kd_norm="teacher_std", kd_positions="action_line",
                  **(dict(recon_weight=0.5, recon_decoder=("copy" if seed % 2 else "shared")) if latent_steps else {}))
        assert_equal_to_oracle(build(latent_steps, **kw), examples, latent_share=rng.choice([0.4, 0.7, 1.0]))
        assert_equal_to_oracle(build(latent_steps, **kw), examples, ss_prob=0.5, seed=seed, latent_share=0.5)
    assert_equal_to_oracle(build(latent_steps, teacher=tiny_base(seed=9), kd_target="logit"), examples)
    assert_equal_to_oracle(build(latent_steps), examples, ss_prob=0.7, seed=seed)


@pytest.mark.parametrize("latent_steps", [1, 3])
def test_a_checkpointed_teacher_matches_oracle(latent_steps):
    """codi.gradient_checkpointing: the teacher recomputed in backward, the student computing the shared prefix
    itself (no reuse: a checkpointed layer keeps no cache). The other tests run the default, which reuses it."""
    model = build(latent_steps, teacher_checkpointing=True, kd_norm="teacher_std")
    assert not model._reuses_prefix()
    assert_equal_to_oracle(model, mixed_batch(seed=8))
    assert_equal_to_oracle(model, edge_batch(), ss_prob=1.0)
