"""codi.latent_unit frame (research VI): a latent block stands for a LINE frame's locals and its executed line.

The batched CodiModel in the frame unit equals the reference design (tests/codi_oracle.py) run on the same
examples with each latent span widened to end at its frame's `<|frame_sep|>`: the oracle resumes the text at a
span's end, so the widened spans are exactly the frame unit's contract. Decoding and parsing: test_decoding.py."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.codi_oracle` without a conftest

from codi.infra.config import ConfigError  # noqa: E402
from codi.modeling import plan_example  # noqa: E402
from tests.codi_oracle import TOKEN_IDS, batch_with_values, codi_model, make_example, tiny_base  # noqa: E402
from tests.unit.test_modeling_equivalence import assert_equal_to_oracle, edge_batch, mixed_batch  # noqa: E402

torch.set_num_threads(1)
T = TOKEN_IDS


def frame_end(trace, j):
    """Index of the `<|frame_sep|>` closing the LINE frame whose `<|action_sep|>` is trace[j], or None."""
    return next((q for q in range(j + 1, len(trace)) if trace[q] == T.frame_sep), None)


def widened(examples):
    """The examples with every span (i, j) as (i, its frame's <|frame_sep|>), in the frame unit's sense: a frame
    cut off before its <|frame_sep|> stays text, and so do the frames after it."""
    out = []
    for ex in examples:
        spans = []
        for i, j in ex["spans"]:
            f = frame_end(ex["trace_ids"], j)
            if f is None:
                break
            spans.append((i, f))
        out.append(dict(ex, spans=spans))
    return out


def test_frame_rounds_resume_at_the_frame_sep_and_anchor_kd_there():
    ex = make_example(random.Random(0), 3)
    plan = plan_example(ex, 0, T, unit="frame")
    trace = ex["trace_ids"]
    ends = tuple(frame_end(trace, j) for _, j in ex["spans"])
    assert plan.resume == ends and plan.n_spans == 3
    latent_tokens = sum(f - i - 1 for (i, _), f in zip(plan.spans, ends))  # locals, <|action_sep|>, the line
    assert sum(len(r.targets) for r in plan.rounds) == len(trace) - latent_tokens
    for r in plan.rounds[1:]:
        assert r.tokens[:2] == (T.latent_end, T.frame_sep) and r.anchors == (1,)
    full = ex["prompt_ids"] + trace
    assert [full[a] for a in plan.teacher_anchors] == [T.frame_sep] * 3
    assert plan_example(ex, 0, T).resume == tuple(j for _, j in ex["spans"])  # the locals unit: as before


def test_a_frame_cut_before_its_frame_sep_stays_text():
    t = T
    ex = {"prompt_ids": [t.trace_context_start, 20, t.frame_sep],
          "trace_ids": [t.line_sep, 30, t.action_sep, 40, t.frame_sep, t.line_sep, 31, t.action_sep, 41],
          "spans": [(0, 2), (5, 7)]}
    plan = plan_example(ex, 0, t, unit="frame")
    assert plan.spans == ((0, 2),) and plan.resume == (4,)
    assert plan.rounds[-1].tokens == (t.latent_end, t.frame_sep, t.line_sep, 31, t.action_sep, 41)


def test_the_frame_unit_refuses_line_anchors():
    ex = make_example(random.Random(1), 2)
    with pytest.raises(ValueError, match="action_line"):
        plan_example(ex, 0, T, kd_positions="action_line", unit="frame")
    with pytest.raises(ConfigError, match="codi.kd_positions"):
        codi_model(tiny_base(), T, 2, latent_unit="frame", kd_positions="action_line")
    with pytest.raises(ConfigError, match="codi.latent_unit"):
        codi_model(tiny_base(), T, 2, latent_unit="line")


@pytest.mark.parametrize("latent_steps", [1, 3])
@pytest.mark.parametrize("options", [{}, dict(recon_weight=0.5), dict(single_anchor=True)], ids=["default", "recon",
                                                                                                "single_anchor"])
def test_frame_unit_equals_the_oracle_on_widened_spans(latent_steps, options):
    model = codi_model(tiny_base(), T, latent_steps, latent_unit="frame", **options)
    for examples in (mixed_batch(), edge_batch()):
        out = assert_equal_to_oracle(model, examples, oracle_examples=widened(examples))  # losses and gradients
        assert float(out["kd_loss"]) > 0
    assert_equal_to_oracle(model, mixed_batch(seed=3), ss_prob=1.0, oracle_examples=widened(mixed_batch(seed=3)))


def test_frame_unit_trains_the_value_terms():
    model = codi_model(tiny_base(), T, 2, latent_unit="frame", value_weight=1.0, value_kd_weight=1.0,
                       value_feedback="soft")
    out = model(batch_with_values())
    assert float(out["value_loss"]) > 0 and float(out["value_kd_loss"]) > 0
    out["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_the_reconstruction_probe_writes_the_whole_frame():
    model = codi_model(tiny_base(), T, 2, latent_unit="frame", recon_weight=1.0)
    examples = mixed_batch()
    pairs = model.reconstruct(examples)
    truths = [list(ex["trace_ids"][i + 1:frame_end(ex["trace_ids"], j) + 1]) for ex in examples for i, j in ex["spans"]]
    assert [t for _, t in pairs] == truths and all(t[-1] == T.frame_sep for t in truths)
    assert all(len(p) <= len(t) for p, t in pairs)
