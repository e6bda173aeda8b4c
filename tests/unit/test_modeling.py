"""Unit tests of codi.modeling: argument checks, example checks, schedule, call counts, primitives,
DDP, dtype, save/load. Equality with the reference design: test_modeling_equivalence.py."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.codi_oracle` without a conftest

import codi.modeling.losses as losses  # noqa: E402
from codi.modeling import (  # noqa: E402
    CodiModel,
    LossWeights,
    PaddedRows,
    activation_checkpointing,
    load_codi_model,
    plan_example,
    read_codi_config,
    save_codi_model,
    ss_ramp,
)
from codi.tracing.tokens import add_trace_tokens, token_ids  # noqa: E402
from tests.codi_oracle import (  # noqa: E402
    TOKEN_IDS,
    codi_model,
    latent_block,
    make_example,
    oracle_forward,
    oracle_latent_block,
    tiny_base,
)
from tests.tiny import shipped  # noqa: E402

torch.set_num_threads(1)
W = dict(teacher_ce_weight=1.0, student_ce_weight=1.0, kd_weight=1.0)


def build(latent_steps=1, base=None, **kw):
    return codi_model(base if base is not None else tiny_base(), TOKEN_IDS, latent_steps, **{**W, **kw})


def batch(frames=(1, 3, 2), seed=0):
    rng = random.Random(seed)
    return [make_example(rng, n) for n in frames]


# ---------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kw,key", [
    (dict(latent_steps=-1), "codi.latent_steps"),
    (dict(latent_steps=1.5), "codi.latent_steps"),
    (dict(kd_layers=[]), "codi.kd_layers"),
    (dict(kd_target="attention"), "codi.kd_target"),
    (dict(kd_temp=0.0), "codi.kd_temp"),
    (dict(single_anchor="yes"), "codi.single_anchor"),
    (dict(kd_weight=-1.0), "kd_weight"),
    (dict(teacher_ce_weight=float("nan")), "teacher_ce_weight"),
    (dict(kd_norm="layer"), "codi.kd_norm"),
    (dict(kd_norm="teacher_std", kd_target="logit"), "codi.kd_norm"),
    (dict(kd_positions="everywhere"), "codi.kd_positions"),
    (dict(recon_weight=-0.1), "codi.recon_weight"),
    (dict(recon_weight=1.0, recon_decoder="separate"), "codi.recon_decoder"),
    (dict(recon_weight=1.0, latent_steps=0), "codi.recon_weight"),
])
def test_bad_options_name_the_key(kw, key):
    """Options are checked once, where they are parsed (params.yaml, codi_config.json: the same declarations)."""
    args = {**W, "latent_steps": 1, **kw}
    with pytest.raises(ValueError, match=key):
        codi_model(tiny_base(), TOKEN_IDS, **args)


@pytest.mark.parametrize("kw", [dict(kd_layers=[3]), dict(kd_layers=[-4]),   # tiny_base: 2 layers -> 3 hidden states
                                dict(kd_target="logit", kd_layers=[1]), dict(kd_target="logit", kd_layers=[-1, 0])])
def test_options_the_model_cannot_honour_name_the_key(kw):
    """The checks that need the model (its layers, its vocabulary) are CodiModel's."""
    with pytest.raises(ValueError, match="codi.kd_layers"):
        build(**kw)


def test_bad_frozen_teacher_and_layer_range_against_teacher():
    with pytest.raises(ValueError, match="codi.frozen_teacher"):
        build(frozen_teacher=tiny_base(hidden=48, heads=4))
    with pytest.raises(ValueError, match="codi.kd_layers"):  # in range for the base, not the 1-layer teacher
        build(frozen_teacher=tiny_base(layers=1), kd_layers=[2])
    with pytest.raises(ValueError, match="token_ids.pad"):
        codi_model(tiny_base(), dataclasses.replace(TOKEN_IDS, pad=500), 1, **W)


