"""`python -m codi kernels`: which CPU kernels torch computes with on this host, under params.yaml's `kernels.cpu`.

    python -m codi kernels
    # cpu kernels: kernels.cpu = avx2 (ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2); torch runs AVX2
    # ops md5 49c3da3239b2fa1e40ae4c2e7e9604d9: the avx2 reference of torch 2.13.0: this host computes as the committed runs

Two hosts that print the same md5 compute a training run's ops bit for bit alike, so `dvc repro` gives them the
same models. Not a DVC stage: it writes nothing. docs/design/reproducibility.md says what each choice promises.
"""

from __future__ import annotations

from dataclasses import dataclass

from codi.infra.kernels import AVX2_OPS_MD5, check_cpu_kernels, describe_kernels, kernel_ops_md5
from codi.schemas.kernels import KernelsConfig


@dataclass(frozen=True)
class KernelsParams:
    """What this command reads from params.yaml."""

    kernels: KernelsConfig


def run(params: KernelsParams) -> int:
    """Print the kernels in effect and the ops md5; exit 1 if the avx2 pins give other floats than the reference."""
    import torch

    choice = params.kernels.cpu
    check_cpu_kernels(choice)
    print(describe_kernels(choice))
    md5 = kernel_ops_md5()
    version = torch.__version__.split("+")[0]
    reference = AVX2_OPS_MD5.get(version)
    if choice != "avx2":
        print(f"ops md5 {md5} (native kernels: compare it with another host's `python -m codi kernels` under the "
              "same choice; equal md5s compute alike)")
        return 0
    if reference is None:
        print(f"ops md5 {md5}: no avx2 reference for torch {version} (known: {sorted(AVX2_OPS_MD5)})")
        return 0
    if md5 == reference:
        print(f"ops md5 {md5}: the avx2 reference of torch {version}: this host computes as the committed runs")
        return 0
    print(f"ops md5 {md5}: NOT the avx2 reference of torch {version} ({reference}): this host computes other floats "
          "under the same pins; a `dvc repro` here gives other models than the committed ones")
    return 1
