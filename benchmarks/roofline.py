"""Roofline: each stage's achieved FLOP rate against this host's matmul rate at the model's own shapes.

    python benchmarks/roofline.py                     # the committed default: params.yaml, models/sft, metrics/
    python benchmarks/roofline.py --repeats 5 --json roofline.json

What it prints, per stage (sft, sft_direct, codi, and evaluate's decoding per mode):
- the stage's achieved rate, from what the stage measured and committed (metrics/*.json): sft's non-padding
  tokens/s, codi's examples/s, evaluate's mean decoding time per example; times the FLOPs that work costs;
- the roof: the matmul rate this host reaches on the GEMMs that stage's step is made of (every Linear of the
  model and the head, forward and, for training, both backward GEMMs) at the rows a step feeds them, measured
  here, in as many processes of one torch thread as the stage runs (each process times its own GEMMs; the
  roof is their sum, so it includes what two processes cost each other on a shared memory bus);
- achieved / roof. The roof leaves out attention's own small matmuls, softmax, norms and the optimizer, which
  the FLOP count leaves out too, so the fraction is the share of the host's GEMM rate that reaches the model's
  GEMMs: 1 would mean no time anywhere else.

FLOPs of one token, forward (multiply-add = 2 FLOPs), for a Qwen2/Llama block with hidden h, FFN f, KV width
k, vocabulary V, and a causal context c (the mean over a sequence of T tokens is (T + 1) / 2):
    per layer  2h(h + 2k) [q, k, v] + 2h^2 [o] + 6hf [gate, up, down] + 4ch [scores, weighted sum]
    head       2hV
Training is 3x the forward (the backward's two GEMMs per forward one), 4x with gradient checkpointing, which
recomputes the forward. codi runs the teacher on the T tokens of prompt + explicit trace and the student on
T / compression positions (metrics/eval.json's compression), both trained; where the student reuses the teacher's
shared prefix (the default), only the positions after it, attending to it. Decoding is one forward per
position: the prompt's prefill, then each generated one (the prompt length is the cache's mean,
metrics/precompute.json).

The stage figures are the committed run's, on the host that ran `dvc repro`: run this benchmark on that host,
with the same `kernels.cpu`, and on an otherwise idle machine. It pins the kernels as params.yaml says.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codi.infra.config import load_params  # noqa: E402  (no torch yet: the pins come first)
from codi.infra.kernels import pin_cpu_kernels  # noqa: E402


@dataclass(frozen=True)
class Dims:
    """The model's shape, from its Hugging Face config.json."""

    hidden: int
    ffn: int
    layers: int
    kv_width: int
    vocab: int

    @classmethod
    def from_config(cls, path: Path) -> Dims:
        cfg = json.loads(path.read_text())
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(hidden=cfg["hidden_size"], ffn=cfg["intermediate_size"], layers=cfg["num_hidden_layers"],
                   kv_width=head_dim * cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                   vocab=cfg["vocab_size"])

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every GEMM weight a token passes through: q, k, v, o, gate, up, down per layer; the head."""
        h, f, k = self.hidden, self.ffn, self.kv_width
        return [(h, h), (h, k), (h, k), (h, h), (h, f), (h, f), (f, h)] * self.layers + [(h, self.vocab)]

    def forward_flops(self, context: float) -> float:
        """FLOPs of one token's forward at a causal context of `context` tokens."""
        linear = sum(2 * i * o for i, o in self.linear_shapes())
        return linear + self.layers * 4 * context * self.hidden


