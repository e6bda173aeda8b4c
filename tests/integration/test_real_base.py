"""A real-family base model from a local HF folder, with no hub: the path a user's own model takes.

The test makes the folder itself: a small random Qwen2 (untied head, embeddings padded past its tokenizer
to a multiple of 64, as Qwen's are) or Llama (tied head, embeddings exactly the tokenizer's size), saved with
`save_pretrained`, beside a byte-level BPE trained here on code and JSON, with its own eos, no pad and none
of the trace tokens. Then:

- `build_base` on the folder (fast): the folder's own tokenizer, verbatim, plus the trace tokens as atomic
  specials, added once; locals spans exact under its merges (`"}`, `",`); new embedding rows at the mean of
  the old ones, the head following, tied or not.
- the whole pipeline on it: extract -> precompute -> sft -> sft_direct -> codi (shared and frozen teacher)
  -> evaluate, a few steps each, then `models/codi` loaded with `load_codi_model` and decoded. About 10 s
  per family on one core, so it stays in the default suite.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.integration.test_stages_tiny import cli
from tests.tiny import shipped, tiny_params, write_params

HIDDEN = 32
BPE_VOCAB = 600

# Llama 3's pre-tokenizer split (digits in runs of up to 3); the Qwen2 fixture uses GPT-2's instead, which a
# Qwen2Tokenizer would silently replace with Qwen2's own (every digit split).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

FAMILIES = {
    # family: (eos, bos, tied head, embedding rows: None = the tokenizer's size, else padded to this)
    "qwen2": ("<|endoftext|>", None, False, 640),
    "llama": ("<|end_of_text|>", "<|begin_of_text|>", True, None),
}

PROGRAM = "def f(xs, k):\n    total = 0\n    for x in xs:\n        total = total + x * k\n    return total\n"


def corpus() -> list[str]:
    """Code and JSON of the kind a code model's tokenizer is trained on: locals-like dicts (merges such as
    `"}` and `",`), lists, and chat-template text where `"}` runs into `<|` (a merge the trace tokens must
    never take part in)."""
    rng = random.Random(0)
    names = ["a", "b", "n", "i", "x", "xs", "k", "s", "total", "acc", "res", "lst", "key", "value"]
    values = ["None", "True", "False", "[]", "[1, 2, 3]", "'ab'", "'x y'", "''", "{'a': 1}", "(1, 2)"]
    texts = []
    for _ in range(500):
        d = {rng.choice(names): rng.choice(values + [str(rng.randint(-99, 12345))]) for _ in range(rng.randint(1, 4))}
        texts.append(json.dumps(d) + "\n" + json.dumps(list(d.values())) + "\n")
        texts.append(f'{{"role": "user", "content": "{rng.choice(names)}"}}<|im_end|>\n')
        a, b, op = rng.choice(names), rng.choice(names), rng.choice(["+", "-", "*", "//", "%"])
        texts.append(f"def g_{a}({a}, {b}):\n    {b} = {a} {op} {rng.randint(0, 999)}\n"
                     f"    for {a} in range({b}):\n        print({a!r}, {b})\n    return {b}\n")
    return texts


def make_tokenizer(family: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    eos, bos, _, _ = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    if family == "qwen2":  # GPT-2's byte-level BPE
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
    else:  # Llama 3's: regex split, then bytes; a template that prepends bos when asked for special tokens
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [eos] + ([bos] if bos else [])
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if bos:
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos,
                                   clean_up_tokenization_spaces=False)


def make_model(family: str, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    _, _, tied, rows = FAMILIES[family]
    common = dict(vocab_size=rows or len(tok), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=64, max_position_embeddings=1024,
                  tie_word_embeddings=tied, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id)
    torch.manual_seed(0)
    model = (Qwen2ForCausalLM(Qwen2Config(**common)) if family == "qwen2"
             else LlamaForCausalLM(LlamaConfig(**common)))
    # Trained embeddings share a common direction (they are anisotropic), so their mean is a row on their
    # scale; a fresh N(0, 0.02) init has none. Give the rows that shape, on a scale unlike the init's.
    with torch.no_grad():
        for w in {id(p): p for p in (model.get_input_embeddings().weight,
                                     model.get_output_embeddings().weight)}.values():
            w.copy_(torch.randn(HIDDEN) * 0.3 + torch.randn_like(w) * 0.3)
    return model


def make_base_folder(folder: Path, family: str) -> Path:
    tok = make_tokenizer(family)
    model = make_model(family, tok)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def base_folder(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, make_base_folder(tmp_path_factory.mktemp(f"{family}-base") / "model", family)


def folder_tokenizer(folder: Path):
    """The folder's tokenizer as it was saved (tokenizer.json verbatim), before any trace token."""
    from codi.tracing.tokens import load_tokenizer

    return load_tokenizer(folder)


