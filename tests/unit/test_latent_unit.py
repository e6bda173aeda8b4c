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


# ------------------------------------------------------------------------------------ multi-frame blocks
def test_multi_frame_blocks_group_consecutive_line_frames():
    ex = make_example(random.Random(0), 5, other_frames=False)
    trace, spans = ex["trace_ids"], ex["spans"]
    ends = [frame_end(trace, j) for _, j in spans]
    plan = plan_example(ex, 0, T, unit="frame", frames_per_block=2)
    assert plan.block_frames == (2, 2, 1)
    assert plan.spans == (spans[0], spans[2], spans[4]) and plan.resume == (ends[1], ends[3], ends[4])
    assert [plan.value_index(1, j) for j in range(3)] == [2, 3, None]
    assert plan_example(ex, 0, T, unit="frame", frames_per_block=2, latent_share=0.5).block_frames == (2, 2)
    # a return frame between two LINE frames ends a block
    t = T
    ex = {"prompt_ids": [t.trace_context_start, 20, t.frame_sep],
          "trace_ids": [t.line_sep, 30, t.action_sep, 40, t.frame_sep,
                        t.return_sep, t.action_sep, 41, t.arg_sep, 42, t.frame_sep,
                        t.line_sep, 31, t.action_sep, 43, t.frame_sep, t.line_sep, 32, t.action_sep, 44, t.frame_sep,
                        t.eos],
          "spans": [(0, 2), (11, 13), (16, 18)], "value_pos": [1, 12, 17]}
    plan = plan_example(ex, 0, t, unit="frame", frames_per_block=3, values=True)
    assert plan.block_frames == (1, 2) and plan.spans == ((0, 2), (11, 13)) and plan.resume == (4, 20)
    assert plan.value_pos == (1, 12, 17) and plan.rounds[2].tokens == (t.latent_end, t.frame_sep, t.eos)
    with pytest.raises(ValueError, match="frames_per_block"):
        plan_example(ex, 0, t, frames_per_block=2)  # the locals unit has lines between the frames
    with pytest.raises(ConfigError, match="codi.frames_per_block"):
        codi_model(tiny_base(), T, 3, frames_per_block=2)
    with pytest.raises(ConfigError, match="codi.frames_per_block"):
        codi_model(tiny_base(), T, 2, latent_unit="frame", frames_per_block=2)  # a latent per frame after LS


def multi_frame_batch(seed=0):
    """Examples with runs of consecutive LINE frames (and one with call/return frames between them), each LINE
    frame with a value token (the one after its <|line_sep|>) or none."""
    rng = random.Random(seed)
    out = [make_example(rng, 5, other_frames=False), make_example(rng, 4), make_example(rng, 2, other_frames=False)]
    for ex in out:
        ex["value_pos"] = [i + 1 if rng.random() < 0.8 else -1 for i, _ in ex["spans"]]
    return out


@pytest.mark.parametrize("frames_per_block,latent_steps", [(2, 3), (3, 4)])
def test_multi_frame_blocks_equal_the_oracle_on_the_blocks_spans(frames_per_block, latent_steps):
    model = codi_model(tiny_base(), T, latent_steps, latent_unit="frame", frames_per_block=frames_per_block,
                       recon_weight=0.5)
    examples = multi_frame_batch()
    blocks = [dict(ex, spans=[(p.spans[s][0], p.resume[s]) for s in range(p.n_spans)])
              for ex, p in zip(examples, model.plans(examples))]
    assert any(len(b["spans"]) < len(ex["spans"]) for b, ex in zip(blocks, examples))  # some block holds 2+ frames
    assert_equal_to_oracle(model, examples, oracle_examples=blocks)


def test_each_frame_of_a_block_has_its_value_slot_at_its_own_latent():
    """frames_per_block 2, latent_steps 3: frame 0's value slot is the hidden feeding latent 1 (latent 0's output),
    frame 1's the hidden feeding latent 2 (latent 1's output); the value CE reads them through the head."""
    exs = multi_frame_batch(seed=1)
    torch.manual_seed(0)
    off = codi_model(tiny_base(), T, 3, latent_unit="frame", frames_per_block=2)
    on = codi_model(tiny_base(), T, 3, latent_unit="frame", frames_per_block=2, value_weight=0.7)
    on.load_state_dict(off.state_dict())
    out = on(exs)
    states = off.block_states(exs)  # per block [latent_start, latent 0, latent 1, latent 2] outputs
    per_ex = []
    for ex, plan, blocks in zip(exs, off.plans(exs), states):
        ces = []
        for s, b in enumerate(blocks):
            for j in range(2):
                q = plan.value_index(s, j)
                p = ex["value_pos"][q] if q is not None else -1
                if p >= 0:  # the hidden feeding latent 3 - 2 + j is the output at position (latent) j
                    ces.append(torch.nn.functional.cross_entropy(off.head(b[1 + j][None]),
                                                                 torch.tensor([ex["trace_ids"][p]])))
        if ces:
            per_ex.append(torch.stack(ces).mean())
    expected = torch.stack(per_ex).mean()
    assert torch.allclose(out["value_loss"], expected, atol=1e-6)


