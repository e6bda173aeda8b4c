"""codi.data.values (the value each LINE frame carries) and the research-IV levers that train on it (codi.modeling)."""

from __future__ import annotations

import random

import pytest
import torch

from codi.data.spans import encode_examples
from codi.data.values import assigned_name, assigned_values, token_starts, value_offset, value_positions
from codi.infra.config import ConfigError
from codi.modeling.base_model import train_tiny_tokenizer
from codi.tracing.format import Frame, encode_locals, encode_value, locals_offsets, render_prompt, render_trace
from tests.codi_oracle import TOKEN_IDS, batch_with_values, codi_model, make_example, tiny_base
from tests.tiny import shipped

torch.set_num_threads(1)

PROGRAM = "def f(a):\n    b = a\n    b = b + 2\n    b = max(b, 6)\n    c = b - 1\n    return c\n"


def chain_frames(a: int) -> list[Frame]:
    b1 = a
    b2 = b1 + 2
    b3 = max(b2, 6)
    c = b3 - 1
    return [
        Frame("call", "def f(a):\n", locals=encode_locals({"a": str(a)})),
        Frame("line", "    b = a\n", locals=encode_locals({"a": str(a)})),
        Frame("line", "    b = b + 2\n", locals=encode_locals({"a": str(a), "b": str(b1)})),
        Frame("line", "    b = max(b, 6)\n", locals=encode_locals({"a": str(a), "b": str(b2)})),
        Frame("line", "    c = b - 1\n", locals=encode_locals({"a": str(a), "b": str(b3)})),
        Frame("line", "    return c\n", locals=encode_locals({"a": str(a), "b": str(b3), "c": str(c)})),
        Frame("return", "    return c\n", value=encode_value(str(c))),
    ]


@pytest.fixture(scope="module")
def tok():
    texts = [render_prompt(PROGRAM, f"f({a})") + render_trace(chain_frames(a)) for a in range(10)] * 4
    return train_tiny_tokenizer(texts, shipped("model.tiny", vocab_size=300))


def encoded(tok, a: int):
    frames = chain_frames(a)
    trace = render_trace(frames)
    [enc] = encode_examples(tok, [render_prompt(PROGRAM, f"f({a})")], [trace], [locals_offsets(frames)], names=["t"])
    return trace, enc


def test_assigned_name_reads_one_plain_target():
    assert assigned_name("    b = a\n")[0] == "b"
    assert assigned_name("    b += 2\n")[0] == "b"
    assert assigned_name("    b: int = 3\n")[0] == "b"
    assert assigned_name("    for i in range(n):\n") == ("i", None)
    for line in ("def f(a):\n", "    return c\n", "    if b > 4:\n", "    a, b = b, a\n", "    x[0] = 1\n", "  )"):
        assert assigned_name(line) is None, line


def test_value_offset_points_inside_the_quotes():
    text = encode_locals({"a": "3", "bb": "'x y'"})
    assert text[value_offset(text, "bb"):].startswith("'x y'")
    assert text[value_offset(text, "a"):].startswith("3")
    assert value_offset(text, "zz") is None and value_offset("{not json", "a") is None


def test_each_span_gets_the_previous_lines_value_and_its_kind(tok):
    a = 5
    trace, enc = encoded(tok, a)
    slots = assigned_values(trace, enc.trace_ids, enc.spans, tok)
    # span 0 follows `def f(a):` (binds nothing); then b = a (copy: 5), b = b + 2 (computed: 7),
    # b = max(b, 6) (copy: 7 is the operand b), c = b - 1 (computed: 6)
    assert slots[0] is None
    assert [(s.name, s.repr, s.kind) for s in slots[1:]] == [("b", "5", "copy"), ("b", "7", "computed"),
                                                             ("b", "7", "copy"), ("c", "6", "computed")]
    for s, (i, j) in zip(slots[1:], enc.spans[1:]):
        assert i < s.pos < j
        assert tok.decode([enc.trace_ids[s.pos]]).startswith(s.repr[0])
    assert value_positions(slots)[0] == -1 and value_positions(slots)[1:] == [s.pos for s in slots[1:]]


def test_tokens_that_do_not_spell_the_text_give_no_slots(tok):
    trace, enc = encoded(tok, 3)
    assert token_starts(enc.trace_ids, tok, trace + "x") is None
    assert assigned_values(trace + "", enc.trace_ids[:1] + enc.trace_ids, enc.spans, tok) == [None] * len(enc.spans)
    with pytest.raises(ValueError, match="spans for"):
        assigned_values(trace, enc.trace_ids, enc.spans[:-1], tok)