def test_logit_accepts_last_layer_spellings():
    assert build(kd_target="logit").student_layers == (2,)
    assert build(kd_target="logit", kd_layers=[2]).student_layers == (2,)
    assert build(kd_layers=None).student_layers == (1, 2)  # shared hidden default: hidden_states[1:]
    assert build(frozen_teacher=tiny_base(layers=3)).teacher_layers == (3,)


def test_from_config_maps_fields():
    cfg = shipped("codi", latent_steps=3, kd_layers=[-1], single_anchor=True, kd_target="hidden", kd_temp=1.0)
    weights = LossWeights(teacher_ce_weight=0.5, student_ce_weight=2.0, kd_weight=3.0)
    m = CodiModel.from_config(tiny_base(), TOKEN_IDS, cfg, weights)
    assert (m.options.latent_steps, m.options.kd_layers, m.options.single_anchor) == (3, [-1], True)
    assert type(m.options).__name__ == "CodiOptions" and m.options == cfg.options and m.weights == weights
    with pytest.raises(ValueError, match="codi.frozen_teacher"):
        CodiModel.from_config(tiny_base(), TOKEN_IDS, shipped("codi", frozen_teacher="models/sft"), weights)
    with pytest.raises(ValueError, match="codi.frozen_teacher"):
        CodiModel.from_config(tiny_base(), TOKEN_IDS, shipped("codi"), weights, frozen_teacher=tiny_base())


def test_projector_and_frozen_teacher_registration():
    teacher = tiny_base(seed=3)
    m = build(frozen_teacher=teacher)
    kinds = [type(x).__name__ for x in m.projector]
    assert kinds == ["Linear", "GELU", "Linear", "LayerNorm"]
    assert all(lin.bias is None for lin in (m.projector[0], m.projector[2]))
    names = set(m.state_dict())
    assert any(n.startswith("projector.") for n in names) and any(n.startswith("model.") for n in names)
    assert len(list(m.parameters())) == len(list(m.model.parameters())) + len(list(m.projector.parameters()))
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    assert build(latent_steps=0).projector[0].weight.requires_grad is False


# ----------------------------------------------------------------------------------- examples
@pytest.mark.parametrize("mutate,match", [
    (lambda ex: ex.update(spans=[]), r"examples\[0\].spans: expected at least one"),
    (lambda ex: ex.update(spans=[ex["spans"][0], ex["spans"][0]]), r"examples\[0\].spans\[1\].*sorted"),
    (lambda ex: ex.update(spans=[(ex["spans"][0][0] + 1, ex["spans"][0][1])]), r"spans\[0\].*<\|line_sep\|>"),
    (lambda ex: ex.update(spans=[(ex["spans"][0][0], ex["spans"][0][1] - 1)]), r"spans\[0\].*<\|action_sep\|>"),
    (lambda ex: ex.update(spans=[(0, 10 ** 6)]), r"spans\[0\].*len\(trace_ids\)"),
    (lambda ex: ex.update(prompt_ids=[]), r"examples\[0\].prompt_ids"),
    (lambda ex: ex.pop("trace_ids"), r"missing key 'trace_ids'"),
])
def test_bad_examples_are_named(mutate, match):
    ex = batch(frames=(2,))[0]
    mutate(ex)
    with pytest.raises(ValueError, match=match):
        plan_example(ex, 0, TOKEN_IDS)


def test_plan_rounds_cover_the_non_locals_trace():
    ex = batch(frames=(3,))[0]
    plan = plan_example(ex, 0, TOKEN_IDS)
    locals_tokens = sum(j - i - 1 for i, j in plan.spans)
    assert sum(len(r.targets) for r in plan.rounds) == len(plan.trace) - locals_tokens
    assert [r.ends_in_latent for r in plan.rounds] == [True, True, True, False]
    for r in plan.rounds[1:]:
        assert r.tokens[0] == TOKEN_IDS.latent_end and r.tokens[r.anchors[0]] == TOKEN_IDS.action_sep
        assert r.anchors == (1,)