def test_multi_frame_value_terms_and_feedback_train():
    model = codi_model(tiny_base(), T, 3, latent_unit="frame", frames_per_block=2, value_weight=1.0,
                       value_kd_weight=1.0, value_feedback="soft")
    out = model(multi_frame_batch())
    assert float(out["value_loss"]) > 0 and float(out["value_kd_loss"]) > 0
    out["loss"].backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.projector.parameters())


@pytest.mark.parametrize("frames_per_block,latent_steps", [(1, 2), (2, 3)])
def test_the_decoder_feeds_the_latents_training_feeds(frames_per_block, latent_steps):
    """With value feedback on the last frames_per_block latents, the latent decoder's inputs for its first block equal
    the training recurrence's (CodiModel's inputs to the reconstruction decoder) after the same prefix."""
    from codi.evaluation.decoding import decode
    from codi.tracing.format import render_prompt
    from codi.tracing.tokens import token_ids
    from tests.unit.test_decoding import PROGRAMS, _encode, _model, _tokenizer

    tok = _tokenizer()
    ids = token_ids(tok)
    base = _model(tok, seed=3)
    prompt = _encode(tok, render_prompt(*PROGRAMS[1][:2]))
    with torch.no_grad():  # make <|line_sep|> a likely choice, so that a block comes soon
        base.lm_head.weight[ids.line_sep] = 0.2 * base.model(input_ids=torch.tensor([prompt])).last_hidden_state[0].mean(0)
    model = codi_model(base, ids, latent_steps, latent_unit="frame", frames_per_block=frames_per_block,
                       value_feedback="soft", recon_weight=0.1).eval()
    args = dict(projector=model.projector, latent_steps=latent_steps, max_frames=10, value_feedback="soft",
                latent_unit="frame", frames_per_block=frames_per_block)
    [free] = decode("latent", base, tok, [prompt], max_new_tokens=60, **args)
    first = free.ids.index(ids.line_sep)
    # Capped at the first block's <|latent_end|>: its latents, each fed the step after it was placed, are all it fed.
    [res] = decode("latent", base, tok, [prompt], max_new_tokens=first + 3 + latent_steps, **args)
    assert res.latent_count == latent_steps
    prefix = free.ids[:first + 1]
    trace = prefix + [30, ids.action_sep, 40, ids.frame_sep, ids.eos]
    example = {"prompt_ids": prompt, "trace_ids": trace, "spans": [(first, first + 2)]}
    with torch.no_grad():
        _, _, latents, _ = model._student(model.plans([example]), [[False]])
    torch.testing.assert_close(res.latent_sum, latents[(0, 0)].sum(0), rtol=1e-5, atol=1e-5)


def test_the_probe_reads_a_multi_frame_block_for_its_first_frames_value():
    from codi.data.values import AssignedValue
    from codi.evaluation.probe import collect_blocks

    model = codi_model(tiny_base(), T, 3, latent_unit="frame", frames_per_block=2)
    ex = make_example(random.Random(4), 5, other_frames=False) | {"problem_id": "p"}
    slots = [[AssignedValue(name="x", repr="1", pos=i + 1, kind="copy") for i, _ in ex["spans"]]]  # every frame: the token after line_sep
    blocks = collect_blocks(model, [ex], slots, batch_size=4)
    assert list(blocks.frame_index) == [0, 2, 4]  # blocks of frames (0, 1), (2, 3), (4)
    assert list(blocks.labels) == [ex["trace_ids"][ex["spans"][f][0] + 1] for f in (0, 2, 4)]
    assert blocks.states.shape[:2] == (3, 4)  # latent_start and 3 latents


# ------------------------------------------------------------------------------------ the latent call frame
def call_end(trace):
    """Index of the `<|frame_sep|>` closing the trace's first frame (the entry call's)."""
    return frame_end(trace, trace.index(T.action_sep))