# ----------------------------------------------------------------------------------- the levers
W = dict(teacher_ce_weight=1.0, student_ce_weight=1.0, kd_weight=1.0)


def test_the_value_ce_is_the_value_slots_cross_entropy_through_the_head():
    """The value slot (latent_steps 2: the first latent's output) read through the head, against the value token:
    the loss rises by exactly value_weight times that CE, averaged per example as the other terms are."""
    exs = batch_with_values()
    torch.manual_seed(0)
    off = codi_model(tiny_base(), TOKEN_IDS, 2, **W)
    torch.manual_seed(0)
    on = codi_model(tiny_base(), TOKEN_IDS, 2, value_weight=0.7, **W)
    on.load_state_dict(off.state_dict())
    base_loss = off(exs)["loss"]
    out = on(exs)
    states = off.block_states(exs)  # [LS, latent 1, latent 2] outputs per span
    per_ex = []
    for ex, blocks in zip(exs, states):
        ces = [torch.nn.functional.cross_entropy(off.head(b[1][None]), torch.tensor([ex["trace_ids"][p]]))
               for b, p in zip(blocks, ex["value_pos"]) if p >= 0]
        if ces:
            per_ex.append(torch.stack(ces).mean())
    expected = torch.stack(per_ex).mean()
    assert torch.allclose(out["value_loss"], expected, atol=1e-6)
    assert torch.allclose(out["loss"], base_loss + 0.7 * expected, atol=1e-6)


def test_the_value_ramp_scales_both_value_terms_and_is_bit_exact_when_off():
    """codi.value_ramp_frac (research V): the value terms' weights times plan.value_ramp's factor; the factor
    is exactly 1 with the ramp off, and the loss is then the loss without a ramp, bit for bit."""
    from codi.modeling.plan import value_ramp

    assert value_ramp(0, 1600, 0.0) == value_ramp(5, 1600, 0.0) == 1.0
    assert value_ramp(0, 1600, 0.25) == 0.0 and value_ramp(200, 1600, 0.25) == 0.5
    assert value_ramp(400, 1600, 0.25) == value_ramp(1599, 1600, 0.25) == 1.0
    exs = batch_with_values()
    torch.manual_seed(0)
    m = codi_model(tiny_base(), TOKEN_IDS, 2, value_weight=0.7, value_kd_weight=2.0, **W)
    full, half, none = m(exs), m(exs, value_scale=0.5), m(exs, value_scale=0.0)
    assert torch.equal(m(exs, value_scale=1.0)["loss"], full["loss"])
    assert torch.equal(none["value_loss"], full["value_loss"]) and none["value_kd_loss"] > 0
    rest = full["loss"] - 0.7 * full["value_loss"] - 2.0 * full["value_kd_loss"]
    assert torch.allclose(none["loss"], rest, atol=1e-6)
    assert torch.allclose(half["loss"], rest + 0.5 * (0.7 * full["value_loss"] + 2.0 * full["value_kd_loss"]),
                          atol=1e-6)
    for bad in (1.5, -0.1, True):
        with pytest.raises(ValueError, match="value_scale"):
            m(exs, value_scale=bad)


