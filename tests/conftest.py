"""Test-wide settings: nothing reaches the network, logs stay in tmp folders, one torch thread."""

from __future__ import annotations

import os

# Set before anything imports dvc, wandb, transformers or huggingface_hub.
os.environ["DVC_NO_ANALYTICS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = os.environ.get("CODI_TEST_WANDB_MODE", "disabled")
os.environ["WANDB_SILENT"] = "true"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The committed default's CPU kernels (params.yaml kernels.cpu: avx2), before anything imports torch: stages run
# in-process here check that torch computes with the kernels their params pin (codi.infra.kernels).
from codi.infra.kernels import CPU_KERNEL_PINS  # noqa: E402  (stdlib and yaml only: no torch)

for _var, _value in CPU_KERNEL_PINS["avx2"].items():
    os.environ.setdefault(_var, _value)

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    torch.set_num_threads(1)
