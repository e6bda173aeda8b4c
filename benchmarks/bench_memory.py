"""Benchmark (slow): codi training memory and s/step at Qwen2.5-Coder-0.5B's shape, and a projection to a GPU.

    python benchmarks/bench_memory.py                       # CPU fp32, batch 1, seq ~2048: 1 and 3 layers, fitted to 24 (~10 min, 2 cores)
    python benchmarks/bench_memory.py --layers 24 --seq 512 # the whole 24-layer model, shorter examples
    python benchmarks/bench_memory.py --layers 2 --seq 256 --vocab 2048   # a quick dry run (printed as MODIFIED)
    python benchmarks/bench_memory.py --device cuda --dtype bf16 --optim paged_adamw_8bit --batch 8 --steps 2
    python benchmarks/bench_memory.py --device cuda --dtype bf16 --optim paged_adamw_8bit --batch 8 --seq 512 \
        --steps 100 --configs teacher_ckpt --report-updates    # the GPU check's 100-step run (benchmarks/gpu_check.sh)

Why 1 and 3 layers on a CPU: the 24-layer model at seq 2048 needs more than this machine's 24 GiB (it was
OOM-killed). Every decoder layer is identical, so each quantity is fitted as a + b x layers through the measured
layer counts and evaluated at 24; those rows are marked as fits. The vocabulary (the lm_head: most of the CPU
time) and the sequence are the real ones. On a GPU the default is the whole 24-layer model.

Model: a randomly initialised Qwen2ForCausalLM of Qwen2.5-Coder-0.5B's published shape (config values
hard-coded below, no weights downloaded), with its embedding table sized as the pipeline leaves it
(codi.modeling.base_model.build_base: the Qwen2.5 tokenizer's 151,665 tokens + the 10 trace tokens fit inside
config.json's padded 151,936 rows, which `init_new_token_rows` keeps: the trace tokens take padding rows, set
to the mean of the known rows). It is wrapped
exactly as the codi stage wraps it: `CodiModel.from_config(base, ids, params.codi, params.loss_weights)`
with the committed params.yaml (latent_steps, kd_layers, ...), only `codi.gradient_checkpointing` (the
teacher's activation checkpointing; the student is never checkpointed, and the stage turns the Trainer's
own `activation_checkpointing` off, so there is no other model checkpointing option) and the teacher mode
(`frozen_teacher`: a copy of the base, in its dtype) varying per configuration. The optimizer is the one the
stage's Trainer would build: `Trainer.get_optimizer_cls_and_kwargs(codi.training.args.training_arguments(...))`
for `--optim` (adamw_torch, or paged_adamw_8bit = bitsandbytes' paged 8-bit AdamW), one parameter group.
With `--dtype bf16` the base is cast to bf16 and the forward runs under bf16 autocast, as the stage does on a GPU
(weights loaded in bf16, TrainingArguments bf16=True). CPU runs use `--threads` (default 2) torch threads.

Examples: `tests/codi_oracle.make_example` (the trace grammar: CALL, LINE frames with locals and spans, some
RETURN frames between them, the entry's RETURN, eos) with lengths in Qwen BPE tokens of real traced code:
prompt (program source + call) 150-250, locals 4-20, a code line 5-16; LINE frames are added until the
example reaches `--seq` tokens (prompt + trace): 2072 tokens and 62 LINE frames at 2048. The special tokens get the
ids they have in the real vocabulary (trace tokens at the end, pad = eos = <|endoftext|>).

One step = forward + backward + clip_grad_norm(max_grad_norm) + optimizer step + zero_grad, as the Trainer
does it. Before the measured steps the optimizer's states are created by one step on zero gradients at lr 0,
so every measured step is a steady-state step (weights + optimizer states resident, gradients allocated during
backward), and one untimed forward + backward on a short example warms the kernels up. Time: wall seconds and
the process's CPU seconds (all threads; less sensitive to other load on a shared machine). Memory is the peak above the start of the step (CPU: RSS sampled
every ms after malloc_trim, benchmarks/bench_codi_model.PeakRSS; CUDA: torch.cuda.max_memory_allocated),
at the end of the forward (the saved activations) and over the whole step.

The projection table (after the measured one) is arithmetic, not a measurement: see `projection()`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_codi_model import PeakCUDA, PeakRSS  # noqa: E402  (also puts the repo root on sys.path)

from codi.infra.config import load_params  # noqa: E402
from codi.modeling import CodiModel  # noqa: E402
from codi.tracing.tokens import TraceTokenIds  # noqa: E402
from codi.training.args import training_arguments  # noqa: E402
from tests.codi_oracle import TOKEN_IDS as ORACLE_IDS  # noqa: E402
from tests.codi_oracle import make_example  # noqa: E402

# Qwen/Qwen2.5-Coder-0.5B config.json (the same shape as Qwen2.5-0.5B): 494M parameters, head_dim 64.
QWEN25_CODER_05B = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0,
    max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", bos_token_id=151643,
    eos_token_id=151643, use_sliding_window=False, sliding_window=32768, max_window_layers=24,
)
QWEN_TOKENIZER_LEN = 151665  # 151,643 BPE tokens + 22 special tokens (<|endoftext|> = 151643, <|im_start|>, ...)
N_TRACE_TOKENS = 10          # codi.tracing.tokens.TRACE_TOKENS; Qwen's tokenizer has pad and eos already
PIPELINE_VOCAB = 151936      # rows after build_base: the padded table is kept (151,675 tokens fit in it)
ENDOFTEXT = 151643

# Lengths in Qwen BPE tokens (ranges for make_example).
PROMPT_LEN, LOCALS_LEN, CODE_LEN = (150, 250), (4, 20), (5, 16)

CONFIGS = {  # name -> (codi.gradient_checkpointing, frozen teacher)
    "teacher_ckpt": (True, False),     # the committed default
    "no_teacher_ckpt": (False, False),
    "frozen_teacher": (True, True),    # a frozen copy of the base as teacher (a no-grad pass: no teacher CE)
}


def token_ids_for(vocab: int) -> TraceTokenIds:
    """The trace tokens right after the tokenizer's own (as add_trace_tokens leaves them: ids 151,665-151,674 of
    the pipeline's table; the end of a modified table), pad = eos = <|endoftext|>."""
    first = QWEN_TOKENIZER_LEN if vocab == PIPELINE_VOCAB else vocab - N_TRACE_TOKENS
    names = ["trace_context_start", "frame_sep", "call_sep", "line_sep", "return_sep", "exception_sep",
             "action_sep", "arg_sep", "latent_start", "latent_end"]
    eos = ENDOFTEXT if vocab == PIPELINE_VOCAB else first - 1
    return TraceTokenIds(**{n: first + i for i, n in enumerate(names)}, pad=eos, eos=eos)