@pytest.mark.parametrize("feedback", ["soft", "hard"])
def test_value_feedback_changes_the_student_and_trains_the_head(feedback):
    exs = batch_with_values()
    torch.manual_seed(0)
    off = codi_model(tiny_base(), TOKEN_IDS, 2, value_weight=1.0, **W)
    torch.manual_seed(0)
    on = codi_model(tiny_base(), TOKEN_IDS, 2, value_weight=1.0, value_feedback=feedback, **W)
    on.load_state_dict(off.state_dict())
    a, b = off(exs), on(exs)
    assert torch.equal(a["teacher_loss"], b["teacher_loss"])  # the teacher never sees latents
    assert not torch.equal(a["student_loss"], b["student_loss"])
    b["loss"].backward()
    grad = on.model.get_input_embeddings().weight.grad  # the tied head: through the value CE and the feedback
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_value_kd_aligns_layers_1_to_L_and_its_options_are_checked():
    exs = batch_with_values()
    m = codi_model(tiny_base(), TOKEN_IDS, 2, value_kd_weight=2.0, **W)
    out = m(exs)
    assert out["value_kd_loss"] > 0 and m.value_layers == (1, 2)
    out["loss"].backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.projector.parameters())
    with pytest.raises(ConfigError, match="codi.value_kd_weight"):
        codi_model(tiny_base(), TOKEN_IDS, 1, value_kd_weight=1.0, **W)
    with pytest.raises(ConfigError, match="codi.value_weight"):
        codi_model(tiny_base(), TOKEN_IDS, 0, value_weight=1.0, **W)
    with pytest.raises(ConfigError, match="codi.value_feedback"):
        codi_model(tiny_base(), TOKEN_IDS, 0, value_feedback="soft", **W)
    bad = batch_with_values()
    del bad[1]["value_pos"]
    with pytest.raises(ValueError, match=r"examples\[1\].value_pos: missing"):
        m(bad)
    bad = batch_with_values()
    bad[0]["value_pos"][0] = bad[0]["spans"][0][1]
    with pytest.raises(ValueError, match=r"examples\[0\].value_pos\[0\]"):
        m(bad)


def test_value_options_off_leave_the_loss_as_it_was():
    """The value options at their first values: the loss is the reference's (the oracle tests hold it there);
    an example's value_pos is then not even read."""
    exs = batch_with_values()
    plain = [{k: v for k, v in ex.items() if k != "value_pos"} for ex in exs]
    m = codi_model(tiny_base(), TOKEN_IDS, 2, **W)
    assert torch.equal(m(exs)["loss"], m(plain)["loss"])


def test_answer_anchor_is_the_entry_exits_arg_sep_only():
    from codi.modeling.plan import plan_example
    ex = make_example(random.Random(1), 3)
    plan = plan_example(ex, 0, TOKEN_IDS, 1.0, "answer")
    assert plan.anchor_counts[:-1] == (0, 0) and plan.anchor_counts[-1] == 1
    (pos,) = plan.teacher_anchors
    full = ex["prompt_ids"] + ex["trace_ids"]
    assert full[pos] == TOKEN_IDS.arg_sep and TOKEN_IDS.arg_sep not in full[pos + 1:]
    m = codi_model(tiny_base(), TOKEN_IDS, 2, kd_positions="answer", **W)
    assert torch.isfinite(m([ex])["kd_loss"])


# ------------------------------------------------------------------------------ the stage curriculum
def test_stage_latent_count_is_the_stage_with_mixing_and_smoothing():
    from codi.modeling.plan import stage_latent_count, stage_of
    assert [stage_of(s, 100) for s in (0, 99, 100, 250)] == [1, 1, 2, 3]
    plain = [stage_latent_count(s, 100, 0.0, 0.0, random.Random(s)) for s in (0, 150, 420)]
    assert plain == [1, 2, 5]
    rng = random.Random(0)
    counts = [stage_latent_count(400, 100, 0.0, 1.0, rng) for _ in range(2000)]  # stage 5, always an earlier one
    assert set(counts) == {1, 2, 3, 4} and min(counts.count(k) for k in range(1, 5)) > 400
    rng = random.Random(0)
    counts = [stage_latent_count(0, 100, 0.3, 0.0, rng) for _ in range(2000)]    # stage 1, +1 three times in ten
    assert set(counts) == {1, 2} and 0.25 < counts.count(2) / 2000 < 0.35


def test_latent_count_makes_the_first_frames_latent():
    from codi.modeling.plan import plan_example
    ex = make_example(random.Random(2), 4)
    assert plan_example(ex, 0, TOKEN_IDS, latent_count=2).spans == tuple(ex["spans"][:2])
    assert plan_example(ex, 0, TOKEN_IDS, latent_count=9).spans == tuple(ex["spans"])
    m = codi_model(tiny_base(), TOKEN_IDS, 1, **W)
    assert torch.isfinite(m([ex], latent_count=1)["loss"])
    with pytest.raises(ConfigError, match="codi.stage_steps"):
        codi_model(tiny_base(), TOKEN_IDS, 1, stage_steps=10, latent_curriculum_frac=0.5, **W)


def test_value_kd_with_a_frozen_teacher_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="codi.value_kd_weight"):
        codi_model(tiny_base(), TOKEN_IDS, 2, value_kd_weight=1.0, frozen_teacher=tiny_base(seed=1), **W)