def crafted():
    from codi.tracing.format import Frame, encode_locals, encode_value

    frames = [Frame("call", "def f(xs, k):\n", locals=encode_locals({"xs": "[1, 2, 3]", "k": "2"}))]
    total = 0
    for line, extra in (("    total = 0\n", {}), ("    for x in xs:\n", {"total": "0"})):
        frames.append(Frame("line", line, locals=encode_locals({"xs": "[1, 2, 3]", "k": "2", **extra})))
    for x in (1, 2, 3):
        loc = {"xs": "[1, 2, 3]", "k": "2", "total": str(total), "x": str(x)}
        frames.append(Frame("line", "        total = total + x * k\n", locals=encode_locals(loc)))
        total += x * 2
        frames.append(Frame("line", "    for x in xs:\n", locals=encode_locals({**loc, "total": str(total)})))
    frames.append(Frame("line", "    return total\n", locals=encode_locals({"s": "'a\"}b'", "total": str(total)})))
    frames.append(Frame("return", "    return total\n", value=encode_value(str(total))))
    return frames


# -- fast: build_base on the folder, no training --------------------------------------------------------------

@pytest.fixture(scope="module")
def built(base_folder):
    from codi.modeling.base_model import build_base

    family, folder = base_folder
    model, tok = build_base(shipped("model", base=str(folder)), [])
    return family, folder, model, tok


def test_the_folder_is_a_real_family_base_without_trace_tokens(base_folder):
    from codi.tracing.tokens import TRACE_TOKENS

    family, folder = base_folder
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["tie_word_embeddings"] is FAMILIES[family][2]
    tok = folder_tokenizer(folder)
    vocab = tok.get_vocab()
    assert tok.pad_token is None and tok.eos_token == FAMILIES[family][0]
    assert not any(t in vocab for t in TRACE_TOKENS)
    assert {'"}', '",'} <= set(vocab)  # the BPE merges that sit at a locals span's edges
    assert '"}<|' in vocab  # and one across the edge, which the atomic trace tokens must win over


def test_the_tokenizer_is_the_folders_own_with_trace_tokens_added_once_and_atomic(built):
    from codi.tracing.format import render_prompt, render_trace
    from codi.tracing.tokens import PAD, TRACE_TOKENS, add_trace_tokens, token_ids

    family, folder, _, tok = built
    own = folder_tokenizer(folder)
    # added once: every trace token and a pad (the folder has none); its eos kept
    assert len(tok) == len(own) + len(TRACE_TOKENS) + 1
    assert tok.pad_token == PAD and tok.eos_token == own.eos_token == FAMILIES[family][0]
    assert add_trace_tokens(tok) == 0 and len(tok) == len(own) + len(TRACE_TOKENS) + 1
    # ordinary text tokenizes exactly as the folder's tokenizer does (no family class swapped in)
    code = PROGRAM + 'print({"n": 12345, "s": "x\\ny"})\n'
    assert tok(code, add_special_tokens=False)["input_ids"] == own(code, add_special_tokens=False)["input_ids"]
    # atomic: each trace token is one id wherever it stands, never a merge with its neighbours
    ids = token_ids(tok).as_dict()
    vocab = tok.get_vocab()
    text = render_prompt(PROGRAM, "f([1, 2, 3], 2)") + render_trace(crafted())
    enc = tok(text, add_special_tokens=False)["input_ids"]
    specials = {vocab[t] for t in TRACE_TOKENS}
    for t in TRACE_TOKENS:
        assert tok(t, add_special_tokens=False)["input_ids"] == [vocab[t]]
        assert enc.count(vocab[t]) == text.count(t), t
    pieces = [tok.decode([i]) for i in enc if i not in specials]
    assert not any("<|" in p for p in pieces)  # no trace token was split into ordinary tokens
    assert vocab['"}<|'] not in enc and text.count('"}<|') > 5  # the merge across the edge never applies
    assert len(set(ids.values())) == len(ids)


