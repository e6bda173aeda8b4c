"""codi.evaluation.decoding: explicit / latent / direct greedy decoding on tiny Qwen2 models.

Two models: a random one (numerics of batching and caching), and one overfit here in a few seconds
on four hand-written traces (explicit and latent sequences) and two direct targets, so that all three
modes produce well-formed output to check. Its projector is the real architecture with the
LayerNorm's weight at 0, so every latent is the LayerNorm's bias: a constant the teacher-forced
training can learn in one parallel pass.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from codi.data.answers import answers_match, direct_target_ids
from codi.evaluation.decoding import (
    LATENT,
    LATENT_TEXT,
    DecodeResult,
    build_action_trie,
    decode,
    iter_decode,
    latent_statistics,
    parse_generation,
    program_action_lines,
    true_action_lines,
)
from codi.evaluation.metrics import score_example
from codi.tracing.format import Frame, actions, encode_value, exit_kind, render_frame, render_prompt, render_trace
from codi.tracing.tokens import ACTION_SEP, EOS, FRAME_SEP, PAD, TRACE_TOKENS, add_trace_tokens, token_ids

LATENT_STEPS = 2


def _f(kind, line, locals_=None, value=None):
    return Frame(kind, line, locals=locals_, value=value)


PROGRAMS = [
    ("def f(a, b):\n    y = a + b\n    return y * 2\n", "f(1, 2)", [
        _f("call", "def f(a, b):\n", '{"a": "1", "b": "2"}'),
        _f("line", "    y = a + b\n", '{"a": "..", "b": ".."}'),
        _f("line", "    return y * 2\n", '{"a": "..", "b": "..", "y": "3"}'),
        _f("return", "    return y * 2\n", value='"6"'),
    ]),
    ("def g(n):\n    s = 0\n    for i in range(n):\n        s += i\n    return s\n", "g(2)", [
        _f("call", "def g(n):\n", '{"n": "2"}'),
        _f("line", "    s = 0\n", '{"n": ".."}'),
        _f("line", "    for i in range(n):\n", '{"n": "..", "s": "0"}'),
        _f("line", "        s += i\n", '{"n": "..", "s": "..", "i": "0"}'),
        _f("line", "    for i in range(n):\n", '{"n": "..", "s": "..", "i": ".."}'),
        _f("line", "        s += i\n", '{"n": "..", "s": "..", "i": "1"}'),
        _f("line", "    for i in range(n):\n", '{"n": "..", "s": "1", "i": ".."}'),
        _f("line", "    return s\n", '{"n": "..", "s": "..", "i": ".."}'),
        _f("return", "    return s\n", value='"1"'),
    ]),
    ("def h(x):\n    return x.upper()\n\ndef k(s):\n    t = h(s)\n    return t + '!'\n", "k('ab')", [
        _f("call", "def k(s):\n", '{"s": "\'ab\'"}'),
        _f("line", "    t = h(s)\n", '{"s": ".."}'),
        _f("call", "def h(x):\n", '{"x": "\'ab\'"}'),
        _f("line", "    return x.upper()\n", '{"x": ".."}'),
        _f("return", "    return x.upper()\n", value='"\'AB\'"'),
        _f("line", "    return t + '!'\n", '{"s": "..", "t": "\'AB\'"}'),
        _f("return", "    return t + '!'\n", value='"\'AB!\'"'),
    ]),
    ("def d(a):\n    return 6 // a\n", "d(0)", [
        _f("call", "def d(a):\n", '{"a": "0"}'),
        _f("line", "    return 6 // a\n", '{"a": ".."}'),
        _f("exception", "    return 6 // a\n", value=encode_value("ZeroDivisionError('integer division or modulo by zero')")),
        _f("return", "    return 6 // a\n", value=encode_value("ZeroDivisionError('integer division or modulo by zero')")),
    ]),
]
# The no-trace baseline's examples: a prompt and the answer right after it.
DIRECT = [("def f(a, b):\n    y = a + b\n    return y * 2\n", "f(2, 5)", "14"),
          ("def h(x):\n    return x.upper()\n\ndef k(s):\n    t = h(s)\n    return t + '!'\n", "k('xy')", "'XY!'")]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [render_prompt(p, c) + render_trace(fr) for p, c, fr in PROGRAMS] + [render_prompt(p, c) for p, c, _ in DIRECT]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=[*TRACE_TOKENS, PAD, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False)
    add_trace_tokens(tok)
    return tok


def _encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _projector(h: int, seed: int, constant: bool) -> nn.Module:
    torch.manual_seed(seed)
    prj = nn.Sequential(nn.Linear(h, h, bias=False), nn.GELU(), nn.Linear(h, h, bias=False), nn.LayerNorm(h))
    if constant:
        with torch.no_grad():
            prj[3].weight.zero_()  # output = LayerNorm bias, whatever the hidden state
            prj[3].bias.normal_()
    return prj


def _model(tok, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return Qwen2ForCausalLM(cfg).eval()


def _sequences(tok, t):
    """Training items per example: (ids with LATENT at latent inputs, targets: -100 where not trained)."""
    seqs = []
    for program, call, frames in PROGRAMS:
        prompt = _encode(tok, render_prompt(program, call))
        explicit, student = [], []
        for fr in frames:
            if fr.kind == "line":
                head = [t.line_sep]
                rest = _encode(tok, f"{ACTION_SEP}{fr.source_line}{FRAME_SEP}")
                explicit += head + _encode(tok, fr.locals) + rest
                student += head + [t.latent_start] + [LATENT] * LATENT_STEPS + [t.latent_end] + rest
            else:
                explicit += _encode(tok, render_frame(fr))
                student += _encode(tok, render_frame(fr))
        forced = {t.latent_start, LATENT, t.latent_end}  # fed by the decoder, never predicted
        for trace in (explicit + [t.eos], student + [t.eos]):
            # The target of position p is item p + 1; the prompt is context only.
            targets = [-100] * (len(prompt) - 1) + [-100 if x in forced else x for x in trace] + [-100]
            seqs.append((prompt + trace, targets))
    for program, call, answer in DIRECT:
        prompt = _encode(tok, render_prompt(program, call))
        target = direct_target_ids(tok, answer)
        seqs.append((prompt + target, [-100] * (len(prompt) - 1) + target + [-100]))
    return seqs


def _train(tok, model, prj, steps=150):
    t = token_ids(tok)
    seqs = _sequences(tok, t)
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), width), t.pad)
    tgt = torch.full((len(seqs), width), -100)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, (s, y) in enumerate(seqs):
        ids[b, :len(s)], tgt[b, :len(y)], mask[b, :len(s)] = torch.tensor(s), torch.tensor(y), 1
    latent = ids == LATENT
    ids = ids.clamp(min=0)
    params = list(model.parameters()) + [prj[3].bias]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        emb = model.get_input_embeddings()(ids)
        emb = torch.where(latent[..., None], prj[3].bias.expand_as(emb), emb)
        logits = model(inputs_embeds=emb, attention_mask=mask).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    tok = _tokenizer()
    t = token_ids(tok)
    trained, prj = _model(tok, 0), _projector(64, 0, constant=True)
    loss = _train(tok, trained, prj)
    prompts = [_encode(tok, render_prompt(p, c)) for p, c, _ in PROGRAMS]
    direct_prompts = [_encode(tok, render_prompt(p, c)) for p, c, _ in DIRECT]
    random_model = _model(tok, 1)
    with torch.no_grad():  # make <|line_sep|> a likely choice, so latent blocks occur mid-generation
        hidden = torch.cat([random_model.model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts])
        random_model.lm_head.weight[t.line_sep] = 0.2 * hidden.mean(0)
    return dict(tok=tok, t=t, trained=trained, prj=prj, loss=loss, random=random_model,
                prompts=prompts, direct_prompts=direct_prompts)


def _truth_answer(frames):
    return frames[-1].value_repr()


def _same(a: DecodeResult, b: DecodeResult) -> bool:
    return (a.ids, a.text, a.frames, a.answer, a.stop, a.error, a.latent_blocks) == \
        (b.ids, b.text, b.frames, b.answer, b.stop, b.error, b.latent_blocks)


# ----------------------------------------------------------------------------- well-formed decoding
def test_explicit_reproduces_the_trained_traces(setup):
    assert setup["loss"] < 0.05  # the fixture really learned its traces
    results = decode("explicit", setup["trained"], setup["tok"], setup["prompts"], max_new_tokens=400, max_frames=64)
    for r, (_, _, frames) in zip(results, PROGRAMS):
        assert (r.stop, r.error) == ("entry_exit", "")
        assert r.frames == frames
        assert r.answer == _truth_answer(frames) and r.answer_kind == exit_kind(frames, frames[-1])
        assert r.text == render_trace(frames)  # stops right after the exit frame: no eos
        assert r.positions == len(r.ids) == len(_encode(setup["tok"], r.text))
        assert r.latent_blocks == 0 and LATENT not in r.ids
        assert r.time_s > 0
    assert results[3].answer_kind == "exception"


def test_latent_block_at_every_generated_line_frame_and_nowhere_else(setup):
    t = setup["t"]
    results = decode("latent", setup["trained"], setup["tok"], setup["prompts"], projector=setup["prj"],
                     latent_steps=LATENT_STEPS, max_new_tokens=400, max_frames=64)
    block = [t.latent_start] + [LATENT] * LATENT_STEPS + [t.latent_end]
    for r, (_, _, frames) in zip(results, PROGRAMS):
        assert (r.stop, r.error) == ("entry_exit", ""), r.text
        assert actions(r.frames) == actions(frames) and r.answer == _truth_answer(frames)
        n_lines = sum(f.kind == "line" for f in frames)
        assert r.latent_blocks == n_lines == r.ids.count(t.line_sep) == r.ids.count(t.latent_start)
        assert r.ids.count(LATENT) == LATENT_STEPS * n_lines and r.ids.count(t.latent_end) == n_lines
        for k, i in enumerate(r.ids):
            if i == t.line_sep:  # the block right after, then the model's own <|action_sep|>
                assert r.ids[k + 1:k + 1 + len(block)] == block
                assert r.ids[k + 1 + len(block)] == t.action_sep
        assert all(f.locals is None for f in r.frames if f.kind == "line")
        assert all(f.locals == g.locals for f, g in zip(r.frames, frames) if f.kind != "line")
        assert r.text.count(LATENT_TEXT) == LATENT_STEPS * n_lines
        # Latent positions = explicit positions - locals tokens + block positions.
        locals_tokens = sum(len(_encode(setup["tok"], f.locals)) for f in frames if f.kind == "line")
        explicit_positions = len(_encode(setup["tok"], render_trace(frames)))
        assert r.positions == explicit_positions - locals_tokens + n_lines * len(block)


def test_latent_inputs_are_the_projected_previous_hidden_state(setup):
    """Decode with a real (input-dependent) projector, then recompute the whole sequence in one
    uncached forward: every latent fed = projector(hidden at the previous position), and every
    token the model chose = argmax of the uncached logits."""
    model, tok, t = setup["trained"], setup["tok"], setup["t"]
    prj = _projector(64, 3, constant=False)
    seen_in, seen_out = [], []

    def recording(h):
        out = prj(h)
        seen_in.append(h.clone())
        seen_out.append(out.clone())
        return out

    prompt = setup["prompts"][0]
    (r,) = decode("latent", model, tok, [prompt], projector=recording, latent_steps=LATENT_STEPS, max_new_tokens=60)
    assert r.latent_blocks >= 1
    items = prompt + r.ids
    lat_pos = [k for k, i in enumerate(items) if i == LATENT]
    assert len(lat_pos) == len(seen_out)
    with torch.no_grad():
        emb = model.get_input_embeddings()(torch.tensor([max(i, 0) for i in items])[None]).clone()
        for p, v in zip(lat_pos, seen_out):
            emb[0, p] = v[0, 0]
        hidden = model.model(inputs_embeds=emb).last_hidden_state[0]
        logits = model.lm_head(hidden)
    for p, h in zip(lat_pos, seen_in):
        assert torch.allclose(hidden[p - 1], h[0, 0], atol=1e-4)
    forced = set()
    for k, i in enumerate(items):
        if i == t.line_sep and k >= len(prompt):
            forced.update(range(k + 1, k + 3 + LATENT_STEPS))
    for k in range(len(prompt), len(items)):
        if k not in forced:
            assert logits[k - 1].argmax().item() == items[k]


def test_direct_decodes_the_trained_answers(setup):
    results = decode("direct", setup["trained"], setup["tok"], setup["direct_prompts"], max_new_tokens=40)
    for r, (_, _, answer) in zip(results, DIRECT):
        assert (r.stop, r.error, r.answer, r.frames) == ("eos", "", answer, [])
        assert r.ids == direct_target_ids(setup["tok"], answer)


# ------------------------------------------------------------------------------ batched == single
@pytest.mark.parametrize("mode", ["explicit", "latent", "direct"])
@pytest.mark.parametrize("which", ["trained", "random"])
def test_batched_equals_one_at_a_time(setup, mode, which):
    model = setup[which]
    prompts = setup["prompts"] + setup["direct_prompts"]
    assert len({len(p) for p in prompts}) >= 4  # mixed lengths: left padding differs per row
    kw = dict(projector=_projector(64, 5, constant=False), latent_steps=LATENT_STEPS,
              max_new_tokens=120 if which == "trained" else 40, max_frames=64)
    batched = decode(mode, model, setup["tok"], prompts, **kw)
    for p, b in zip(prompts, batched):
        (single,) = decode(mode, model, setup["tok"], [p], **kw)
        assert _same(b, single)
        assert b.positions == single.positions
    if mode == "latent":
        assert sum(r.latent_blocks for r in batched) > len(prompts)
    if which == "trained":  # rows finished at different steps: the batch shrank while decoding
        assert len({r.positions for r in batched}) > 1


def test_iter_decode_batches_in_order_with_progress(setup, capsys):
    prompts = setup["prompts"] + setup["direct_prompts"]
    kw = dict(max_new_tokens=30, max_frames=8)
    whole = decode("explicit", setup["trained"], setup["tok"], prompts, **kw)
    parts = list(iter_decode("explicit", setup["trained"], setup["tok"], prompts, batch_size=4, progress=True, **kw))
    assert len(parts) == len(prompts) and all(_same(a, b) for a, b in zip(whole, parts))
    assert "decode explicit" in capsys.readouterr().err
    assert list(iter_decode("direct", setup["trained"], setup["tok"], [], batch_size=2)) == []


# ------------------------------------------------------------------------------------------- caps
def test_max_new_tokens_stops_with_reason(setup):
    for mode in ("explicit", "latent", "direct"):
        prompts = setup["direct_prompts"] if mode == "direct" else setup["prompts"]
        results = decode(mode, setup["trained"], setup["tok"], prompts, projector=setup["prj"],
                         latent_steps=LATENT_STEPS, max_new_tokens=5)
        for r in results:
            assert (r.stop, r.positions, r.answer) == ("max_new_tokens", 5, None)
            assert r.error in ("no entry return frame (stopped by max_new_tokens)", "no eos before max_new_tokens")


def test_cap_inside_a_latent_block_counts_latents_as_positions(setup):
    t = setup["t"]
    (full,) = decode("latent", setup["trained"], setup["tok"], setup["prompts"][:1], projector=setup["prj"],
                     latent_steps=LATENT_STEPS, max_new_tokens=400)
    first_latent = full.ids.index(LATENT)
    (cut,) = decode("latent", setup["trained"], setup["tok"], setup["prompts"][:1], projector=setup["prj"],
                    latent_steps=LATENT_STEPS, max_new_tokens=first_latent + 1)
    assert cut.ids == full.ids[:first_latent + 1] and cut.ids[-1] == LATENT and cut.ids[-2] == t.latent_start
    assert (cut.stop, cut.positions, cut.latent_blocks) == ("max_new_tokens", first_latent + 1, 1)


def test_max_frames_stops_with_reason(setup):
    results = decode("explicit", setup["trained"], setup["tok"], setup["prompts"], max_new_tokens=400, max_frames=2)
    for r, (_, _, frames) in zip(results, PROGRAMS):
        assert (r.stop, r.answer) == ("max_frames", None) and r.frames == frames[:2]
        assert r.error == "no entry return frame (stopped by max_frames)"
        assert r.ids[-1] == setup["t"].frame_sep


def test_eos_stops_explicit_decoding(setup):
    # The trained model answers the direct prompts in the direct format: in explicit mode that is
    # a frame without a marker, then eos.
    results = decode("explicit", setup["trained"], setup["tok"], setup["direct_prompts"], max_new_tokens=60)
    for r in results:
        assert r.stop == "eos" and r.answer is None
        assert r.error == "no entry return frame (stopped by eos)"


# -------------------------------------------------------------------------------------- malformed
def _gen(setup, *pieces):
    """Generated ids from text pieces and raw ids (ints)."""
    out = []
    for p in pieces:
        out += [p] if isinstance(p, int) else _encode(setup["tok"], p)
    return out


def test_frame_unit_parses_a_latent_block_that_closes_its_frame(setup):
    """codi.latent_unit frame: `<|line_sep|>` block `<|frame_sep|>` is a LINE frame with no locals and no line; a
    block followed by anything else is malformed, and so is the locals unit's shape."""
    tok, t = setup["tok"], setup["t"]
    good_call = '<|call_sep|>{"a": "1"}<|action_sep|>def f(a):\n<|frame_sep|>'
    block = [t.latent_start] + [LATENT] * LATENT_STEPS + [t.latent_end]
    ret = '<|return_sep|><|action_sep|>    return a\n<|arg_sep|>"1"<|frame_sep|>'
    ids = _gen(setup, good_call, t.line_sep, *block, t.frame_sep, ret)
    text, frames, answer, kind, error = parse_generation("latent", ids, tok, t, "entry_exit", LATENT_STEPS, "frame")
    assert (answer, kind, error) == ("1", "return", "")
    assert frames[1] == Frame("line", None, locals=None) and [f.kind for f in frames] == ["call", "line", "return"]
    assert LATENT_TEXT in text
    locals_shape = _gen(setup, good_call, t.line_sep, *block, "<|action_sep|>    return a\n<|frame_sep|>", ret)
    out = parse_generation("latent", locals_shape, tok, t, "entry_exit", LATENT_STEPS, "frame")
    assert out[2] is None and "frame 1: latent block followed by '<|action_sep|>', not <|frame_sep|>" in out[4]
    assert parse_generation("latent", ids, tok, t, "entry_exit", LATENT_STEPS)[4].startswith(
        "malformed: frame 1: latent block followed by")  # the locals unit wants <|action_sep|> there
    open_frame = _gen(setup, good_call, t.line_sep, *block, "    return a")
    out = parse_generation("latent", open_frame, tok, t, "max_new_tokens", LATENT_STEPS, "frame")
    assert "latent block followed by" in out[4]


