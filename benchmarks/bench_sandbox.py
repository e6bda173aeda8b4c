"""Sandboxed tracing throughput: the persistent fork-per-sample pool vs one fresh interpreter per sample.

    python benchmarks/bench_sandbox.py                      # 300 generated MBPP-sized samples, 2 workers
    python benchmarks/bench_sandbox.py --n 500 --workers 2 --source mbpp --mbpp data/raw/mbpp.jsonl

Both paths use the same isolation (codi.tracing.sandbox: namespaces + unprivileged uid as root) and
the same limits, and run `--workers` samples at a time; the fresh path starts a new interpreter
(`trace_in_fresh_interpreter`) for every sample. Prints samples/s of each, the ratio (target >= 8
on 2 cores), and checks that both paths give the same statuses and frames.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codi.infra.config import load_params
from codi.schemas.extract import TraceConfig  # noqa: E402
from codi.sources.base import Sample  # noqa: E402
from codi.tracing.sandbox import TracerPool, trace_in_fresh_interpreter  # noqa: E402

SHIPPED = load_params(Path(__file__).resolve().parents[1] / "params.yaml")  # config dataclasses have no defaults

TEMPLATES = [
    ("def sum_even_squares(xs):\n    total = 0\n    for x in xs:\n        if x % 2 == 0:\n"
     "            total += x * x\n    return total\n", "sum_even_squares({ints})"),
    ("def reverse_words(s):\n    words = s.split()\n    return ' '.join(reversed(words))\n", "reverse_words({text!r})"),
    ("def char_count(s):\n    counts = {{}}\n    for ch in s:\n        counts[ch] = counts.get(ch, 0) + 1\n"
     "    return counts\n", "char_count({word!r})"),
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n", "fib({small})"),
    ("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n", "gcd({big}, {big2})"),
    ("def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n"
     "        if n % i == 0:\n            return False\n        i += 1\n    return True\n", "is_prime({big})"),
    ("def bsearch(xs, t):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n"
     "        if xs[mid] == t:\n            return mid\n        if xs[mid] < t:\n            lo = mid + 1\n"
     "        else:\n            hi = mid - 1\n    return -1\n", "bsearch({sorted_ints}, {small})"),
    ("def max_subarray(xs):\n    best = cur = xs[0]\n    for x in xs[1:]:\n        cur = max(x, cur + x)\n"
     "        best = max(best, cur)\n    return best\n", "max_subarray({signed})"),
    ("def dedupe(xs):\n    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n"
     "            seen.add(x)\n            out.append(x)\n    return out\n", "dedupe({ints})"),
    ("def fact(n):\n    if n <= 1:\n        return 1\n    return n * fact(n - 1)\n", "fact({small})"),
    ("def transpose(m):\n    return [[row[i] for row in m] for i in range(len(m[0]))]\n", "transpose({matrix})"),
    ("def is_palindrome(s):\n    t = ''.join(c.lower() for c in s if c.isalnum())\n    return t == t[::-1]\n",
     "is_palindrome({word!r})"),
    ("import heapq\ndef k_smallest(xs, k):\n    return heapq.nsmallest(k, xs)\n", "k_smallest({ints}, 3)"),
    ("import re\ndef long_words(s, n):\n    return re.findall(r'\\b\\w{{%d,}}\\b' % n, s)\n", "long_words({text!r}, 4)"),
    ("from collections import Counter\ndef top(xs):\n    c = Counter(xs)\n    return c.most_common(2)\n", "top({ints})"),
]
WORDS = "alpha beta gamma delta level radar python trace sandbox kayak noon tensor".split()


def generated(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        program, call = TEMPLATES[i % len(TEMPLATES)]
        ints = [rng.randint(0, 20) for _ in range(rng.randint(3, 9))]
        fields = {
            "ints": ints, "sorted_ints": sorted(set(ints)), "signed": [rng.randint(-9, 9) for _ in range(8)],
            "small": rng.randint(1, 12), "big": rng.randint(2, 5000), "big2": rng.randint(2, 5000),
            "word": rng.choice(WORDS), "text": " ".join(rng.choices(WORDS, k=5)),
            "matrix": [[rng.randint(0, 9) for _ in range(3)] for _ in range(2)],
        }
        out.append(Sample(f"gen/{i}", "synthetic", f"gen/{i % len(TEMPLATES)}", program.format(**fields),
                          call.format(**fields)))
    return out


def mbpp(path: Path, n: int) -> list[Sample]:
    from codi.sources.mbpp import harvest
    out: list[Sample] = []
    with path.open() as f:
        for line in f:
            out += harvest(json.loads(line)).samples
            if len(out) >= n:
                break
    return out[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="samples through the pool")
    ap.add_argument("--fresh-n", type=int, default=80, help="samples through fresh interpreters (slow)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--source", choices=["generated", "mbpp"], default="generated")
    ap.add_argument("--mbpp", type=Path, default=Path("/work/shared/datasets/mbpp/mbpp.jsonl"))
    args = ap.parse_args()
    samples = mbpp(args.mbpp, args.n) if args.source == "mbpp" else generated(args.n)
    trace, sandbox = SHIPPED.extract.trace, SHIPPED.extract.sandbox
    print(f"{len(samples)} {args.source} samples, {args.workers} workers, {os.cpu_count()} CPUs")

    t0 = time.perf_counter()
    with TracerPool(trace, sandbox, workers=args.workers) as pool:
        started = time.perf_counter() - t0
        print(f"isolation: {pool.isolation}")
        t0 = time.perf_counter()
        pooled = list(pool.trace(samples))
        pool_s = time.perf_counter() - t0
    pool_rate = len(samples) / pool_s

    few = samples[:args.fresh_n]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as ex:
        fresh = list(ex.map(lambda s: trace_in_fresh_interpreter(s, trace, sandbox), few))
    fresh_s = time.perf_counter() - t0
    fresh_rate = len(few) / fresh_s

    same = sum(a.status == b.status and a.frames == b.frames for a, b in zip(pooled, fresh))
    print(f"statuses (pool): {dict(Counter(r.status for r in pooled))}")
    print(f"pool:   {pool_rate:8.1f} samples/s  ({pool_s:.2f} s for {len(samples)}; workers started in {started:.2f} s;"
          f" {1000 * sum(r.time_s for r in pooled) / len(pooled):.2f} ms/sample in the worker)")
    print(f"fresh:  {fresh_rate:8.1f} samples/s  ({fresh_s:.2f} s for {len(few)})")
    print(f"ratio:  {pool_rate / fresh_rate:8.1f}x  (target >= 8)")
    print(f"agreement: {same}/{len(few)} samples give the same status and frames both ways")
    return 0 if same == len(few) else 1


if __name__ == "__main__":
    sys.exit(main())