def test_the_latent_call_frame_is_the_first_latent_frame():
    ex = make_example(random.Random(0), 3, other_frames=False)
    ex["value_pos"] = [i + 1 for i, _ in ex["spans"]]
    trace = ex["trace_ids"]
    plan = plan_example(ex, 0, T, unit="frame", latent_call=True, values=True)
    j0 = trace.index(T.action_sep)
    assert plan.spans == ((0, j0),) + tuple(ex["spans"]) and plan.call_frames == 1
    assert plan.resume == (call_end(trace),) + plan_example(ex, 0, T, unit="frame").resume
    assert plan.value_pos == (-1, *ex["value_pos"])  # the call frame assigns nothing
    p = len(ex["prompt_ids"])
    assert plan.rounds[0].tokens == tuple(ex["prompt_ids"]) + (T.call_sep, T.latent_start)
    assert plan.rounds[0].targets == ((p - 1, T.call_sep),)
    full = ex["prompt_ids"] + trace
    assert [full[a] for a in plan.teacher_anchors] == [T.frame_sep] * 4
    # grouped with the LINE frames right after it: blocks (call, 0), (1, 2)
    grouped = plan_example(ex, 0, T, unit="frame", latent_call=True, values=True, frames_per_block=2)
    assert grouped.block_frames == (2, 2) and grouped.spans == ((0, j0), ex["spans"][1])
    assert [grouped.value_index(0, j) for j in range(2)] == [0, 1] and grouped.value_pos[0] == -1
    assert plan_example(ex, 0, T, unit="frame", latent_call=True, latent_share=0.25).spans == ((0, j0),)
    off = plan_example(ex, 0, T, unit="frame")
    assert off.call_frames == 0 and off.spans == tuple(ex["spans"])


def test_a_call_frame_cut_before_its_frame_sep_leaves_the_trace_text():
    t = T
    ex = {"prompt_ids": [t.trace_context_start, 20, t.frame_sep],
          "trace_ids": [t.call_sep, 30, t.action_sep, 40, t.line_sep, 31, t.action_sep, 41], "spans": [(4, 6)]}
    plan = plan_example(ex, 0, t, unit="frame", latent_call=True)
    assert plan.spans == () and plan.call_frames == 0 and len(plan.rounds) == 1


def test_the_latent_call_frame_needs_the_frame_unit():
    ex = make_example(random.Random(1), 2)
    with pytest.raises(ValueError, match="latent_call"):
        plan_example(ex, 0, T, latent_call=True)
    with pytest.raises(ConfigError, match="codi.latent_call"):
        codi_model(tiny_base(), T, 2, latent_call=True)


@pytest.mark.parametrize("frames_per_block,latent_steps", [(1, 2), (2, 3)])
def test_the_latent_call_frame_equals_the_oracle_on_its_span(frames_per_block, latent_steps):
    """The call frame's block is one more widened span, (0, its <|frame_sep|>), for the reference design."""
    model = codi_model(tiny_base(), T, latent_steps, latent_unit="frame", frames_per_block=frames_per_block,
                       latent_call=True, recon_weight=0.5)
    examples = multi_frame_batch()
    plans = model.plans(examples)
    blocks = [dict(ex, spans=[(p.spans[s][0], p.resume[s]) for s in range(p.n_spans)]) for ex, p in zip(examples, plans)]
    assert all(b["spans"][0][0] == 0 and ex["trace_ids"][0] == T.call_sep for b, ex in zip(blocks, examples))
    out = assert_equal_to_oracle(model, examples, oracle_examples=blocks)
    assert float(out["kd_loss"]) > 0


def test_the_latent_call_frame_trains_the_value_terms_of_the_line_frames_only():
    exs = multi_frame_batch(seed=2)
    torch.manual_seed(0)
    model = codi_model(tiny_base(), T, 2, latent_unit="frame", latent_call=True, value_weight=1.0)
    states = model.block_states(exs)
    expected = []
    for ex, plan, blocks in zip(exs, model.plans(exs), states):
        assert len(blocks) == len(ex["spans"]) + 1  # the call's block first
        # LINE frame s: block s + 1; its value slot is the hidden feeding its last latent (latent 0's output)
        ces = [torch.nn.functional.cross_entropy(model.head(b[-2][None]), torch.tensor([ex["trace_ids"][p]]))
               for b, p in zip(blocks[1:], ex["value_pos"]) if p >= 0]
        if ces:
            expected.append(torch.stack(ces).mean())
    out = model(exs)
    assert torch.allclose(out["value_loss"], torch.stack(expected).mean(), atol=1e-6)


def test_the_probe_skips_the_call_frames_block():
    from codi.data.values import AssignedValue
    from codi.evaluation.probe import collect_blocks

    model = codi_model(tiny_base(), T, 3, latent_unit="frame", frames_per_block=2, latent_call=True)
    ex = make_example(random.Random(4), 5, other_frames=False) | {"problem_id": "p"}
    slots = [[AssignedValue(name="x", repr="1", pos=i + 1, kind="copy") for i, _ in ex["spans"]]]
    blocks = collect_blocks(model, [ex], slots, batch_size=4)
    assert list(blocks.frame_index) == [1, 3]  # blocks (call, 0), (1, 2), (3, 4): LINE frames 1 and 3 lead two
    assert list(blocks.labels) == [ex["trace_ids"][ex["spans"][f][0] + 1] for f in (1, 3)]