def test_frame_unit_decoding_marks_its_lines_latent(setup):
    tok = setup["tok"]
    args = dict(projector=_projector(64, 0, constant=False), latent_steps=LATENT_STEPS, max_new_tokens=40)
    frame = decode("latent", setup["random"], tok, setup["prompts"][:2], latent_unit="frame", **args)
    plain = decode("latent", setup["random"], tok, setup["prompts"][:2], **args)
    assert [r.latent_lines for r in frame] == [True, True] and not any(r.latent_lines for r in plain)
    assert [r.ids for r in frame] == [r.ids for r in plain]  # the decoder forces the same blocks; parsing differs
    with pytest.raises(ValueError, match="latent_unit"):
        decode("latent", setup["random"], tok, setup["prompts"][:1], latent_unit="line", **args)


def test_malformed_generations_are_returned_with_a_reason(setup):
    tok, t = setup["tok"], setup["t"]
    good_call = '<|call_sep|>{"a": "1"}<|action_sep|>def f(a):\n<|frame_sep|>'
    cases = {
        "explicit": [
            (good_call + '<|line_sep|>{"a": 1<|action_sep|>    return a\n<|frame_sep|>', "frame 1: locals are not JSON"),
            (good_call + '<|return_sep|><|action_sep|>    return a\n<|arg_sep|>1"<|frame_sep|>', "frame 1: value is not JSON"),
            (good_call + '<|return_sep|><|action_sep|>    return a\n<|arg_sep|>["1"]<|frame_sep|>', "frame 1: value is not a JSON string"),
            ('{"a": "1"}<|action_sep|>def f(a):\n<|frame_sep|>', "frame 0: does not start with a frame marker"),
            (good_call + '<|line_sep|>{}<|latent_start|><|action_sep|>x\n<|frame_sep|>', "frame 1: locals are not JSON"),
            (good_call + '<|line_sep|>' + "[" * 5000 + '<|action_sep|>x\n<|frame_sep|>', "frame 1: JSON nested too deep"),
        ],
    }
    for text, why in cases["explicit"]:
        ids = _gen(setup, text)
        out = parse_generation("explicit", ids, tok, t, "entry_exit")
        assert out[2] is None and why in out[4], (text, out[4])
        assert out[0] == text
    block = [t.latent_start] + [LATENT] * LATENT_STEPS + [t.latent_end]
    latent_cases = [
        (_gen(setup, good_call, t.line_sep, *block, '{"a": ".."}<|action_sep|>    return a\n<|frame_sep|>'),
         "frame 1: latent block followed by '{"),
        (_gen(setup, '<|call_sep|>{"a": "1"}', t.line_sep, *block, "<|action_sep|>def f(a):\n<|frame_sep|>"),
         "frame 0: a latent block outside a LINE frame's start"),
        (_gen(setup, good_call, t.line_sep, *block, "<|action_sep|>    return a\n<|arg_sep|><|frame_sep|>"),
         "frame 1: unexpected separator"),
        (_gen(setup, good_call, t.line_sep, *block, "    return a"),  # violation in the open last frame
         "latent block followed by"),
    ]
    for ids, why in latent_cases:
        text, frames, answer, _, error = parse_generation("latent", ids, tok, t, "max_new_tokens", LATENT_STEPS)
        assert answer is None and why in error, error
        assert frames == ([] if why.startswith("frame 0") else [Frame("call", "def f(a):\n", locals='{"a": "1"}')])
        assert LATENT_TEXT in text
    for text, why in [('"6"', "does not start with <|arg_sep|>"), ("<|arg_sep|>6", "not a JSON string"),
                      ('<|arg_sep|>"6', "not JSON")]:
        out = parse_generation("direct", _gen(setup, text, t.eos), tok, t, "eos")
        assert out[2] is None and why in out[4]
    out = parse_generation("direct", _gen(setup, '<|arg_sep|>"6"'), tok, t, "max_new_tokens")
    assert (out[2], out[4]) == (None, "no eos before max_new_tokens")