def test_action_line_anchors_are_the_separator_and_its_line():
    t = TOKEN_IDS
    ex = {"prompt_ids": [t.trace_context_start, 20, t.frame_sep],
          "trace_ids": [t.line_sep, 30, t.action_sep, 40, 41, t.frame_sep, t.line_sep, 31, 32, t.action_sep, 42,
                        t.frame_sep, t.return_sep, t.action_sep, 43, t.arg_sep, 44, t.frame_sep, t.eos],
          "spans": [(0, 2), (6, 9)]}
    plan = plan_example(ex, 0, t, kd_positions="action_line")
    assert [r.anchors for r in plan.rounds] == [(), (1, 2, 3), (1, 2)]
    assert plan.anchor_counts == (3, 2) and plan.n_anchors == 5
    p = len(ex["prompt_ids"])
    assert plan.teacher_anchors == (p + 2, p + 3, p + 4, p + 9, p + 10)  # <|action_sep|> and its line's tokens
    full = ex["prompt_ids"] + ex["trace_ids"]
    assert [full[a] for a in plan.teacher_anchors] == [t.action_sep, 40, 41, t.action_sep, 42]
    assert plan_example(ex, 0, t).teacher_anchors == (p + 2, p + 9)


def test_latent_share_keeps_the_first_frames_latent():
    ex = batch(frames=(4,))[0]
    assert [plan_example(ex, 0, TOKEN_IDS, latent_share=s).n_spans for s in (0.0, 0.1, 0.125, 0.5, 0.8, 1.0)] == \
        [0, 0, 1, 2, 3, 4]
    plan = plan_example(ex, 0, TOKEN_IDS, latent_share=0.5)
    assert plan.spans == tuple(tuple(s) for s in ex["spans"][:2])
    # the explicit frames' locals are student targets again: every trace token but the latent locals
    assert sum(len(r.targets) for r in plan.rounds) == len(plan.trace) - sum(j - i - 1 for i, j in plan.spans)
    none = plan_example(ex, 0, TOKEN_IDS, latent_share=0.0)
    assert len(none.rounds) == 1 and not none.rounds[0].ends_in_latent and none.teacher_anchors == ()
    with pytest.raises(ValueError, match="latent_share"):
        plan_example(ex, 0, TOKEN_IDS, latent_share=1.5)


def test_latent_share_schedule_is_a_pure_ramp():
    from codi.modeling.plan import latent_frames, latent_share
    assert latent_share(0, 100, 0.0, 0.0) == 1.0                     # off: all latent from step 0
    assert [latent_share(s, 100, 0.5, 0.0) for s in (0, 25, 50, 99)] == [0.0, 0.5, 1.0, 1.0]
    assert latent_share(100, 100, 0.5, 0.25) == pytest.approx(0.75)  # mix: the last quarter stays explicit
    assert latent_share(10, 100, 0.2, 0.0) == pytest.approx(0.5)
    assert [latent_frames(3, s) for s in (0.0, 0.16, 0.17, 0.5, 0.75, 1.0)] == [0, 0, 1, 2, 2, 3]


def test_reconstruct_probe_returns_each_frames_locals_against_the_truth():
    m = build(2, recon_weight=1.0)
    examples = batch(frames=(2, 1))
    pairs = m.reconstruct(examples)
    truth = [list(ex["trace_ids"][i + 1:j + 1]) for ex in examples for i, j in ex["spans"]]
    assert [t for _, t in pairs] == truth
    assert all(1 <= len(p) <= len(t) for p, t in pairs) and m.training
    with pytest.raises(ValueError, match="recon_weight"):
        build(1).reconstruct(examples)


def test_recon_copy_is_a_trained_submodule_that_the_saved_model_leaves_out(tmp_path):
    tok = tiny_tokenizer()
    m = codi_model(tiny_base(vocab=len(tok)), token_ids(tok), 1, recon_weight=1.0, recon_decoder="copy",
                   latent_curriculum_frac=0.5, mix_explicit_prob=0.1, **W)
    assert m.recon_model is not None and m.recon_model is not m.model
    assert any(n.startswith("recon_model.") for n, _ in m.named_parameters())
    out = save_codi_model(m, tok, tmp_path / "codi")
    cfg = read_codi_config(out).options
    assert (cfg.recon_weight, cfg.recon_decoder, cfg.latent_curriculum_frac, cfg.mix_explicit_prob) == (1.0, "copy", 0.5, 0.1)
    assert (cfg.kd_norm, cfg.kd_positions) == ("none", "action_sep") and read_codi_config(out).options == m.options
    assert not any("recon" in f.name for f in out.iterdir())


