"""The student's first round from the teacher's keys and values of the shared prefix (CodiModel._reuses_prefix):
the same losses and gradients as the student computing the prefix itself, fewer tokens through the model, and
the cases where reuse would not be exact (checkpointed teacher, frozen teacher, active dropout) fall back."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.codi_oracle import TOKEN_IDS, batch_with_values, codi_model, tiny_base  # noqa: E402

torch.set_num_threads(1)
W = dict(teacher_ce_weight=1.0, student_ce_weight=1.0, kd_weight=1.0)
VALUES = dict(value_weight=1.0, value_feedback="soft", value_kd_weight=1.0)  # the default's value terms
KEYS = ("loss", "teacher_loss", "student_loss", "kd_loss", "recon_loss", "value_loss", "value_kd_loss")


def batch(seed=0, frames=(1, 3, 2, 4)):
    return batch_with_values(frames, seed)


def counted(model):
    """A list receiving the [batch, tokens] shape of every call of the model's body."""
    shapes = []

    def hook(module, args, kwargs, output):
        x = kwargs.get("inputs_embeds") if kwargs.get("inputs_embeds") is not None else kwargs.get("input_ids")
        shapes.append(tuple(x.shape[:2]))

    model.body.register_forward_hook(hook, with_kwargs=True)
    return shapes


def step(model, examples, **kw):
    model.zero_grad(set_to_none=True)
    out = model(examples, **kw)
    out["loss"].backward()
    return ({k: float(out[k].detach()) for k in KEYS},
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def pair(latent_steps=2, **options):
    torch.manual_seed(0)
    own = codi_model(tiny_base(), TOKEN_IDS, latent_steps, **W, **options)
    own.reuse_prefix = False
    torch.manual_seed(0)
    reuse = codi_model(tiny_base(), TOKEN_IDS, latent_steps, **W, **options)
    reuse.load_state_dict(own.state_dict())
    return own, reuse


def assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    for k in KEYS:
        assert abs(la[k] - lb[k]) <= 1e-6 * abs(la[k]) + 1e-7, f"{k}: {la[k]!r} vs {lb[k]!r}"
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        scale = float(ga[name].abs().max())
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-5 * scale + 1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("latent_steps", [1, 2, 3])
def test_reuse_equals_the_student_computing_its_prefix(latent_steps):
    options = VALUES if latent_steps >= 2 else {}
    own, reuse = pair(latent_steps, **options)
    shapes = counted(reuse)
    examples = batch()
    assert reuse._reuses_prefix() and not own._reuses_prefix()
    assert_same(step(own, examples), step(reuse, examples))
    # The student's first call runs one slot (each row's <|latent_start|>), not the prompt and trace before it.
    assert shapes[1] == (len(examples), 1)


@pytest.mark.parametrize("kw", [dict(latent_share=0.5), dict(latent_share=0.0), dict(ss_prob=1.0)])
def test_reuse_under_the_curriculum_and_scheduled_sampling(kw):
    """Rows without a latent frame (their round 0 is the whole trace) and sampled student inputs."""
    own, reuse = pair(2, **VALUES)
    examples = batch(seed=3, frames=(2, 1, 4))
    extra = {"ss_rng": random.Random(5)} if "ss_prob" in kw else {}
    a = step(own, examples, **kw, **extra)
    extra = {"ss_rng": random.Random(5)} if "ss_prob" in kw else {}
    assert_same(a, step(reuse, examples, **kw, **extra))


def test_reuse_with_reconstruction_and_line_anchors():
    own, reuse = pair(2, recon_weight=0.5, kd_positions="action_line", kd_norm="teacher_std")
    examples = batch(seed=4)
    assert_same(step(own, examples), step(reuse, examples))


def test_where_reuse_would_not_be_exact_the_student_computes_its_prefix():
    examples = batch()
    checkpointed = codi_model(tiny_base(), TOKEN_IDS, 2, teacher_checkpointing=True, **W)
    assert not checkpointed._reuses_prefix()  # a checkpointed layer keeps no cache
    with torch.no_grad():  # no backward to replay: the checkpointed teacher may share
        assert checkpointed._reuses_prefix()
    frozen = codi_model(tiny_base(), TOKEN_IDS, 2, frozen_teacher=tiny_base(seed=5), **W)
    assert not frozen._reuses_prefix()  # other weights
    dropout = codi_model(tiny_base(), TOKEN_IDS, 2, **W)
    dropout.model.config.attention_dropout = 0.1
    assert not dropout._reuses_prefix()  # the student must draw its own mask
    dropout.eval()
    assert dropout._reuses_prefix()
    shapes = counted(checkpointed)
    checkpointed(examples)["loss"].backward()
    assert shapes[1][1] > 1  # round 0: the prompt and the trace up to the first latent block