def realistic_example(total: int, ids: TraceTokenIds, seed: int) -> dict:
    """One example of about `total` tokens (prompt + trace, never fewer): make_example's grammar, Qwen-like lengths,
    the oracle's special ids mapped to `ids`, plain tokens drawn below the special tokens, a value position per
    span."""
    remap = {getattr(ORACLE_IDS, k): v for k, v in ids.as_dict().items()}
    plain_hi = min(ids.eos, min(ids.as_dict().values()))
    n = 1
    while True:
        ex = make_example(random.Random(seed), n, vocab=plain_hi, prompt_len=PROMPT_LEN, locals_len=LOCALS_LEN,
                          code_len=CODE_LEN)
        if len(ex["prompt_ids"]) + len(ex["trace_ids"]) >= total or n > total:
            break
        n += 1
    # value_pos: the token each LINE frame's value sits at (codi.data.values), for the value levers of the
    # default recipe (value CE, value KD); here one inside each span, as a real trace has one in most
    return {"prompt_ids": [remap.get(t, t) for t in ex["prompt_ids"]],
            "trace_ids": [remap.get(t, t) for t in ex["trace_ids"]], "spans": ex["spans"],
            "value_pos": [(i + j) // 2 if j - i >= 2 else -1 for i, j in ex["spans"]]}


def build_base(layers: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(QWEN25_CODER_05B, num_hidden_layers=layers, max_window_layers=layers, vocab_size=vocab,
               pad_token_id=ENDOFTEXT if vocab == PIPELINE_VOCAB else vocab - N_TRACE_TOKENS - 1)
    if vocab != PIPELINE_VOCAB:
        cfg.update(bos_token_id=cfg["pad_token_id"], eos_token_id=cfg["pad_token_id"])
    config = Qwen2Config(**cfg, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):  # initialise in place (a 0.5B init on the GPU takes a second)
        model = Qwen2ForCausalLM(config)
    return model.to(dtype=dtype).train()


def n_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_for(cfg, model, optim: str, lr: float):
    """The optimizer the codi stage's Trainer builds for `optim` (one parameter group)."""
    from transformers import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        targs = training_arguments(dataclasses.replace(cfg, optimizer=optim, precision="fp32", lr=lr),
                                   output_dir=Path(tmp), run_name="bench_memory", has_eval=False,
                                   activation_checkpointing=False)
    cls, kw = Trainer.get_optimizer_cls_and_kwargs(targs)
    params = [p for p in model.parameters() if p.requires_grad]
    return cls([{"params": params, "weight_decay": cfg.weight_decay}], **kw), targs.max_grad_norm


def state_bytes(opt) -> int:
    return n_bytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


class Tracker:
    """Peak memory of one step above its start, with a reading at the end of the forward."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.inner = PeakCUDA() if self.cuda else PeakRSS()

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)

    def now_peak_mb(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = max(self.inner.peak, self.inner.proc.memory_info().rss)
        return (peak - self.inner.base) / 2**20

    @property
    def base_mb(self) -> float:
        return self.inner.base / 2**20

    @property
    def peak_extra_mb(self) -> float:
        return self.inner.extra_mb


def run_config(name, base, ids, params, args, device, dtype, examples, warm, log):
    ckpt, frozen = CONFIGS[name]
    cfg = dataclasses.replace(params.codi, gradient_checkpointing=ckpt,
                              frozen_teacher="(copy of the base)" if frozen else "")
    teacher = copy.deepcopy(base).eval().requires_grad_(False) if frozen else None
    torch.manual_seed(params.codi.seed)  # the projector, as the stage seeds it
    model = CodiModel.from_config(base, ids, cfg, params.loss_weights, frozen_teacher=teacher)
    model.train()
    opt, max_norm = optimizer_for(cfg, model, args.optim, args.lr)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Create the optimizer states with one step on zero gradients: the measured steps are steady-state steps.
    for p in trainable:
        p.grad = torch.zeros_like(p)
    lr = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, v in zip(opt.param_groups, lr):
        g["lr"] = v
    opt.zero_grad(set_to_none=True)
    snapshot = [p.detach().to("cpu", copy=True) for p in base.parameters()] if args.report_updates else None

    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16
                else torch.autocast(device.type, enabled=False))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # Warm-up: one forward + backward on a short example (kernel selection, thread pools, lazy inits), no step.
    with autocast:
        model(warm)["loss"].backward()
    opt.zero_grad(set_to_none=True)
    times, cpu_times, fwd_peaks, step_peaks, losses, bases = [], [], [], [], [], []
    t_start = time.perf_counter()
    for s in range(args.steps):
        with Tracker(device) as tr:
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            with autocast:
                out = model(examples)
            fwd_peaks.append(tr.now_peak_mb())
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(trainable, max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        step_peaks.append(tr.peak_extra_mb)
        bases.append(tr.base_mb)
        losses.append(float(out["loss"].detach()))
        del out
        if s == 0 or (s + 1) % max(1, args.steps // 10) == 0 or s + 1 == args.steps:
            log(f"  {name}: step {s + 1}/{args.steps} {times[-1]:.2f}s loss {losses[-1]:.4f} "
                f"peak +{step_peaks[-1]:.0f} MB (forward +{fwd_peaks[-1]:.0f} MB)")
        if args.time_limit and time.perf_counter() - t_start > args.time_limit and s + 1 < args.steps:
            log(f"  {name}: stopped after {s + 1} of {args.steps} steps (--time-limit {args.time_limit}s)")
            break
    row = dict(config=name, teacher_ckpt=ckpt, frozen_teacher=frozen, steps=len(times),
               s_per_step=statistics.median(times[1:] if len(times) > 2 else times), first_step_s=times[0],
               cpu_s_per_step=statistics.median(cpu_times[1:] if len(cpu_times) > 2 else cpu_times),
               base_mb=min(bases), fwd_peak_mb=max(fwd_peaks), step_peak_mb=max(step_peaks),
               weights_mb=n_bytes(model.parameters()) / 2**20,
               teacher_mb=n_bytes(teacher.parameters()) / 2**20 if teacher is not None else 0.0,
               optim_mb=state_bytes(opt) / 2**20, loss_first=losses[0], loss_last=losses[-1],
               finite=all(math.isfinite(x) for x in losses))
    if device.type == "cuda":
        row["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        row["cuda_max_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    if snapshot is not None:  # how many weights moved at all (bf16 rounds small updates away)
        changed = total = 0
        for p, q in zip(base.parameters(), snapshot):
            changed += int((p.detach().cpu() != q).sum())
            total += q.numel()
        row["weights_changed_frac"] = changed / total
    del opt, model, teacher, snapshot
    for p in base.parameters():
        p.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def count_params(layers: int, vocab: int) -> int:
    """Trainable parameters of CodiModel at this shape (base on the meta device, + the projector)."""
    with torch.device("meta"):
        n = sum(p.numel() for p in build_base(layers, vocab, torch.float32, torch.device("meta"), 0).parameters())
    h = QWEN25_CODER_05B["hidden_size"]
    return n + 2 * h * h + 2 * h  # projector: two h x h linears, LayerNorm weight and bias


TIME_KEYS = ("s_per_step", "first_step_s", "cpu_s_per_step")
FIT_KEYS = (*TIME_KEYS, "base_mb", "fwd_peak_mb", "step_peak_mb", "weights_mb", "teacher_mb", "optim_mb")


def extrapolate(rows, target: int):
    """Per config, y = a + b * layers fitted (least squares) to the measured layer counts, evaluated at `target`."""
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        pts = [r for r in rows if r["config"] == name]
        xs = [r["layers"] for r in pts]
        if len(set(xs)) < 2 or target in xs:
            continue
        mx = statistics.mean(xs)
        sxx = sum((x - mx) ** 2 for x in xs)
        row = dict(pts[0], layers=target, measured=False, steps=0)
        for k in FIT_KEYS:
            ys = [r[k] for r in pts]
            b = sum((x - mx) * (y - statistics.mean(ys)) for x, y in zip(xs, ys)) / sxx
            # A time that falls with more layers is noise (a shared CPU) larger than the per-layer cost: no fit.
            bad = k in TIME_KEYS and b < 0
            row[k] = None if bad else statistics.mean(ys) + b * (target - mx)
            row[k + "_per_layer"] = None if bad else b
        out.append(row)
    return out


def projection(rows, n_params: int, cpu_dtype_bytes: int, batch: int = 8, gib=2**30):
    """Peak GPU memory of a codi step at `batch`, bf16, from the batch-1 activations. A model, not a measurement:

    static = P x (weights + grads + optimizer) bytes/param:
        fp32 + AdamW (torch)            4 + 4 + 8 = 16 (what the CPU rows measure)
        bf16 + AdamW (torch; its states take the parameters' dtype, bf16)   2 + 2 + 4 = 8
        bf16 + paged 8-bit AdamW (bitsandbytes)  2 + 2 + 2 (+ 2 x 4 B absmax per 256-value block = 0.03) = 6.03
          (tensors under 4096 values keep 32-bit states: norms and biases, < 0.1% of P here; "paged": the states
          live in CUDA unified memory, which nvidia-smi counts and torch.cuda.max_memory_allocated does not)
        frozen teacher: + 2 bytes/param (bf16 weights, no grads, no states)
    activations = A x batch x (2 / cpu bytes), A = the forward peak above the step's start at batch 1 (the saved
        activations and KV caches at the end of the forward, when no gradient exists yet): linear in the batch
        (rows of equal length; padding adds to it) and halved by bf16 (the losses are computed in fp32 chunks
        either way, a small part).
    peak, lower = static - grads + activations (activations are freed as gradients appear during backward)
    peak, upper = static + activations (every gradient allocated while every activation is still held)
    Not included: the CUDA context and kernels (~0.5-1 GiB), the caching allocator's fragmentation.
    """
    per_param = {"bf16 + AdamW (bf16 states)": (2, 2, 4), "bf16 + paged 8-bit AdamW": (2, 2, 2 + 8 / 256)}
    out = []
    for r in rows:
        act = r["fwd_peak_mb"] * 2**20 * batch * 2 / cpu_dtype_bytes
        for opt_name, (w, g, s) in per_param.items():
            static = n_params * (w + g + s) + (n_params * 2 if r["frozen_teacher"] else 0)
            out.append(dict(config=r["config"], optim=opt_name, static_gib=static / gib, act_gib=act / gib,
                            lower_gib=(static - n_params * g + act) / gib, upper_gib=(static + act) / gib))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="the base's dtype (the stage loads it in bf16 on a GPU: precision auto)")
    ap.add_argument("--optim", default="adamw_torch", help="a TrainingArguments optim: adamw_torch, paged_adamw_8bit")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048, help="tokens per example (prompt + trace), at least")
    ap.add_argument("--layers", default=None,
                    help="decoder layer counts to measure, comma-separated (default: 24 on cuda; 1,3 on cpu, "
                         "extrapolated to 24, because 24 layers at seq 2048 need more than 24 GiB of RAM)")
    ap.add_argument("--target-layers", type=int, default=QWEN25_CODER_05B["num_hidden_layers"],
                    help="extrapolate to this many layers when it is not measured")
    ap.add_argument("--vocab", type=int, default=PIPELINE_VOCAB,
                    help=f"embedding rows ({PIPELINE_VOCAB} = the pipeline's Qwen2.5 table with the trace tokens)")
    ap.add_argument("--steps", type=int, default=1, help="measured steps per configuration")
    ap.add_argument("--configs", default="teacher_ckpt,no_teacher_ckpt", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--lr", type=float, default=1e-5, help="docs/GPU.md's setting for the 0.5B (codi.lr)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--time-limit", type=float, default=0.0, help="stop a configuration's steps after this many s (0: none)")
    ap.add_argument("--report-updates", action="store_true", help="report the share of base weights the steps changed")
    ap.add_argument("--no-projection", action="store_true")
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if bad := [c for c in names if c not in CONFIGS]:
        ap.error(f"--configs: unknown {bad}; expected of {list(CONFIGS)}")
    device = torch.device(args.device)
    layer_counts = [int(x) for x in (args.layers or ("24" if device.type == "cuda" else "1,3")).split(",")]

    def log(msg):
        print(msg, flush=True)

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    params = load_params(args.params)
    ids = token_ids_for(args.vocab)
    examples = [realistic_example(args.seq, ids, args.seed + e) for e in range(args.batch)]
    warm = [realistic_example(min(args.seq, 256), ids, args.seed + 1000)]
    tok = [len(e["prompt_ids"]) + len(e["trace_ids"]) for e in examples]
    frames = [len(e["spans"]) for e in examples]
    header = (f"torch {torch.__version__}, device {device}"
              + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f", {args.threads} threads")
              + f", base dtype {args.dtype}, optimizer {args.optim}, batch {args.batch}")
    log(header)
    shape = dict(QWEN25_CODER_05B, vocab_size=args.vocab)
    log("model: Qwen2.5-Coder-0.5B shape" + ("" if args.vocab == PIPELINE_VOCAB else " with vocab MODIFIED (dry run)")
        + ": " + ", ".join(f"{k} {shape[k]}" for k in (
            "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
            "tie_word_embeddings", "rope_theta", "max_position_embeddings"))
        + f"; decoder layers measured: {layer_counts}"
        + ("" if args.target_layers in layer_counts else f" (extrapolated to {args.target_layers})"
           if len(set(layer_counts)) > 1 else f" (the real model has {args.target_layers}: not extrapolated)"))
    log(f"codi: latent_steps {params.codi.latent_steps}, kd_layers {params.codi.kd_layers}, "
        f"alpha/beta/gamma {params.alpha}/{params.beta}/{params.gamma} (params.yaml); examples: "
        f"{tok} tokens, {frames} LINE frames")

    rows = []
    for layers in layer_counts:
        t0 = time.perf_counter()
        base = build_base(layers, args.vocab, dtype, device, args.seed)
        log(f"base, {layers} layers: {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters, "
            f"built in {time.perf_counter() - t0:.1f}s")
        for n in names:
            rows.append(dict(run_config(n, base, ids, params, args, device, dtype, examples, warm, log),
                             layers=layers, measured=True))
        del base
        gc.collect()
    extra = extrapolate(rows, args.target_layers)
    n_target = count_params(args.target_layers, args.vocab)

    mem = "CUDA MB" if device.type == "cuda" else "RSS MB"

    def num(x):
        return "n/a" if x is None else f"{x:.1f}"
    log(f"\nMeasured: codi step (forward + backward + clip + {args.optim} step), batch {args.batch}, "
        f"~{round(statistics.mean(tok))} tokens/example ({round(statistics.mean(frames))} LINE frames), {args.dtype}, "
        f"{device}" + ("" if device.type == "cuda" else f", {args.threads} threads"))
    log(f"\n| layers | config | steps | s/step | CPU s/step (all threads) | start-of-step {mem} | forward peak +{mem} | "
        f"step peak +{mem} | step peak {mem} | weights MB | optimizer states MB | loss first -> last |")
    log("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows + extra:
        loss = f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}" if r["measured"] else "EXTRAPOLATED, not measured"
        lay = str(r["layers"]) if r["measured"] else f"**{r['layers']}** (fit)"
        log(f"| {lay} | {r['config']} | {r['steps']} | {num(r['s_per_step'])} | {num(r['cpu_s_per_step'])} | "
            f"{r['base_mb']:.0f} | {r['fwd_peak_mb']:.0f} | {r['step_peak_mb']:.0f} | "
            f"{r['base_mb'] + r['step_peak_mb']:.0f} | {r['weights_mb'] + r['teacher_mb']:.0f} | {r['optim_mb']:.0f} | "
            f"{loss} |")
    if extra:
        log(f"Fit rows: each value = a + b x layers through the measured layer counts (every decoder layer is "
            f"identical: the same saved activations and compute), evaluated at {args.target_layers}; per layer: "
            + "; ".join(f"{r['config']} forward +{r['fwd_peak_mb_per_layer']:.0f} MB, step +{r['step_peak_mb_per_layer']:.0f} MB, "
                        f"wall {num(r['s_per_step_per_layer'])} s, CPU {num(r['cpu_s_per_step_per_layer'])} s"
                        for r in extra)
            + " (n/a: a time that fell with more layers, i.e. noise from other load on the CPU, is not fitted)")
    if device.type == "cuda":
        log("CUDA max_memory_allocated MB: " + ", ".join(f"{r['layers']}L {r['config']} {r['cuda_max_allocated_mb']:.0f}" for r in rows)
            + "; max_memory_reserved MB: " + ", ".join(f"{r['layers']}L {r['config']} {r['cuda_max_reserved_mb']:.0f}" for r in rows))
    if any("weights_changed_frac" in r for r in rows):
        log("share of base weights changed by the steps: "
            + ", ".join(f"{r['layers']}L {r['config']} {r['weights_changed_frac']:.1%}" for r in rows if "weights_changed_frac" in r))
    log("all losses finite: " + ("yes" if all(r["finite"] for r in rows) else "NO"))

    proj = []
    target = [r for r in rows + extra if r["layers"] == args.target_layers]
    if not args.no_projection and device.type == "cpu" and target:
        proj = projection(target, n_target, 4 if dtype == torch.float32 else 2)
        how = "measured" if target[0]["measured"] else "extrapolated"
        log(f"\nPROJECTION (arithmetic, not measured): peak GPU memory of one codi step at batch 8, bf16, "
            f"{args.target_layers} layers, ~{round(statistics.mean(tok))} tokens/example, from the batch-1 {args.dtype} "
            f"forward peak ({how}, above); P = {n_target / 1e6:.1f}M trainable parameters")
        log("\n| config | optimizer | weights+grads+states GiB | activations GiB (8 x A x bf16/fp32) | "
            "peak GiB, lower | peak GiB, upper |")
        log("|---|---|---:|---:|---:|---:|")
        for p in proj:
            log(f"| {p['config']} | {p['optim']} | {p['static_gib']:.1f} | {p['act_gib']:.1f} | "
                f"{p['lower_gib']:.1f} | {p['upper_gib']:.1f} |")
        log("\nModel: static = P x (weights + grads + states) bytes/param: bf16 + AdamW 2+2+4, bf16 + paged 8-bit "
            "AdamW 2+2+2.03 (states in CUDA unified memory: nvidia-smi counts them, max_memory_allocated does "
            "not); A = forward peak at batch 1, linear in the batch, halved in bf16; lower = static - grads + "
            "activations, upper = static + activations; CUDA context (~0.5-1 GiB) and fragmentation not "
            "included (docstring of projection()).")
    if args.json:
        args.json.write_text(json.dumps({"header": header, "shape": shape, "rows": rows, "extrapolated": extra,
                                         "projection": proj}, indent=2))
    return rows, proj


if __name__ == "__main__":
    measured, _ = main()
    sys.exit(0 if all(r["finite"] for r in measured) else 1)  # a non-finite loss fails the run (gpu_check.sh)
