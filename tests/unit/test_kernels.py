"""kernels.cpu: the CPU kernels torch computes with, pinned before torch is imported (codi.infra.kernels)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from codi.__main__ import main
from codi.infra.config import ConfigError
from codi.infra.kernels import AVX2_OPS_MD5, CPU_KERNEL_PINS, check_cpu_kernels, pin_cpu_kernels
from tests.tiny import ROOT, tiny_params, write_params

X86 = platform.machine() in ("x86_64", "AMD64")


def test_avx2_pins_all_three_libraries():
    env: dict[str, str] = {}
    assert pin_cpu_kernels("avx2", env) == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
                                            "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert env == CPU_KERNEL_PINS["avx2"]
    pin_cpu_kernels("avx2", env)  # again: the same values are no conflict


def test_native_leaves_the_environment_as_it_is():
    env = {"ATEN_CPU_CAPABILITY": "default"}
    assert pin_cpu_kernels("native", env) == {}
    assert env == {"ATEN_CPU_CAPABILITY": "default"}


def test_a_conflicting_environment_is_an_error_naming_the_variable_and_the_key():
    env = {"MKL_CBWR": "COMPATIBLE"}
    with pytest.raises(ConfigError, match=r"kernels.cpu = 'avx2' pins MKL_CBWR=AVX2, but the environment sets "
                                          r"MKL_CBWR=COMPATIBLE"):
        pin_cpu_kernels("avx2", env)
    assert env == {"MKL_CBWR": "COMPATIBLE"}  # nothing set half-way


def test_an_unknown_choice_is_an_error():
    with pytest.raises(ConfigError, match="kernels.cpu = 'avx512'"):
        pin_cpu_kernels("avx512", {})


def test_params_rejects_an_unknown_choice(tmp_path, capsys):
    path = write_params(tmp_path / "params.yaml", tiny_params(kernels={"cpu": "fast"}))
    assert main(["--params", str(path), "params"]) == 2
    assert "kernels.cpu" in capsys.readouterr().err


@pytest.mark.skipif(not X86, reason="the pins are x86 instruction sets")
def test_this_test_process_runs_the_pinned_kernels():
    """conftest pins avx2 before torch is imported, as `python -m codi` does for a stage."""
    assert check_cpu_kernels("avx2") == "AVX2"


@pytest.mark.skipif(not X86, reason="the pins are x86 instruction sets")
def test_the_kernels_command_pins_and_matches_the_avx2_reference(tmp_path):
    """`python -m codi kernels` in a fresh process with no pins in its environment: params.yaml's avx2 pins take
    effect before torch is imported, and this host then computes the reference floats of an AVX2-only host."""
    import torch

    version = torch.__version__.split("+")[0]
    env = {k: v for k, v in os.environ.items() if k not in CPU_KERNEL_PINS["avx2"]}
    out = subprocess.run([sys.executable, "-m", "codi", "--params", str(ROOT / "params.yaml"), "kernels"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "torch runs AVX2" in out.stdout, out.stdout + out.stderr
    if version in AVX2_OPS_MD5:
        assert f"ops md5 {AVX2_OPS_MD5[version]}" in out.stdout and out.returncode == 0, out.stdout


@pytest.mark.skipif(not X86, reason="the pins are x86 instruction sets")
def test_a_stage_refuses_kernels_other_than_its_params_pin(tmp_path):
    """A process whose torch already runs other kernels than the params pin (here: the environment says default,
    and the params file native would keep it; avx2 must refuse it before any work)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    path = write_params(tmp_path / "params.yaml", tiny_params(kernels={"cpu": "avx2"}))
    out = subprocess.run([sys.executable, "-m", "codi", "--params", str(path), "kernels"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "error: params" not in out.stderr and "ATEN_CPU_CAPABILITY=avx2, but the environment sets " \
        "ATEN_CPU_CAPABILITY=default" in out.stderr
