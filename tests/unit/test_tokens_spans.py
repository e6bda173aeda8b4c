"""Trace tokens are added idempotently and stay atomic; every locals span is exact."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from codi.data.spans import SpanError, encode_examples, encode_naive
from codi.modeling.base_model import train_tiny_tokenizer
from codi.tracing.format import Frame, encode_locals, encode_value, locals_offsets, render_prompt, render_trace
from codi.tracing.tokens import TRACE_TOKENS, add_trace_tokens, token_ids
from tests.tiny import shipped

PROGRAM = "def f(s, n):\n    t = s * n\n    return t\n"


def crafted_frames() -> list[Frame]:
    long_line = "    x = " + " + ".join(str(k) for k in range(200)) + "\n"
    return [
        Frame("call", "def f(s, n):\n", locals=encode_locals({"s": "'héllo wörld ✓ 你好'", "n": "2"})),
        Frame("line", "    t = s * n\n", locals=encode_locals({"s": "..", "n": ".."})),
        Frame("line", long_line, locals=encode_locals({})),
        Frame("line", "    return t\n", locals=encode_locals({"s": "..", "n": "..", "t": "'🐍' * 3 + \"q\\\"uote\""})),
        Frame("line", "    y = 1\n", locals=encode_locals({"a": "1"})),
        Frame("return", "    return t\n", value=encode_value("'héllo wörld ✓ 你好héllo wörld ✓ 你好'")),
    ]


def corpus() -> list[str]:
    frames = crafted_frames()
    text = render_prompt(PROGRAM, "f('héllo', 2)") + render_trace(frames)
    return [text] * 20 + ["def g(x):\n    return x + 12345\n"] * 20


@pytest.fixture(scope="module")
def tiny_tok():
    return train_tiny_tokenizer(corpus(), shipped("model.tiny", vocab_size=400))


def metaspace_tok():
    """A Llama/SentencePiece-style BPE (Metaspace pre-tokenizer, NFC normalizer), trace tokens added
    afterwards the way a hub model gets them."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    # prepend_scheme="first": a "▁" only at the start of the text (Llama-2 non-legacy); "always" would
    # put one after every special token and no locals span could decode to its text.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                           show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    add_trace_tokens(fast)
    return fast


def test_add_trace_tokens_is_idempotent(tiny_tok):
    tok = metaspace_tok()
    n = len(tok)
    assert add_trace_tokens(tok) == 0 and len(tok) == n
    assert add_trace_tokens(tiny_tok) == 0
    ids = token_ids(tok)
    assert len(set(ids.as_dict().values())) == len(ids.as_dict())  # all distinct, none hard-coded
    assert tok.pad_token is not None and tok.eos_token == "</s>"


def test_token_ids_requires_the_tokens():
    tok = Tokenizer(models.BPE())
    tok.train_from_iterator(["abc"], trainers.BpeTrainer(vocab_size=50, show_progress=False))
    with pytest.raises(KeyError, match="add_trace_tokens"):
        token_ids(PreTrainedTokenizerFast(tokenizer_object=tok))


@pytest.mark.parametrize("which", ["tiny", "metaspace"])
def test_special_tokens_are_atomic(which, tiny_tok):
    tok = tiny_tok if which == "tiny" else metaspace_tok()
    vocab = tok.get_vocab()
    # Glued to neighbours that a BPE would love to merge with.
    for special in TRACE_TOKENS:
        text = f"x{special}{{\"a\"{special}  y{special}"
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        hits = [k for k, t in enumerate(enc["input_ids"]) if t == vocab[special]]
        assert len(hits) == 3, (which, special)
        for k in hits:
            s, e = enc["offset_mapping"][k]
            assert text[s:e] == special