def test_ss_ramp_and_rng_requirements():
    assert ss_ramp(0, 100, 0.8, 0.5) == 0.0
    assert ss_ramp(25, 100, 0.8, 0.5) == pytest.approx(0.4)
    assert ss_ramp(50, 100, 0.8, 0.5) == pytest.approx(0.8) == ss_ramp(90, 100, 0.8, 0.5)
    assert ss_ramp(3, 0, 0.5, 0.5) == 0.5  # max(1, .) guards a zero-length ramp
    m = build()
    with pytest.raises(ValueError, match="ss_rng"):
        m(batch(), ss_prob=0.5)
    with pytest.raises(ValueError, match="ss_prob"):
        m(batch(), ss_prob=1.5, ss_rng=random.Random(0))
    with pytest.raises(ValueError, match="ss_rng"):
        m(batch(), ss_prob=0.5, ss_rng=0)


def test_ss_draws_are_reproducible_and_consumed_in_order():
    m = build()
    ex = batch(frames=(2, 3))
    a = m(ex, ss_prob=0.5, ss_rng=random.Random(11))["loss"].item()
    assert m(ex, ss_prob=0.5, ss_rng=random.Random(11))["loss"].item() == a
    rng = random.Random(11)
    m(ex, ss_prob=0.5, ss_rng=rng)
    ref = random.Random(11)
    [ref.random() for _ in range(5)]  # one draw per post-latent segment: 2 + 3
    assert rng.random() == ref.random()
    untouched = random.Random(11)
    m(ex, ss_prob=0.0, ss_rng=untouched)
    assert untouched.random() == random.Random(11).random()


# -------------------------------------------------------------------------------- call counts
def count_body_calls(model, fn):
    calls = []
    handle = model.model.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        fn()
    finally:
        handle.remove()
    return len(calls)


@pytest.mark.parametrize("latent_steps", [1, 3])
def test_model_calls_do_not_grow_with_batch_size(latent_steps):
    m = build(latent_steps)
    small, big = batch(frames=(4, 1), seed=1), batch(frames=(2, 4, 1, 3, 4, 2, 1, 3), seed=2)
    expected = 1 + 1 + 4 * latent_steps  # teacher, round 0, per frame: latents (the last fused with the text)
    assert count_body_calls(m, lambda: m(small)) == expected
    assert count_body_calls(m, lambda: m(big)) == expected
    assert count_body_calls(m, lambda: oracle_forward(m, big)) > 2 * count_body_calls(m, lambda: oracle_forward(m, small))
    frozen = build(latent_steps, frozen_teacher=tiny_base(seed=4))
    assert count_body_calls(frozen, lambda: frozen(big)) == expected - 1


# --------------------------------------------------------------------------------- primitives
def test_latent_block_primitive_equals_reference_block():
    m = build(latent_steps=3).eval()
    prefixes = [[0, 20, 21, 1, 3], [0, 30, 31, 32, 33, 34, 35, 1, 2, 40, 6, 41, 1, 3], [0, 50, 1, 3]]
    n, width = len(prefixes), max(map(len, prefixes))
    ids = torch.full((n, width), TOKEN_IDS.pad)
    real = torch.zeros(n, width, dtype=torch.bool)
    for e, p in enumerate(prefixes):
        ids[e, :len(p)], real[e, :len(p)] = torch.tensor(p), True
    with torch.no_grad():
        rows = PaddedRows(m.body, n, "cpu")
        rows.step(m.embed(ids), real)
        active = torch.tensor([True, True, False])
        h = latent_block(rows, m.projector, m.model.get_input_embeddings(), TOKEN_IDS.latent_start,
                         TOKEN_IDS.latent_end, m.options.latent_steps, active, TOKEN_IDS.pad)
        logits = m.head(h)
        for e in range(2):
            torch.testing.assert_close(logits[e], oracle_latent_block(m, prefixes[e]), rtol=1e-5, atol=1e-6)
        assert torch.isfinite(logits).all()


