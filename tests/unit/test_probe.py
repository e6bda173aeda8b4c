"""codi.evaluation.probe: the linear probe and logit lens read what a block holds; the ablation says what the latents carry."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from codi.data.values import AssignedValue
from codi.evaluation.decoding import decode, mean_latent
from codi.evaluation.probe import (
    ProbeBlocks,
    ablation_summary,
    collect_blocks,
    diagnosis,
    fit_linear_probe,
    logit_lens,
    probe_report,
)
from codi.modeling.latent import build_projector
from tests.codi_oracle import TOKEN_IDS, codi_model, make_example, tiny_base

torch.set_num_threads(1)


def blocks(n: int, signal: float, seed: int = 0, classes=(20, 21, 22, 23)) -> ProbeBlocks:
    """Blocks [n, 3, 8] whose position 1 holds a class direction scaled by `signal`, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.choice(classes, size=n)
    states = rng.normal(size=(n, 3, 8)).astype(np.float32)
    for k, lab in enumerate(labels):
        states[k, 1, classes.index(lab)] += signal
    kinds = ["copy" if k % 2 else "computed" for k in range(n)]
    return ProbeBlocks(states, labels.astype(np.int64), kinds, np.arange(n) % 3, [f"p{k // 2}" for k in range(n)])


def test_the_linear_probe_reads_a_value_that_is_there_and_not_one_that_is_not():
    strong = fit_linear_probe(blocks(400, 4.0))
    held = blocks(200, 4.0, seed=1)
    assert (strong.predict(held) == held.labels).mean() > 0.9
    none = fit_linear_probe(blocks(400, 0.0))
    held = blocks(400, 0.0, seed=1)
    assert (none.predict(held) == held.labels).mean() < 0.4  # four classes: chance is 0.25


def test_logit_lens_reads_each_position_through_the_head_over_value_tokens_only():
    head = torch.zeros(30, 8)
    for c, tok in enumerate((20, 21, 22, 23)):
        head[tok, c] = 1.0
    head[5] = 100.0  # a non-value token with the largest logit everywhere: never chosen
    b = blocks(100, 10.0)
    pred = logit_lens(b, head, (20, 21, 22, 23))
    assert pred.shape == (100, 3)
    assert (pred[:, 1] == b.labels).mean() > 0.95 and set(pred.ravel()) <= {20, 21, 22, 23}


def test_probe_report_has_each_reader_per_kind_and_frame():
    head = torch.randn(30, 8)
    rep = probe_report(blocks(300, 4.0), {"val": blocks(90, 4.0, seed=2)}, head)
    v = rep["val"]
    assert rep["train_blocks"] == 300 and v["blocks"] == 90 and v["kinds"] == {"computed": 45, "copy": 45}
    assert v["linear"]["all"] > v["majority"]["all"] + 0.3
    assert set(v["linear"]["by_frame"]) == {"1", "2", "3"} and set(v["lens"]) == {"position_0", "position_1",
                                                                                 "position_2"}
    assert diagnosis(v, None).startswith("value decodable")
    flat = probe_report(blocks(300, 0.0), {"val": blocks(90, 0.0, seed=2)}, head)["val"]
    assert diagnosis(flat, None).startswith("value not decodable")


def rows(correct, mode):
    return [{"id": f"e{k}", "problem_id": f"p{k // 2}", "correct": c, "mode": mode} for k, c in enumerate(correct)]


def test_ablation_summary_measures_what_the_latents_carry():
    latent = rows([1] * 60 + [0] * 40, "latent")
    direct = rows([1] * 20 + [0] * 80, "direct")
    kept = rows([1] * 25 + [0] * 75, "latent")      # constant latents lose nearly all the lead
    a = ablation_summary(latent, kept, direct, 500, 0, 0.95)
    assert (a["latent_accuracy"], a["ablated_accuracy"], a["direct_accuracy"]) == (0.6, 0.25, 0.2)
    assert a["carried"] == 0.35 and a["kept_share"] == pytest.approx(0.125) and a["latents_carry_gain"]
    assert a["carried_ci"][0] > 0
    same = ablation_summary(latent, rows([1] * 60 + [0] * 40, "latent"), direct, 500, 0, 0.95)
    assert same["carried"] == 0 and same["kept_share"] == 1.0 and not same["latents_carry_gain"]
    assert "do not carry" in diagnosis(None, same)
    with pytest.raises(ValueError, match="same examples"):
        ablation_summary(latent, kept[1:], direct, 500, 0, 0.95)


def test_constant_latents_make_decoding_blind_to_the_projector():
    """latent_override replaces every latent input: two different projectors then decode the same thing."""
    base = tiny_base()
    # every other greedy token is <|line_sep|>, so every other block is latent: the latents then steer the rest
    calls = []

    def every_other_line_sep(module, args, out):
        calls.append(1)
        return out + (len(calls) % 2) * 50.0 * torch.nn.functional.one_hot(
            torch.tensor(TOKEN_IDS.line_sep), out.shape[-1]).to(out.dtype)

    base.get_output_embeddings().register_forward_hook(every_other_line_sep)
    tok = _Tok()
    prompts = [make_example(random.Random(s), 2)["prompt_ids"] for s in range(3)]
    torch.manual_seed(0)
    p1, p2 = (build_projector(32, dtype=torch.float32, device="cpu") for _ in range(2))
    kw = dict(latent_steps=2, max_new_tokens=40, max_frames=6, ids=TOKEN_IDS)
    plain = [decode("latent", base, tok, prompts, projector=p, **kw) for p in (p1, p2)]
    assert all(r.latent_count > 0 for r in plain[0])
    assert [r.ids for r in plain[0]] != [r.ids for r in plain[1]]  # the projector matters as trained
    const = mean_latent(plain[0])
    assert const.shape == (32,)
    calls.clear()
    a = decode("latent", base, tok, prompts, projector=p1, latent_override=const, **kw)
    calls.clear()
    b = decode("latent", base, tok, prompts, projector=p2, latent_override=const, **kw)
    assert [r.ids for r in a] == [r.ids for r in b]  # constant latents: blind to it


def test_collect_blocks_keeps_the_frames_with_a_value():
    m = codi_model(tiny_base(), TOKEN_IDS, 2, teacher_ce_weight=1.0, student_ce_weight=1.0, kd_weight=1.0)
    exs = [make_example(random.Random(s), 3) | {"problem_id": f"p{s}"} for s in range(2)]
    slots = [[None, AssignedValue("b", "3", ex["spans"][1][0] + 1, "copy"),
              AssignedValue("b", "4", ex["spans"][2][0] + 1, "computed")] for ex in exs]
    got = collect_blocks(m, exs, slots, batch_size=1)
    assert got.states.shape == (4, 3, 32) and list(got.frame_index) == [1, 2, 1, 2]
    assert list(got.labels) == [ex["trace_ids"][s.pos] for ex, sl in zip(exs, slots) for s in sl if s is not None]


class _Tok:
    """The few tokenizer methods decoding uses, over the oracle's token ids."""

    def __len__(self) -> int:
        return 96

    def decode(self, ids, **kw) -> str:
        return " ".join(f"t{i}" for i in ids)
