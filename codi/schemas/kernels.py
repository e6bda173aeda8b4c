"""The `kernels` section: which CPU kernels torch computes with (codi/infra/kernels.py applies it).

A dependency of every stage that runs torch (precompute, sft, sft_direct, codi, evaluate): other kernels give
other floats, so changing it reruns them. It does not touch a GPU's kernels (docs/GPU.md, "Reproducibility").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from codi.infra.config import option


@dataclass(frozen=True)
class KernelsConfig:
    """Which CPU kernels torch computes with, pinned before torch is imported (docs/design/reproducibility.md)."""

    cpu: Literal["native", "avx2"] = option(
        "avx2: ATen, MKL and oneDNN pinned to AVX2, the same floats on any x86-64 host with AVX2 (the committed "
        "results); native: each library's widest kernels, fastest, reproducible on the same host only")