def test_compaction_is_exact_and_shortens_the_cache():
    masks = [[[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]],
             [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]],
             [[1, 1, 0], [1, 0, 0], [1, 1, 1]]]

    def run(compact):
        torch.manual_seed(0)
        m = build()
        rows, outs, done = PaddedRows(m.body, 3, "cpu"), [], False
        for k, mk in enumerate(masks):
            real = torch.tensor(mk, dtype=torch.bool)
            if k == 2 and compact:
                done = rows.compact(min_saving=0.1)
                assert rows.length == 7  # the longest row holds 6 + 1 real slots of 10
            last, _ = rows.step(m.embed(torch.randint(12, 96, real.shape)), real)
            outs.append(last[real])
        out = torch.cat(outs)
        # A random linear readout: sum(h^2) of RMS-normalised hiddens is nearly constant (its gradient
        # would be mostly cancellation noise).
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        return done, torch.cat(outs), [p.grad.clone() for p in m.model.parameters()]

    done, out, grad = run(True)
    plain_done, out_plain, grad_plain = run(False)
    assert done and not plain_done
    torch.testing.assert_close(out, out_plain)
    for a, b in zip(grad, grad_plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()))


def test_padded_rows_requires_a_real_first_slot():
    m = build()
    rows = PaddedRows(m.body, 2, "cpu")
    with pytest.raises(ValueError, match="first block"):
        rows.step(m.embed(torch.tensor([[12, 13], [10, 14]])), torch.tensor([[True, True], [False, True]]))


def test_every_trainable_parameter_gets_a_finite_gradient():
    for kw in (dict(latent_steps=0), dict(), dict(kd_target="logit"), dict(frozen_teacher=tiny_base(seed=2))):
        m = build(**kw)
        m(batch(frames=(1, 4, 2)), ss_prob=0.5, ss_rng=random.Random(0))["loss"].backward()
        for name, p in m.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and torch.isfinite(p.grad).all(), (kw, name)


def test_student_ignores_global_activation_checkpointing_and_restores_it():
    m = build()
    ref = m(batch())["loss"].item()
    m.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert m(batch())["loss"].item() == pytest.approx(ref, rel=1e-6)
    assert m.model.is_activation_checkpointing
    m.model.activation_checkpointing_disable()
    with activation_checkpointing(m.model, True):
        assert m.model.is_activation_checkpointing
    assert not m.model.is_activation_checkpointing