def _gemm_rate(dims: Dims, rows: int, backward: bool, repeats: int, barrier, out) -> None:
    """One process: the best of `repeats` timed passes over the model's GEMMs at `rows` rows (FLOP/s)."""
    import time

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = [torch.randn(o, i, requires_grad=backward) for i, o in dims.linear_shapes()]
    inputs = [torch.randn(rows, i, requires_grad=backward) for i, _ in dims.linear_shapes()]
    grads = [torch.randn(rows, o) for _, o in dims.linear_shapes()]
    flops = sum(2 * rows * i * o for i, o in dims.linear_shapes()) * (3 if backward else 1)

    def one_pass() -> None:
        for x, w, g in zip(inputs, weights, grads):
            y = torch.nn.functional.linear(x, w)
            if backward:
                torch.autograd.backward(y, g)
        if backward:
            for t in (*inputs, *weights):
                t.grad = None

    passes = max(1, int(2e8 // flops))  # about 0.1-0.3 s a timing at tens of GFLOP/s
    for _ in range(2):
        one_pass()
    barrier.wait()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(passes):
            one_pass()
        best = min(best, (time.perf_counter() - t0) / passes)
    out.put(flops / best)


def gemm_roof(dims: Dims, rows: int, backward: bool, processes: int, repeats: int) -> float:
    """The host's matmul rate (FLOP/s) on the model's GEMMs: the sum over `processes` concurrent processes."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_gemm_rate, args=(dims, rows, backward, repeats, barrier, out))
             for _ in range(processes)]
    for p in procs:
        p.start()
    rates = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(rates)


@dataclass
class Row:
    stage: str
    work: str
    rows: int
    processes: int
    achieved_gflops: float
    roof_gflops: float

    @property
    def fraction(self) -> float:
        return self.achieved_gflops / self.roof_gflops


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path} not found: run `dvc repro` (or `dvc pull`) first") from None


def shared_prefix(cache: Path) -> float:
    """Mean length of the student's shared prefix over the cache's train split: the prompt and the trace up to the
    first LINE frame's `<|line_sep|>` (the whole example when it has no LINE frame)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    path = cache / "train.arrow"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found: run `dvc repro` (or `dvc pull`) first")
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    prompt = pc.list_value_length(table.column("prompt_ids")).to_pylist()
    trace = pc.list_value_length(table.column("trace_ids")).to_pylist()
    first = [s[0] + 1 if s else t for s, t in zip(table.column("span_starts").to_pylist(), trace)]
    return sum(p + f for p, f in zip(prompt, first)) / max(len(prompt), 1)


def stage_rows(args: argparse.Namespace, dims: Dims) -> list[Row]:
    params = load_params(args.params)
    metrics = args.metrics
    tokens = _json(metrics / "precompute.json")["tokens"]
    total, prompt = tokens["mean_total"], tokens["mean_prompt"]
    evaluation = _json(metrics / "eval.json")
    rows: list[Row] = []

    def train_factor(section) -> int:
        return 4 if section.gradient_checkpointing else 3

    # sft_direct trains on prompt + answer: the answer's tokens are what evaluate's direct mode generates
    answer = evaluation["direct"]["mean_positions"]
    for stage, section, length in (("sft", params.sft, total), ("sft_direct", params.sft_direct, prompt + answer)):
        m = _json(metrics / f"{stage}.json")
        flops = m["tokens_per_s"] * dims.forward_flops((length + 1) / 2) * train_factor(section)
        rows.append(Row(stage, f"{m['tokens_per_s']:.0f} tokens/s, {length:.0f} tokens/example",
                        int(section.batch_size * length), section.cpu_processes, flops / 1e9, 0.0))

    m, section = _json(metrics / "codi.json"), params.codi
    student = total / evaluation["compression"]
    # The student computes only what follows the shared prefix when it reuses the teacher's (CodiModel._reuses_prefix:
    # no checkpointed teacher, no frozen one; the default): its FLOPs are those positions, attending to all before.
    shared = shared_prefix(args.cache) if not (section.gradient_checkpointing or section.frozen_teacher) else 0.0
    own = student - shared
    per_example = (total * dims.forward_flops((total + 1) / 2)
                   + own * dims.forward_flops(shared + (own + 1) / 2)) * train_factor(section)
    rows.append(Row("codi", f"{m['examples_per_s']:.1f} examples/s, teacher {total:.0f} + student {own:.0f} "
                    f"positions" + (f" (after a shared prefix of {shared:.0f})" if shared else ""),
                    int(section.batch_size * total), section.cpu_processes,
                    m["examples_per_s"] * per_example / 1e9, 0.0))

    for mode in params.evaluate.modes:
        stats = evaluation[mode]
        positions, seconds = stats["mean_positions"], stats["mean_time_ms"] / 1000
        length = prompt + positions  # the prompt's prefill, then one forward per generated position
        flops = length * dims.forward_flops((length + 1) / 2)
        rows.append(Row(f"evaluate: {mode}", f"{seconds * 1000:.1f} ms/example, {positions:.0f} positions",
                        params.evaluate.batch_size, 1, flops / seconds / 1e9, 0.0))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "sft", help="a folder with config.json")
    parser.add_argument("--metrics", type=Path, default=ROOT / "metrics")
    parser.add_argument("--cache", type=Path, default=ROOT / "data" / "cache", help="the precompute stage's cache "
                        "(codi's shared prefix)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per roof; the best counts")
    parser.add_argument("--json", type=Path, help="write the table here too")
    args = parser.parse_args(argv)

    kernels = load_params(args.params).kernels.cpu
    pin_cpu_kernels(kernels)  # before torch, in this process and the spawned ones (they inherit the environment)
    dims = Dims.from_config(args.model / "config.json")
    rows = stage_rows(args, dims)
    roofs: dict[tuple[int, bool, int], float] = {}
    for row in rows:
        key = (row.rows, not row.stage.startswith("evaluate"), row.processes)
        if key not in roofs:
            roofs[key] = gemm_roof(dims, *key, repeats=args.repeats) / 1e9
        row.roof_gflops = roofs[key]

    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, kernels.cpu {kernels}"
    print(f"roofline on {host}; model {asdict(dims)}")
    print(f"| stage | work (committed metrics) | GEMM rows | processes | achieved GFLOP/s | roof GFLOP/s | fraction |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.stage} | {r.work} | {r.rows} | {r.processes} | {r.achieved_gflops:.1f} | {r.roof_gflops:.1f} "
              f"| {r.fraction:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"host": host, "dims": asdict(dims),
                                         "rows": [{**asdict(r), "fraction": r.fraction} for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