def test_the_decoder_opens_a_block_at_the_entry_call_and_parses_it_as_the_call_frame():
    from codi.evaluation.decoding import LATENT, decode, parse_generation
    from codi.tracing.format import render_prompt
    from codi.tracing.tokens import token_ids
    from tests.unit.test_decoding import PROGRAMS, _encode, _model, _tokenizer

    tok = _tokenizer()
    ids = token_ids(tok)
    base = _model(tok, seed=3)
    prompt = _encode(tok, render_prompt(*PROGRAMS[1][:2]))
    with torch.no_grad():  # make <|call_sep|> the first choice
        h = base.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
        base.lm_head.weight[ids.call_sep] = 50.0 * h / h.norm() ** 2
    model = codi_model(base, ids, 2, latent_unit="frame", latent_call=True).eval()
    args = dict(projector=model.projector, latent_steps=2, max_frames=10, latent_unit="frame", max_new_tokens=8)
    [on] = decode("latent", base, tok, [prompt], latent_call=True, **args)
    assert on.ids[:5] == [ids.call_sep, ids.latent_start, LATENT, LATENT, ids.latent_end]
    [off] = decode("latent", base, tok, [prompt], **args)
    assert off.ids[0] == ids.call_sep and ids.latent_start not in off.ids[1:2]
    # a whole latent trace: the call frame's block, a LINE frame's, then the entry's return frame as text
    body = [ids.call_sep, ids.latent_start, LATENT, LATENT, ids.latent_end, ids.frame_sep,
            ids.line_sep, ids.latent_start, LATENT, LATENT, ids.latent_end, ids.frame_sep]
    ret = _encode(tok, "<|return_sep|><|action_sep|>    return x\n<|arg_sep|>\"3\"<|frame_sep|>")
    _, frames, answer, _, error = parse_generation("latent", body + ret, tok, ids, "entry_exit", 2, "frame",
                                                   latent_call=True)
    assert error == "" and answer == "3" and [f.kind for f in frames] == ["call", "line", "return"]
    assert frames[0].source_line is None and frames[0].locals is None
    _, _, _, _, error = parse_generation("latent", body + ret, tok, ids, "entry_exit", 2, "frame")
    assert "outside a LINE frame" in error
    with pytest.raises(ValueError, match="latent_call"):
        decode("latent", base, tok, [prompt], latent_call=True, **dict(args, latent_unit="locals"))


# ------------------------------------------------------------------------------------ the unit curriculum
def test_the_unit_ladder_leads_from_the_locals_to_the_configured_unit():
    from codi.modeling.plan import unit_at, unit_ladder

    assert unit_ladder("frame", 1, False) == (("locals", 1, False), ("frame", 1, False))
    ladder = unit_ladder("frame", 3, True)
    assert ladder == (("locals", 1, False), ("frame", 1, False), ("frame", 3, True))
    assert [unit_at(s, 100, ladder)[0] for s in (0, 99, 100, 199, 200, 5000)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="unit_stage_steps"):
        unit_at(0, 0, ladder)


def test_the_unit_curriculum_options():
    model = codi_model(tiny_base(), T, 4, latent_unit="frame", frames_per_block=3, latent_call=True,
                       unit_stage_steps=10)
    locals_ = model.options.at_unit(("locals", 1, False))
    assert (locals_.latent_unit, locals_.frames_per_block, locals_.latent_call) == ("locals", 1, False)
    assert model.options.at_unit(("frame", 3, True)) == model.options
    with pytest.raises(ConfigError, match="codi.unit_stage_steps"):
        codi_model(tiny_base(), T, 2, unit_stage_steps=10)  # the locals unit: nothing to lead to
    with pytest.raises(ConfigError, match="codi.unit_stage_steps"):
        codi_model(tiny_base(), T, 2, latent_unit="frame", unit_stage_steps=10, stage_steps=5)


def test_a_model_on_a_stage_unit_equals_one_built_with_it():
    """The trainer swaps `options` for the stage's unit: the same losses as a model built with that unit."""
    exs = multi_frame_batch(seed=5)
    final = codi_model(tiny_base(), T, 3, latent_unit="frame", frames_per_block=2, latent_call=True,
                       unit_stage_steps=1, value_weight=1.0, recon_weight=0.5)
    for unit in (("locals", 1, False), ("frame", 1, False)):
        built = codi_model(tiny_base(), T, 3, latent_unit=unit[0], value_weight=1.0, recon_weight=0.5)
        built.load_state_dict(final.state_dict())
        final.options = final.options.at_unit(unit)
        a, b = final(exs), built(exs)
        assert all(torch.equal(a[k], b[k]) for k in ("loss", "kd_loss", "value_loss", "recon_loss"))