def test_chunked_cross_entropy_equals_direct(monkeypatch):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(37, 8, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    direct = losses.token_ce(h, head, t)
    g_direct = torch.autograd.grad(direct.sum(), [h, head.weight])
    monkeypatch.setattr(losses, "CE_CHUNK_ELEMENTS", 50 * 5)
    chunked = losses.token_ce(h, head, t)
    g_chunked = torch.autograd.grad(chunked.sum(), [h, head.weight])
    torch.testing.assert_close(chunked, direct)
    for a, b in zip(g_chunked, g_direct):
        torch.testing.assert_close(a, b)


def test_bf16_runs_and_keeps_dtype():
    m = codi_model(tiny_base().to(torch.bfloat16), TOKEN_IDS, 2, **W)
    assert m.projector[0].weight.dtype == torch.bfloat16
    out = m(batch(frames=(2, 1)), ss_prob=1.0, ss_rng=random.Random(0))
    out["loss"].backward()
    assert all(torch.isfinite(v) for v in out.values())
    assert torch.isfinite(m.projector[0].weight.grad.float()).all()


def test_ddp_without_unused_parameters(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for kw in (dict(latent_steps=0), dict(latent_steps=1), dict(latent_steps=1, frozen_teacher=tiny_base(seed=3)),
                   dict(latent_steps=1, kd_target="logit")):
            ddp = DDP(build(**kw), find_unused_parameters=False)
            for step in range(2):  # an unused trainable parameter fails on the second step
                ddp(batch(frames=(1, 2), seed=step), ss_prob=0.5, ss_rng=random.Random(step))["loss"].backward()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------- save/load
def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(40)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    add_trace_tokens(tok)
    return tok


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_load_round_trip(tmp_path, tie):
    tok = tiny_tokenizer()
    ids = token_ids(tok)
    base = tiny_base(vocab=len(tok), tie=tie)
    m = codi_model(base, ids, 2, kd_layers=[-1], single_anchor=True, **W)
    with torch.no_grad():  # make sure a trained (non-initial) projector is what gets saved
        for p in m.projector.parameters():
            p.add_(0.01)
    out = save_codi_model(m, tok, tmp_path / "codi", extra={"step": 12, "val_loss": 1.5})
    assert (out / "thought_projector.safetensors").is_file() and (out / "codi_config.json").is_file()
    assert any(out.glob("*.safetensors")) and not any(out.glob("*.bin"))
    loaded = load_codi_model(out)
    x = torch.tensor([[ids.trace_context_start, 5, 6, ids.frame_sep, ids.line_sep]])
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=x).logits, base(input_ids=x).logits, rtol=0, atol=0)
        h = torch.randn(3, base.config.hidden_size)
        torch.testing.assert_close(loaded.projector(h), m.projector(h), rtol=0, atol=0)
    tied = loaded.model.lm_head.weight.data_ptr() == loaded.model.get_input_embeddings().weight.data_ptr()
    assert tied == tie
    cfg = loaded.config
    assert (cfg.options.latent_steps, cfg.options.kd_layers, cfg.options.single_anchor, cfg.token_ids) == (2, [-1], True, ids)
    assert cfg.options == m.options and cfg.weights == m.weights
    assert cfg.extra == {"step": 12, "val_loss": 1.5} and read_codi_config(out) == cfg
    assert not loaded.model.training
    bf = load_codi_model(out, dtype=torch.bfloat16)
    assert bf.model.dtype == torch.bfloat16 and bf.projector[0].weight.dtype == torch.bfloat16


def test_save_and_load_errors(tmp_path):
    tok = tiny_tokenizer()
    m = codi_model(tiny_base(vocab=len(tok)), token_ids(tok), 1, **W)
    with pytest.raises(ValueError, match="JSON-serializable"):
        save_codi_model(m, tok, tmp_path / "a", extra={"x": object()})
    with pytest.raises(ValueError, match="token ids differ"):
        save_codi_model(build(), tok, tmp_path / "b")
    with pytest.raises(ValueError, match="codi_config.json"):
        load_codi_model(tmp_path / "missing")


SAVED = Path(__file__).resolve().parents[1] / "fixtures" / "codi_config"   # as earlier versions wrote them
V2_OPTIONS = dict(kd_layers=[-1], kd_norm="teacher_std", kd_positions="action_line", recon_weight=0.5,
                  latent_curriculum_frac=0.25, mix_explicit_prob=0.1)
V3_OPTIONS = dict(V2_OPTIONS, projector_dropout=0.1)


def test_the_saved_config_is_the_committed_format_byte_for_byte(tmp_path):
    """codi_config.json is part of models/codi's digest in dvc.lock: the writer must not drift."""
    tok = tiny_tokenizer()
    m = codi_model(tiny_base(vocab=len(tok)), token_ids(tok), 2, kd_weight=0.5, **V3_OPTIONS)
    out = save_codi_model(m, tok, tmp_path / "c", extra={"step": 12})
    assert (out / "codi_config.json").read_bytes() == (SAVED / "v7.json").read_bytes()