def test_locals_spans_and_action_lines_are_exact_under_its_merges(built):
    from codi.data.spans import encode_examples, encode_naive
    from codi.evaluation.decoding import program_action_lines
    from codi.tracing.format import locals_offsets, render_prompt, render_trace
    from codi.tracing.tokens import token_ids

    _, _, _, tok = built
    frames = crafted()
    trace, prompt = render_trace(frames), render_prompt(PROGRAM, "f([1, 2, 3], 2)")
    [enc] = encode_examples(tok, [prompt], [trace], [locals_offsets(frames)])
    ids = token_ids(tok)
    line_frames = [f for f in frames if f.kind == "line"]
    assert len(enc.spans) == len(line_frames)
    vocab = tok.get_vocab()
    merged = {vocab['"}'], vocab['",']}
    for (i, j), frame in zip(enc.spans, line_frames):
        assert enc.trace_ids[i] == ids.line_sep and enc.trace_ids[j] == ids.action_sep
        assert tok.decode(enc.trace_ids[i + 1:j], skip_special_tokens=False) == frame.locals
        assert enc.trace_ids[j - 1] == vocab['"}'] or frame.locals == "{}"  # the span ends on the merge
    assert sum(t in merged for t in enc.trace_ids) >= len(line_frames)
    naive = encode_naive(tok, prompt, trace, ids)
    assert (naive.prompt_ids, naive.trace_ids, naive.spans) == (enc.prompt_ids, enc.trace_ids, enc.spans)
    # no bos from the tokenizer's template (Llama's): the pipeline tokenizes with add_special_tokens=False
    assert tok.bos_token_id is None or tok.bos_token_id not in enc.prompt_ids + enc.trace_ids
    # constrained decoding's action lines, tokenized alone, are the trace's tokens after each <|action_sep|>
    lines = {tuple(x) for x in program_action_lines(tok, PROGRAM)}
    t = enc.trace_ids
    for k, tid in enumerate(t):
        if tid == ids.action_sep:
            end = next(n for n in range(k + 1, len(t)) if t[n] in (ids.frame_sep, ids.arg_sep, ids.eos))
            assert tuple(t[k + 1:end]) in lines


def test_new_embedding_rows_are_the_mean_of_the_old_and_the_head_follows(built):
    import torch
    from safetensors.torch import load_file

    family, folder, model, tok = built
    _, _, tied, rows = FAMILIES[family]
    known = len(folder_tokenizer(folder))
    saved = load_file(str(folder / "model.safetensors"))
    emb = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    # rows: the folder's padding kept (Qwen2: 640 > 611 tokens), grown to the tokenizer otherwise (Llama)
    assert emb.shape == head.shape == (max(rows or 0, len(tok)), HIDDEN)
    assert model.config.vocab_size == emb.shape[0]
    if tied:
        assert head.data_ptr() == emb.data_ptr() and model.config.tie_word_embeddings
    else:
        assert head.data_ptr() != emb.data_ptr() and not torch.equal(head, emb)
    pairs = [(emb, saved["model.embed_tokens.weight"])]
    if not tied:
        pairs.append((head, saved["lm_head.weight"]))
    for now, before in pairs:
        assert torch.equal(now[:known], before[:known])  # the model's own rows untouched
        mean = before[:known].mean(0)
        new = now[known:len(tok)]
        assert torch.allclose(new, mean.expand_as(new), atol=1e-6)  # every new token's row is the mean
        norms = before[:known].norm(dim=1)
        # on the scale of the existing rows, not init noise (N(0, 0.02): norm ~0.11 against these ~2.4)
        assert 0.5 * norms.median() < mean.norm() <= norms.max()
        if rows:  # padding rows past the tokenizer stay as they were
            assert torch.equal(now[len(tok):], before[len(tok):])
    # deterministic: the same folder gives the same weights
    from codi.modeling.base_model import build_base
    again, _ = build_base(shipped("model", base=str(folder)), [])
    assert torch.equal(again.get_input_embeddings().weight, emb)
    assert torch.equal(again.get_output_embeddings().weight, head)