def test_random_model_output_is_scored_wrong_not_raised(setup):
    frames = PROGRAMS[0][2]
    for mode in ("explicit", "latent", "direct"):
        results = decode(mode, setup["random"], setup["tok"], setup["prompts"], projector=setup["prj"],
                         latent_steps=LATENT_STEPS, max_new_tokens=50, max_frames=4)
        for r in results:
            assert r.error and r.answer is None
            row = score_example(r, frames)
            assert row["correct"] is False and row["reason"] == r.error


def test_well_formed_results_score_correct(setup):
    results = decode("latent", setup["trained"], setup["tok"], setup["prompts"], projector=setup["prj"],
                     latent_steps=LATENT_STEPS, max_new_tokens=400)
    for r, (_, _, frames) in zip(results, PROGRAMS):
        row = score_example(r, frames, source="hand")
        assert row["correct"] and row["trace_exact"] and row["action_accuracy"] == 1.0
        assert row["locals_accuracy"] is None
        assert answers_match(r.answer, _truth_answer(frames))


# ---------------------------------------------------------------------------------------- the API
def test_model_modes_are_restored_and_bad_arguments_fail(setup):
    model, prj = setup["trained"], _projector(64, 0, constant=True)
    model.train()
    prj.train()
    try:
        decode("latent", model, setup["tok"], setup["prompts"][:1], projector=prj, max_new_tokens=3)
        assert model.training and prj.training
    finally:
        model.eval()
    with pytest.raises(ValueError, match="decoding mode 'cot'"):
        decode("cot", model, setup["tok"], setup["prompts"])
    with pytest.raises(ValueError, match="needs a projector"):
        decode("latent", model, setup["tok"], setup["prompts"])
    with pytest.raises(ValueError, match="max_new_tokens = 0"):
        decode("explicit", model, setup["tok"], setup["prompts"], max_new_tokens=0)
    with pytest.raises(ValueError, match="empty prompt"):
        decode("explicit", model, setup["tok"], [[]])
    with pytest.raises(ValueError, match="batch_size = 0"):
        list(iter_decode("explicit", model, setup["tok"], setup["prompts"], batch_size=0))
    assert decode("direct", model, setup["tok"], []) == []


