"""Decoding cost: explicit-trace vs latent decoding, and batched vs one-at-a-time, in one run.

    $ python benchmarks/bench_decoding.py                         # trains a tiny model here (~3 min on 2 cores)
    $ python benchmarks/bench_decoding.py --sft models/sft --codi models/codi --cache data/cache/test.arrow
    $ python benchmarks/bench_decoding.py --device cuda                 # trains on CPU, decodes on the GPU

On the same examples it measures examples/s and positions/example (tokens + latents) of explicit
and latent decoding, batched and one at a time, and prints the latent-over-explicit ratios next to
the CODI paper's (2.7x faster inference than explicit CoT at 3.1x compression).

Without model paths it builds its own examples (small programs from a few templates, traced here
with sys.settrace) and overfits a tiny Qwen2 (the embedded default's size) on their explicit and
latent sequences for `--steps` steps. Its projector is the real architecture with the final
LayerNorm's weight at 0, so every latent is that LayerNorm's bias, a constant teacher-forced training
learns in one parallel pass (real CODI training needs the recurrence); the decoding cost per latent
is the real one. With `--sft`/`--codi` it loads trained models (codi.modeling.load_codi_model) and
takes prompts from a cache split.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch
from torch import nn

from codi.data.answers import answers_match
from codi.evaluation.decoding import LATENT, decode
from codi.tracing.format import Frame, encode_locals, encode_value, entry_exit, parse_trace, render_frame, render_prompt
from codi.tracing.tokens import ACTION_SEP, EOS, FRAME_SEP, PAD, TRACE_TOKENS, add_trace_tokens, token_ids

TEMPLATES = [
    ("def f(a, b):\n    y = a * {c}\n    if y > b:\n        y = y - b\n    return y + {d}\n",
     lambda r: f"f({r.randint(0, 9)}, {r.randint(0, 20)})"),
    ("def g(n):\n    s = {c}\n    for i in range(n):\n        s += i * {d}\n    return s\n",
     lambda r: f"g({r.randint(1, 4)})"),
    ("def h(x):\n    return x * {c}\n\ndef k(a, b):\n    t = h(a)\n    u = h(b)\n    return t - u + {d}\n",
     lambda r: f"k({r.randint(0, 9)}, {r.randint(0, 9)})"),
    ("def w(s):\n    out = ''\n    for ch in s:\n        out = ch + out\n    return out * {c}\n",
     lambda r: f"w({''.join(r.choice('abcd') for _ in range(r.randint(2, 4)))!r})"),
    ("def m(xs):\n    best = xs[0] - {c}\n    for x in xs:\n        if x > best:\n            best = x\n    return best + {d}\n",
     lambda r: f"m({[r.randint(0, 9) for _ in range(r.randint(2, 4))]})"),
]


def trace_call(program: str, call: str) -> list[Frame]:
    """Frames of one call (CALL/LINE/RETURN, locals diffed per frame instance): enough for a benchmark."""
    env: dict = {}
    exec(compile(program, "<bench>", "exec"), env)  # noqa: S102 - our own templates
    lines = program.splitlines(keepends=True)
    frames: list[Frame] = []
    seen: dict[int, dict[str, str]] = {}

    def local_text(fr) -> str:
        now = {k: repr(v) for k, v in fr.f_locals.items()}
        before = seen.get(id(fr), {})
        seen[id(fr)] = now
        return encode_locals({k: ".." if before.get(k) == v else v for k, v in now.items()})

    def tracer(fr, event, arg):
        if fr.f_code.co_filename != "<bench>":
            return None
        line = lines[fr.f_lineno - 1]
        if event in ("call", "line"):
            frames.append(Frame(event, line, locals=local_text(fr)))
        elif event == "return":
            frames.append(Frame("return", line, value=encode_value(repr(arg))))
        return tracer

    sys.settrace(tracer)
    try:
        eval(call, env)  # noqa: S307
    finally:
        sys.settrace(None)
    return frames


def make_examples(n: int, seed: int) -> list[tuple[str, str, list[Frame]]]:
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        template, call = TEMPLATES[len(out) % len(TEMPLATES)]
        program = template.format(c=rng.randint(1, 5), d=rng.randint(0, 9))
        c = call(rng)
        if (program, c) not in seen:
            seen.add((program, c))
            out.append((program, c, trace_call(program, c)))
    return out


def build_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1024, special_tokens=[*TRACE_TOKENS, PAD, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False)
    add_trace_tokens(tok)
    return tok


def train_tiny(examples, latent_steps: int, steps: int, seed: int):
    """(model, projector, tokenizer) overfit on the examples' explicit and latent sequences."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    texts = [render_prompt(p, c) + "".join(render_frame(f) for f in fr) for p, c, fr in examples]
    tok = build_tokenizer(texts)
    t = token_ids(tok)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    seqs = []
    for program, call, frames in examples:
        prompt, explicit, latent = enc(render_prompt(program, call)), [], []
        for fr in frames:
            if fr.kind == "line":
                rest = enc(f"{ACTION_SEP}{fr.source_line}{FRAME_SEP}")
                explicit += [t.line_sep] + enc(fr.locals) + rest
                latent += [t.line_sep, t.latent_start] + [LATENT] * latent_steps + [t.latent_end] + rest
            else:
                explicit += enc(render_frame(fr))
                latent += enc(render_frame(fr))
        for trace in (explicit + [t.eos], latent + [t.eos]):
            forced = {t.latent_start, LATENT, t.latent_end}
            seqs.append((prompt + trace, [-100] * (len(prompt) - 1) + [-100 if x in forced else x for x in trace] + [-100]))
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=512, max_position_embeddings=2048,
                      tie_word_embeddings=True, pad_token_id=t.pad, eos_token_id=t.eos)
    model = Qwen2ForCausalLM(cfg)
    h = cfg.hidden_size
    prj = nn.Sequential(nn.Linear(h, h, bias=False), nn.GELU(), nn.Linear(h, h, bias=False), nn.LayerNorm(h))
    with torch.no_grad():
        prj[3].weight.zero_()
        prj[3].bias.normal_()
    opt = torch.optim.AdamW(list(model.parameters()) + [prj[3].bias], lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    batch = 16
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        chunk = [seqs[(step * batch + k) % len(seqs)] for k in range(batch)]
        width = max(len(s) for s, _ in chunk)
        ids = torch.full((batch, width), t.pad)
        tgt = torch.full((batch, width), -100)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for b, (s, y) in enumerate(chunk):
            ids[b, :len(s)], tgt[b, :len(y)], mask[b, :len(s)] = torch.tensor(s), torch.tensor(y), 1
        emb = model.get_input_embeddings()(ids.clamp(min=0))
        emb = torch.where((ids == LATENT)[..., None], prj[3].bias.expand_as(emb), emb)
        loss = nn.functional.cross_entropy(model(inputs_embeds=emb, attention_mask=mask).logits.flatten(0, 1),
                                           tgt.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  train step {step:4d}  loss {loss.item():.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return model.eval(), prj, tok


def load_models(args):
    """(sft model, codi model, projector, latent_steps, tokenizer, examples) from trained folders and a cache split."""
    from transformers import AutoModelForCausalLM

    from codi.data.cache import CacheDataset
    from codi.modeling import load_codi_model
    from codi.tracing.tokens import load_tokenizer

    tok = load_tokenizer(args.sft)
    sft = AutoModelForCausalLM.from_pretrained(args.sft, dtype=torch.float32).eval()
    codi = load_codi_model(args.codi)
    data = CacheDataset(args.cache, limit=args.n)
    t = token_ids(tok)
    examples = []
    for k in range(len(data)):
        ex = data[k]
        body = [i for i in ex["trace_ids"] if i != t.eos]
        text = tok.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        frames = parse_trace(text)
        if entry_exit(frames) is not None:  # a truncated trace has no answer to score
            examples.append((ex["prompt_ids"], frames))
    return sft, codi.model.eval(), codi.projector, codi.config.options.latent_steps, tok, examples


def measure(mode, model, tok, prompts, truths, batch_size, **kw):
    t0 = time.perf_counter()
    results = []
    for s in range(0, len(prompts), batch_size):
        results += decode(mode, model, tok, prompts[s:s + batch_size], **kw)
    wall = time.perf_counter() - t0
    n = len(prompts)
    return {
        "examples_per_s": n / wall,
        "positions_per_example": sum(r.positions for r in results) / n,
        "accuracy": sum(not r.error and answers_match(r.answer, a) for r, a in zip(results, truths)) / n,
        "well_formed": sum(not r.error for r in results) / n,
        "wall_s": wall,
    }, results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sft", help="trained explicit (SFT) model folder")
    ap.add_argument("--codi", help="trained codi model folder (codi.modeling.save_codi_model)")
    ap.add_argument("--cache", help="cache split (.arrow) to take prompts from, with --sft/--codi")
    ap.add_argument("--n", type=int, default=32, help="examples")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--latent-steps", type=int, default=1, help="latents per LINE frame (self-trained mode)")
    ap.add_argument("--steps", type=int, default=200, help="training steps of the self-trained model")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where to decode (cpu, cuda); a self-trained model trains on CPU")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.sft or args.codi:
        if not (args.sft and args.codi and args.cache):
            ap.error("--sft, --codi and --cache go together")
        sft, codi_model, prj, latent_steps, tok, data = load_models(args)
        prompts, truths = [p for p, _ in data], [entry_exit(fr).value_repr() for _, fr in data]
    else:
        examples = make_examples(args.n, seed=0)
        print(f"training a tiny Qwen2 on {len(examples)} traced calls ({args.steps} steps)", flush=True)
        sft, prj, tok = train_tiny(examples, args.latent_steps, args.steps, seed=0)
        codi_model, latent_steps = sft, args.latent_steps
        prompts = [tok(render_prompt(p, c), add_special_tokens=False)["input_ids"] for p, c, _ in examples]
        truths = [entry_exit(fr).value_repr() for _, _, fr in examples]

    sft, codi_model = sft.to(args.device), codi_model.to(args.device)
    prj = prj.to(args.device)
    kw = dict(max_new_tokens=args.max_new_tokens, max_frames=256)
    rows = {}
    for mode, model in (("explicit", sft), ("latent", codi_model)):
        extra = dict(projector=prj, latent_steps=latent_steps) if mode == "latent" else {}
        decode(mode, model, tok, prompts[:2], **kw, **extra)  # warm-up
        rows[f"{mode} batched"], batched = measure(mode, model, tok, prompts, truths, args.batch_size, **kw, **extra)
        rows[f"{mode} single"], single = measure(mode, model, tok, prompts, truths, 1, **kw, **extra)
        rows[f"{mode} single"]["same_as_batched"] = sum(a.ids == b.ids for a, b in zip(batched, single)) / len(prompts)

    print(f"\n{len(prompts)} examples on {args.device}, batch size {args.batch_size}, {args.threads} thread(s), "
          f"latent_steps {latent_steps}")
    print(f"{'':18s} {'examples/s':>10s} {'positions/ex':>12s} {'accuracy':>9s} {'well-formed':>11s} {'wall s':>7s}")
    for name, r in rows.items():
        print(f"{name:18s} {r['examples_per_s']:10.2f} {r['positions_per_example']:12.1f} {r['accuracy']:9.3f} "
              f"{r['well_formed']:11.3f} {r['wall_s']:7.2f}")
    ratios = {
        "latent_speedup_batched": rows["latent batched"]["examples_per_s"] / rows["explicit batched"]["examples_per_s"],
        "latent_speedup_single": rows["latent single"]["examples_per_s"] / rows["explicit single"]["examples_per_s"],
        "compression": rows["explicit batched"]["positions_per_example"] / rows["latent batched"]["positions_per_example"],
        "batching_speedup_explicit": rows["explicit batched"]["examples_per_s"] / rows["explicit single"]["examples_per_s"],
        "batching_speedup_latent": rows["latent batched"]["examples_per_s"] / rows["latent single"]["examples_per_s"],
        "batched_equals_single": min(rows["explicit single"]["same_as_batched"], rows["latent single"]["same_as_batched"]),
    }
    print(f"\nlatent vs explicit: {ratios['latent_speedup_batched']:.2f}x faster batched, "
          f"{ratios['latent_speedup_single']:.2f}x one at a time, {ratios['compression']:.2f}x fewer positions "
          f"(CODI paper: 2.7x faster at 3.1x compression)")
    print(f"batched vs one at a time: explicit {ratios['batching_speedup_explicit']:.2f}x, "
          f"latent {ratios['batching_speedup_latent']:.2f}x; identical outputs: {ratios['batched_equals_single']:.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    main()