def test_the_saved_base_reloads_with_the_same_tokenizer_and_head(built, tmp_path):
    from transformers import AutoModelForCausalLM

    from codi.modeling.base_model import save_base
    from codi.tracing.tokens import load_tokenizer, tokenizer_sha256

    family, _, model, tok = built
    save_base(model, tok, tmp_path / "base")
    loaded_tok = load_tokenizer(tmp_path / "base")
    assert tokenizer_sha256(loaded_tok) == tokenizer_sha256(tok) and len(loaded_tok) == len(tok)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    emb, head = loaded.get_input_embeddings().weight, loaded.get_output_embeddings().weight
    assert (head.data_ptr() == emb.data_ptr()) is FAMILIES[family][2]
    assert loaded.config.pad_token_id == tok.pad_token_id


# -- the whole pipeline on the folder ---------------------------------------------------------------------------

STEPS = {"sft": 6, "sft_direct": 4, "codi": 3}


@pytest.fixture(scope="module")
def pipeline(base_folder, tmp_path_factory) -> tuple[str, Path, Path]:
    """A workspace after extract -> precompute -> sft -> sft_direct -> codi -> codi (frozen teacher) -> evaluate."""
    family, folder = base_folder
    ws = tmp_path_factory.mktemp(f"{family}-ws")
    small = {"eval_steps": 2, "save_steps": 2, "logging_steps": 1}
    params = tiny_params(
        model={"base": str(folder)},
        extract={"synthetic": {"n_programs": 24}},
        precompute={"val_fraction": 0.2, "test_fraction": 0.2},
        sft={**small, "max_steps": STEPS["sft"]}, sft_direct={**small, "max_steps": STEPS["sft_direct"]},
        codi={**small, "max_steps": STEPS["codi"], "val_accuracy_samples": 2},
        evaluate={"max_examples": 3, "max_new_tokens": 64, "max_frames": 8, "bootstrap_samples": 200})
    write_params(ws / "params.yaml", params)
    for stage in (["extract"], ["precompute"], ["sft"], ["sft_direct"], ["codi"]):
        assert cli(ws, *stage) == 0, stage
    # value KD aligns the shared-weight teacher's layers (a frozen teacher is refused with it: test_modeling)
    frozen = {**params, "codi": {**params["codi"], "frozen_teacher": str(ws / "models/sft"), "value_kd_weight": 0.0}}
    write_params(ws / "frozen.yaml", frozen)
    assert cli(ws, "codi", "--out", "models/codi_frozen", "--checkpoints", "checkpoints/codi_frozen",
               "--metrics", "metrics/codi_frozen.json", "--plots", "plots/codi_frozen",
               "--live", "dvclive/codi_frozen", params="frozen.yaml") == 0
    assert cli(ws, "evaluate") == 0
    return family, folder, ws