def test_result_to_dict_is_json_ready(setup):
    import json

    (r,) = decode("latent", setup["trained"], setup["tok"], setup["prompts"][:1], projector=setup["prj"],
                  latent_steps=LATENT_STEPS, max_new_tokens=400)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["frames"][1] == {"kind": "line", "source_line": "    y = a + b\n", "locals": None, "value": None}
    assert d["answer"] == "6" and d["ids"].count(LATENT) == 2 * LATENT_STEPS


# ---------------------------------------------------------------------------- constrained actions
def _action_slices(ids, t):
    """The token runs right after each <|action_sep|> up to the next separator (None = unfinished)."""
    seps = {t.frame_sep, t.arg_sep, t.eos}
    out = []
    for i, tok in enumerate(ids):
        if tok == t.action_sep:
            run = []
            for x in ids[i + 1:]:
                if x in seps:
                    break
                run.append(x)
            else:
                out.append((tuple(run), False))
                continue
            out.append((tuple(run), True))
    return out


def test_program_action_lines_are_the_trace_tokens_of_its_actions(setup):
    tok, t = setup["tok"], setup["t"]
    for program, call, frames in PROGRAMS:
        lines = {tuple(x) for x in program_action_lines(tok, program)}
        trace = _encode(tok, render_trace(frames))
        slices = _action_slices(trace, t)
        assert len(slices) == len(frames)
        assert all(done and run in lines for run, done in slices), program
    assert program_action_lines(tok, "\n\n") == [] and build_action_trie([]) is None