@pytest.mark.parametrize("version, options", [
    ("v1", dict(kd_layers=[-1])),       # before kd_norm, kd_positions, recon_*, the curriculum: the reference's
    ("v2", V2_OPTIONS),                 # before projector_dropout: none
    ("v3", V3_OPTIONS),                 # before the value options (research IV): off
    ("v4", V3_OPTIONS),                 # before latent_unit (research VI): locals
    ("v5", V3_OPTIONS),                 # before latent_call (research VI): the call frame is text
    ("v6", V3_OPTIONS),                 # before unit_stage_steps (research VI): no unit curriculum
    ("v7", V3_OPTIONS),
])
def test_a_folder_saved_by_an_earlier_version_loads(tmp_path, version, options):
    import shutil

    tok = tiny_tokenizer()
    out = save_codi_model(codi_model(tiny_base(vocab=len(tok)), token_ids(tok), 2, **W), tok, tmp_path / "c")
    shutil.copy(SAVED / f"{version}.json", out / "codi_config.json")
    loaded = load_codi_model(out)
    assert loaded.config.options == codi_model(tiny_base(vocab=len(tok)), token_ids(tok), 2, **options).options
    assert (loaded.config.weights.kd_weight, loaded.config.extra) == (0.5, {"step": 12})


def test_a_saved_option_this_version_does_not_know_is_refused(tmp_path):
    import json
    tok = tiny_tokenizer()
    out = save_codi_model(codi_model(tiny_base(vocab=len(tok)), token_ids(tok), 1, **W), tok, tmp_path / "c")
    path = out / "codi_config.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "latent_dropout": 0.1}))
    with pytest.raises(ValueError, match="unknown option 'latent_dropout'"):
        load_codi_model(out)
    path.write_text(json.dumps({**raw, "kd_norm": "layer_std"}))
    with pytest.raises(ValueError, match="kd_norm = 'layer_std'"):
        load_codi_model(out)
    v1 = {k: v for k, v in raw.items() if k not in ("kd_norm", "kd_positions", "recon_weight", "recon_decoder",
                                                     "latent_curriculum_frac", "mix_explicit_prob")}
    path.write_text(json.dumps({**v1, "format_version": 1}))  # an older folder: the reference's behaviour
    assert read_codi_config(out).options.kd_norm == "none" and read_codi_config(out).options.recon_weight == 0.0


def test_projector_dropout_acts_in_training_only_and_keeps_the_weight_keys(tmp_path):
    """CODI's prj_dropout: on the projector's input in training mode; the weights keep the keys of a projector
    without it, so folders load either way; at 0 the projector is exactly the reference's (no dropout module)."""
    tok = tiny_tokenizer()
    plain = codi_model(tiny_base(vocab=len(tok)), token_ids(tok), 2, **W)
    drop = codi_model(tiny_base(vocab=len(tok)), token_ids(tok), 2, projector_dropout=0.5, **W)
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.projector.modules())
    assert list(drop.projector.state_dict()) == list(plain.projector.state_dict())
    h = torch.randn(64, plain.model.config.hidden_size)
    drop.projector.train()
    torch.manual_seed(0)
    a = drop.projector(h)
    torch.manual_seed(1)
    assert not torch.equal(a, drop.projector(h))   # a fresh mask per call in training
    drop.projector.eval()
    torch.testing.assert_close(drop.projector(h), drop.projector(h), rtol=0, atol=0)
    loaded = load_codi_model(save_codi_model(drop, tok, tmp_path / "c"))
    assert loaded.config.options.projector_dropout == 0.5 and not loaded.projector.training
    torch.testing.assert_close(loaded.projector(h), drop.projector(h), rtol=0, atol=0)


def test_the_identity_projector_passes_the_hidden_state_through_gelu_and_layernorm():
    """codi.projector_init = identity (research V): the latent starts as LayerNorm(GELU(h)); setting it draws no
    random number, so every later draw of the run is the default init's."""
    from codi.modeling.latent import build_projector, identity_projector_

    torch.manual_seed(0)
    default = build_projector(8, dtype=torch.float32, device="cpu")
    after_default = torch.random.get_rng_state()
    torch.manual_seed(0)
    prj = identity_projector_(build_projector(8, dtype=torch.float32, device="cpu"))
    assert torch.equal(torch.random.get_rng_state(), after_default)
    h = torch.randn(3, 8)
    expected = torch.nn.functional.layer_norm(torch.nn.functional.gelu(h), (8,))
    assert torch.allclose(prj(h), expected, atol=1e-6)
    assert not torch.allclose(default(h), expected, atol=1e-3)