def test_pipeline_cache_spans_are_exact_on_every_example(pipeline):
    from codi.data.cache import CacheDataset
    from codi.tracing.format import parse_trace
    from codi.tracing.tokens import TRACE_TOKENS, load_tokenizer, token_ids

    family, folder, ws = pipeline
    tok = load_tokenizer(ws / "models/base")
    own = folder_tokenizer(folder)
    manifest = json.loads((ws / "data/cache/manifest.json").read_text())
    assert manifest["vocab_size"] == len(tok) == len(own) + len(TRACE_TOKENS) + 1
    ids = token_ids(tok)
    merged = {tok.get_vocab()['"}'], tok.get_vocab()['",']}
    n_spans = n_merged = 0
    for split in ("train", "val", "test"):
        ds = CacheDataset(ws / f"data/cache/{split}.arrow")
        texts = ds.column("trace_text")
        for k in range(len(ds)):
            ex = ds[k]
            line_locals = [f.locals for f in parse_trace(texts[k]) if f.kind == "line"]
            assert len(ex["spans"]) == len(line_locals)
            for (i, j), want in zip(ex["spans"], line_locals):
                assert ex["trace_ids"][i] == ids.line_sep and ex["trace_ids"][j] == ids.action_sep
                assert tok.decode(ex["trace_ids"][i + 1:j]) == want
                n_spans += 1
                n_merged += any(t in merged for t in ex["trace_ids"][i + 1:j])
            assert ex["trace_ids"][-1] == ids.eos and ex["answer_ids"][-1] == ids.eos
            # the trace tokens are atomic in the cache: as many ids as the text has tokens
            for t in TRACE_TOKENS[:8]:
                assert ex["trace_ids"].count(tok.get_vocab()[t]) == texts[k].count(t)
    assert n_spans > 50 and n_merged > n_spans // 2  # the merges at the span edges occur, and decode exactly


def test_pipeline_trains_every_stage_and_keeps_the_head(pipeline):
    import math

    import torch
    from transformers import AutoModelForCausalLM

    family, _, ws = pipeline
    tied = FAMILIES[family][2]
    for stage in ("sft", "sft_direct", "codi", "codi_frozen"):
        m = json.loads((ws / f"metrics/{stage}.json").read_text())
        assert m["steps"] == STEPS[stage.removesuffix("_frozen")], stage
        if stage.startswith("sft"):
            assert math.isfinite(m["val_loss"])
    for stage in ("base", "sft", "sft_direct"):
        model = AutoModelForCausalLM.from_pretrained(ws / f"models/{stage}")
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        assert emb.shape == head.shape and (head.data_ptr() == emb.data_ptr()) is tied, stage
        if not tied:
            assert not torch.equal(emb, head)
    frozen = json.loads((ws / "models/codi_frozen/codi_config.json").read_text())
    assert frozen["extra"]["params"]["codi"]["frozen_teacher"] == str(ws / "models/sft")
    ev = json.loads((ws / "metrics/eval.json").read_text())
    for mode in ("explicit", "latent", "direct"):
        assert ev[mode]["n"] > 0 and 0.0 <= ev[mode]["output_accuracy"] <= 1.0


@pytest.mark.parametrize("which", ["codi", "codi_frozen"])
def test_pipeline_codi_model_loads_and_decodes(pipeline, which):
    from codi.data.cache import CacheDataset
    from codi.evaluation.decoding import LATENT, decode, program_action_lines
    from codi.modeling import load_codi_model
    from codi.tracing.tokens import token_ids

    family, _, ws = pipeline
    loaded = load_codi_model(ws / f"models/{which}")
    tok = loaded.tokenizer
    assert loaded.config.token_ids == token_ids(tok) and loaded.config.hidden_size == HIDDEN
    emb, head = loaded.model.get_input_embeddings().weight, loaded.model.get_output_embeddings().weight
    assert (head.data_ptr() == emb.data_ptr()) is FAMILIES[family][2]
    ds = CacheDataset(ws / "data/cache/test.arrow")
    n = min(2, len(ds))
    prompts = [ds[k]["prompt_ids"] for k in range(n)]
    lines = [program_action_lines(tok, program) for program in ds.column("program")[:n]]
    for mode in ("latent", "explicit"):
        results = decode(mode, loaded.model, tok, prompts, projector=loaded.projector,
                         latent_steps=loaded.config.options.latent_steps, max_new_tokens=48, max_frames=6,
                         action_lines=lines)
        assert len(results) == len(prompts)
        for r in results:
            assert r.positions == len(r.ids) > 0 and r.stop
            assert all(i == LATENT or 0 <= i < len(tok) for i in r.ids)  # never a padding row's id
            assert isinstance(r.text, str) and (r.answer is None or isinstance(r.answer, str))