@pytest.mark.parametrize("mode", ["explicit", "latent"])
def test_constrained_actions_write_only_program_lines_even_from_a_random_model(setup, mode):
    tok, t = setup["tok"], setup["t"]
    prompts = setup["prompts"]
    lines = [program_action_lines(tok, p) for p, _, _ in PROGRAMS]
    kw = dict(projector=_projector(64, 5, constant=False), latent_steps=LATENT_STEPS, max_new_tokens=60, max_frames=64)
    model = copy.deepcopy(setup["random"])
    with torch.no_grad():  # make <|action_sep|> a likely choice too, so that actions start often
        hidden = torch.cat([model.model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts])
        model.lm_head.weight[t.action_sep] = 0.3 * hidden.mean(0)
    free = decode(mode, model, tok, prompts, **kw)
    held = decode(mode, model, tok, prompts, action_lines=lines, **kw)
    def a_line(run, done, cands):
        """`run` starts with a whole program line (the model is free after it), or a cap cut it
        short inside one."""
        cands = [tuple(c) for c in cands]
        return any(run[:len(c)] == c for c in cands) or (not done and any(c[:len(run)] == run for c in cands))

    held_runs = [(run, done, cands) for r, cands in zip(held, lines) for run, done in _action_slices(r.ids, t)]
    assert len(held_runs) >= 2 and all(a_line(*x) for x in held_runs)
    free_runs = [(run, done, cands) for r, cands in zip(free, lines) for run, done in _action_slices(r.ids, t)]
    assert not all(a_line(*x) for x in free_runs)  # free, it misspells lines: the constraint did something
    for p, b, ln in zip(prompts, held, lines):  # and batching still changes nothing
        (single,) = decode(mode, model, tok, [p], action_lines=[ln], **kw)
        assert _same(b, single)


