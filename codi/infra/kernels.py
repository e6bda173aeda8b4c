"""Which CPU kernels torch computes with: `kernels.cpu` of params.yaml, applied before torch is imported.

    pins = pin_cpu_kernels("avx2")      # sets ATEN_CPU_CAPABILITY, MKL_CBWR, ONEDNN_MAX_CPU_ISA in os.environ
    check_cpu_kernels("avx2")           # after torch is imported: torch really runs the AVX2 kernels here
    kernels_in_effect()                 # {"choice": "avx2", "capability": "AVX2", "env": {...}}: logged, fingerprinted

Torch's CPU build carries each kernel several times, one per instruction set, and picks the widest the host has:
an AVX-512 host and an AVX2-only host compute other floats for the same op (ATen's vectorised kernels, MKL's
GEMM, oneDNN's primitives: three libraries, each with its own dispatch). A training run is a long chain of such
ops, so two hosts end with other weights and, for a recipe that has not converged, other accuracies. Pinning all
three libraries to AVX2 makes any x86-64 host with AVX2 compute what an AVX2-only host computes, bit for bit
(docs/design/reproducibility.md gives the measured md5s of each pin set, and what they cost).

`python -m codi` pins before it imports any stage (the libraries read these variables once, when they first
run); every process it starts (the CPU data-parallel workers, DVC's stages, the Prefect flows' subprocesses)
inherits the environment. `native` sets nothing: the fastest kernels, reproducible on the same host only.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from codi.infra.config import ConfigError

# Each choice: the environment that pins it. ATen reads ATEN_CPU_CAPABILITY, MKL reads MKL_CBWR (conditional
# numerical reproducibility: the AVX2 code path whatever the CPU), oneDNN reads ONEDNN_MAX_CPU_ISA (GELU and
# other primitives torch runs through it). Pinning two of the three is not enough: with ATen and MKL pinned,
# oneDNN's AVX-512 GELU alone still gives an AVX-512 host other floats (measured; the design note has the md5s).
CPU_KERNEL_PINS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
# What torch.backends.cpu.get_cpu_capability() reports once a pin took effect.
EXPECTED_CAPABILITY = {"avx2": "AVX2"}
CHOICES = tuple(CPU_KERNEL_PINS)
KEY = "kernels.cpu"


def pin_cpu_kernels(choice: str, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the environment of `choice` in `environ` (default os.environ); the variables it set.

    A variable the environment already sets to another value is an error naming both: a user's own pin and the
    params file must agree (or the params file says `native`, which leaves the environment as it is)."""
    environ = os.environ if environ is None else environ
    if choice not in CPU_KERNEL_PINS:
        raise ConfigError(f"{KEY} = {choice!r}: expected one of {list(CHOICES)}")
    pins = CPU_KERNEL_PINS[choice]
    for var, value in pins.items():
        have = environ.get(var)
        if have is not None and have != value:
            raise ConfigError(f"{KEY} = {choice!r} pins {var}={value}, but the environment sets {var}={have}: "
                              f"unset {var}, or set {KEY}: native to compute with the environment's choice")
    environ.update(pins)
    return dict(pins)


def check_cpu_kernels(choice: str) -> str:
    """After torch is imported: the capability torch runs with; an error if it is not the one `choice` pins.

    Torch reads ATEN_CPU_CAPABILITY when it first dispatches a kernel: a process that imported and used torch
    before the pin (or a host without AVX2, where torch falls back to a narrower set) would compute other floats
    than the params file promises."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    expected = EXPECTED_CAPABILITY.get(choice)
    if expected is not None and capability != expected:
        raise ConfigError(f"{KEY} = {choice!r}: torch runs the {capability} kernels in this process, not {expected} "
                          f"(a CPU without AVX2 and FMA, or torch ran before the pin was set: start the stage "
                          f"through `python -m codi`); set {KEY}: native to compute with this host's own kernels")
    return capability


def kernels_in_effect(choice: str) -> dict[str, object]:
    """What this process computes with: the params choice, torch's capability, and the pinning variables' values.
    Part of a training run's fingerprint (a checkpoint of other kernels is not resumed) and of its log."""
    import torch

    return {"choice": choice, "capability": torch.backends.cpu.get_cpu_capability(),
            "env": {var: os.environ.get(var, "") for var in CPU_KERNEL_PINS["avx2"]}}


def describe_kernels(choice: str) -> str:
    """One line for a stage's log: the choice, what it pinned, and the kernels torch runs."""
    effect = kernels_in_effect(choice)
    pins = " ".join(f"{k}={v}" for k, v in effect["env"].items() if v) or "nothing pinned"
    return f"cpu kernels: {KEY} = {choice} ({pins}); torch runs {effect['capability']}"


# The md5 of kernel_ops_md5() under the avx2 pins, per torch version: measured on a 2-core AMD EPYC without AVX-512
# (where the pins change nothing) and on a 2-core AMD EPYC with AVX-512 under the pins; equal, as the pins promise.
AVX2_OPS_MD5 = {"2.13.0": "49c3da3239b2fa1e40ae4c2e7e9604d9"}


def kernel_ops_md5() -> str:
    """One md5 over a few ops of a tiny transformer (GEMM, GELU, layer norm, softmax, causal attention), one thread:
    two hosts that print the same md5 under the same pins compute these ops bit for bit alike."""
    import hashlib

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a, w, b = torch.randn(64, 96, generator=gen), torch.randn(96, 96, generator=gen), torch.randn(64, 64, 96, generator=gen)
        f = torch.nn.functional
        out = [a @ w, f.gelu(a @ w), f.layer_norm(a, (96,)), torch.softmax(a @ a.T / 9.8, -1),
               f.scaled_dot_product_attention(b[None], b[None], b[None], is_causal=True)]
        return hashlib.md5(b"".join(o.contiguous().numpy().tobytes() for o in out)).hexdigest()
    finally:
        torch.set_num_threads(threads)