@pytest.mark.parametrize("which", ["tiny", "metaspace"])
def test_spans_are_exact_on_crafted_traces(which, tiny_tok):
    tok = tiny_tok if which == "tiny" else metaspace_tok()
    frames = crafted_frames()
    trace = render_trace(frames)
    prompt = render_prompt(PROGRAM, "f('héllo', 2)")
    [enc] = encode_examples(tok, [prompt], [trace], [locals_offsets(frames)], names=["crafted"])
    ids = token_ids(tok)
    line_frames = [f for f in frames if f.kind == "line"]
    assert len(enc.spans) == len(line_frames)
    for (i, j), frame in zip(enc.spans, line_frames):
        assert enc.trace_ids[i] == ids.line_sep and enc.trace_ids[j] == ids.action_sep
        assert tok.decode(enc.trace_ids[i + 1:j], skip_special_tokens=False,
                          clean_up_tokenization_spaces=False) == frame.locals
    assert enc.trace_ids[-1] == ids.eos
    # The naive one-at-a-time id search agrees (special tokens are atomic), and the Rust-backend ids
    # are the HF wrapper's.
    naive = encode_naive(tok, prompt, trace, ids)
    assert naive.spans == enc.spans
    assert (naive.prompt_ids, naive.trace_ids) == (enc.prompt_ids, enc.trace_ids)


def test_span_of_one_token_and_empty_locals(tiny_tok):
    frames = [Frame("call", "def f():\n", locals="{}"), Frame("line", "    return 1\n", locals="{}"),
              Frame("return", "    return 1\n", value=encode_value("1"))]
    [enc] = encode_examples(tiny_tok, [render_prompt("def f():\n    return 1\n", "f()")], [render_trace(frames)],
                            [locals_offsets(frames)])
    (i, j), = enc.spans
    assert 1 <= j - i - 1 <= 2  # "{}" is one or two tokens


def test_misaligned_span_fails_naming_the_sample(tiny_tok):
    frames = crafted_frames()
    spans = locals_offsets(frames)
    bad = [(s + 1, e) for s, e in spans]
    with pytest.raises(SpanError, match="sample-7"):
        encode_examples(tiny_tok, ["p"], [render_trace(frames)], [bad], names=["sample-7"])


def test_padding_or_truncation_in_the_tokenizer_file_never_reaches_the_cache(tiny_tok):
    """A hub tokenizer.json may enable padding/truncation; the spans path must ignore both, as the HF
    wrapper's __call__ does."""
    import copy

    frames = crafted_frames()
    trace = render_trace(frames)
    [plain] = encode_examples(tiny_tok, ["p", ], [trace], [locals_offsets(frames)])
    tok = copy.deepcopy(tiny_tok)
    tok.backend_tokenizer.enable_padding(length=len(plain.trace_ids) + 50, pad_id=token_ids(tok).pad)
    tok.backend_tokenizer.enable_truncation(max_length=8)
    [enc] = encode_examples(tok, ["p"], [trace], [locals_offsets(frames)])
    assert (enc.prompt_ids, enc.trace_ids, enc.spans) == (plain.prompt_ids, plain.trace_ids, plain.spans)


@pytest.mark.parametrize("split_digits", [True, False])
def test_a_saved_tiny_tokenizer_loads_back_exactly_beside_a_qwen2_config(tmp_path, split_digits):
    """AutoTokenizer builds Qwen2Tokenizer for a Qwen2 config and swaps in Qwen2's pre-tokenizer, which splits
    every digit: whole-number tokens would come back as digits. load_tokenizer reads the saved one verbatim."""
    from transformers import AutoTokenizer

    from codi.modeling.base_model import save_base, tiny_model
    from codi.tracing.tokens import load_tokenizer, tokenizer_sha256

    cfg = shipped("model.tiny", vocab_size=400, split_digits=split_digits, hidden_size=16, num_heads=2,
                  num_kv_heads=1, num_layers=1, intermediate_size=16)
    text = '{"a": "17", "b": "-3"}<|action_sep|>    c = a - 12\n'
    tok = train_tiny_tokenizer([text] * 50 + corpus(), cfg)
    save_base(tiny_model(cfg, tok), tok, tmp_path / "base")
    loaded = load_tokenizer(tmp_path / "base")
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert tokenizer_sha256(loaded) == tokenizer_sha256(tok) and token_ids(loaded) == token_ids(tok)
    pieces = [loaded.decode([i]) for i in loaded('"17"', add_special_tokens=False)["input_ids"]]
    assert pieces == (['"', "1", "7", '"'] if split_digits else ['"', "17", '"'])
    if not split_digits:  # the trap load_tokenizer avoids
        auto = AutoTokenizer.from_pretrained(tmp_path / "base")
        assert auto('"17"', add_special_tokens=False)["input_ids"] != loaded('"17"', add_special_tokens=False)["input_ids"]