def test_constrained_decoding_of_the_trained_model_is_unchanged(setup):
    tok = setup["tok"]
    lines = [program_action_lines(tok, p) for p, _, _ in PROGRAMS]
    kw = dict(max_new_tokens=400, max_frames=64)
    free = decode("explicit", setup["trained"], tok, setup["prompts"], **kw)
    held = list(iter_decode("explicit", setup["trained"], tok, setup["prompts"], batch_size=3, action_lines=lines, **kw))
    assert all(_same(a, b) for a, b in zip(free, held))
    with pytest.raises(ValueError, match="action_lines: 1 entries for 4 prompts"):
        decode("explicit", setup["trained"], tok, setup["prompts"], action_lines=lines[:1], **kw)
    with pytest.raises(ValueError, match="action_lines"):
        list(iter_decode("explicit", setup["trained"], tok, setup["prompts"], action_lines=lines[:1], **kw))


# ------------------------------------------------------------------------------ latent diagnostics
def test_forced_actions_write_exactly_the_true_lines_frame_by_frame(setup):
    """With the true trace's lines forced, a random model's k-th action is the truth's k-th line (as far as the
    model's own frames go), while the plain constrained decoder picks other program lines."""
    tok, t = setup["tok"], setup["t"]
    prompts = setup["prompts"]
    truths = [true_action_lines(tok, frames) for _, _, frames in PROGRAMS]
    lines = [program_action_lines(tok, p) for p, _, _ in PROGRAMS]
    model = copy.deepcopy(setup["random"])
    with torch.no_grad():
        hidden = torch.cat([model.model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts])
        model.lm_head.weight[t.action_sep] = 0.3 * hidden.mean(0)
    kw = dict(projector=_projector(64, 5, constant=False), latent_steps=LATENT_STEPS, max_new_tokens=80, max_frames=64)
    forced = decode("latent", model, tok, prompts, action_lines=lines, forced_actions=truths, **kw)
    checked = 0
    for r, truth in zip(forced, truths):
        frames = _split_ids(r.ids, t.frame_sep)
        for k, chunk in enumerate(frames[:len(truth)]):
            if t.action_sep in chunk:
                run = chunk[chunk.index(t.action_sep) + 1:]
                line = truth[k]
                assert run[:len(line)] == line or (k == len(frames) - 1 and line[:len(run)] == run)
                checked += 1
    assert checked >= 3
    with pytest.raises(ValueError, match="forced_actions: 1 entries for 4 prompts"):
        decode("latent", model, tok, prompts, forced_actions=truths[:1], **kw)
    # the trained model decodes its traces right anyway: forcing the true lines changes nothing
    kw = dict(projector=setup["prj"], latent_steps=LATENT_STEPS, max_new_tokens=400, max_frames=64)
    free = decode("latent", setup["trained"], tok, prompts, **kw)
    held = list(iter_decode("latent", setup["trained"], tok, prompts, batch_size=3, forced_actions=truths, **kw))
    assert all(_same(a, b) for a, b in zip(free, held))


def _split_ids(ids, sep):
    chunks, cur = [], []
    for i in ids:
        cur.append(i)
        if i == sep:
            chunks.append(cur)
            cur = []
    return chunks + ([cur] if cur else [])


def test_latent_statistics_norm_and_block_cosine():
    e1, e2 = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 2.0])
    norm, cos = latent_statistics([e1, e1, e2, e2], latent_steps=2)  # blocks: e1, e2
    assert norm == pytest.approx((5 + 5 + 2 + 2) / 4) and cos == pytest.approx(0.8)
    assert latent_statistics([e1, e1], latent_steps=2) == (pytest.approx(5.0), None)  # one block: no pair
    assert latent_statistics([], latent_steps=1) == (None, None)
    collapsed = latent_statistics([e1, 2 * e1, 3 * e1], latent_steps=1)
    assert collapsed[1] == pytest.approx(1.0)  # SIM-CoT's failure signature


def test_decoded_latent_results_carry_their_statistics(setup):
    kw = dict(projector=_projector(64, 3, constant=False), latent_steps=LATENT_STEPS, max_new_tokens=400, max_frames=64)
    (r,) = decode("latent", setup["trained"], setup["tok"], setup["prompts"][1:2], **kw)
    assert r.latent_blocks >= 2 and r.latent_norm > 0 and -1.0 <= r.latent_cosine <= 1.0
    (e,) = decode("explicit", setup["trained"], setup["tok"], setup["prompts"][1:2], max_new_tokens=400, max_frames=64)
    assert e.latent_norm is None and e.latent_cosine is None


def test_the_growing_cache_layer_holds_what_dynamic_layer_holds():
    """decoding.GrowingLayer writes each step in place into chunked storage; its keys and values, after prefills,
    single steps across chunk boundaries and a batch selection, equal DynamicLayer's concatenated ones."""
    from transformers import Qwen2Config
    from transformers.cache_utils import DynamicLayer

    from codi.evaluation.decoding import GrowingLayer, decoding_cache

    gen = torch.Generator().manual_seed(0)
    grow, ref = GrowingLayer(), DynamicLayer()
    assert grow.get_seq_length() == 0
    for n in [5, 1, 1, 70, 1, 3] + [1] * 60:
        k, v = torch.randn(3, 2, n, 4, generator=gen), torch.randn(3, 2, n, 4, generator=gen)
        gk, gv = grow.update(k, v)
        rk, rv = ref.update(k, v)
        assert torch.equal(gk, rk) and torch.equal(gv, rv) and grow.get_seq_length() == ref.get_seq_length()
    keep = torch.tensor([0, 2])
    grow.batch_select_indices(keep)
    ref.batch_select_indices(keep)
    k, v = torch.randn(2, 2, 1, 4, generator=gen), torch.randn(2, 2, 1, 4, generator=gen)
    assert all(torch.equal(a, b) for a, b in zip(grow.update(k, v), ref.update(k, v)))
    cache = decoding_cache(type("M", (), {"config": Qwen2Config(num_hidden_layers=2)})())
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers) and len(cache.layers) == 2
