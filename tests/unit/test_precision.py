"""bf16 on CPU against the fp32 oracle, the dtypes the docs claim, and the device policy (`precision: auto`,
`optimizer: auto`) here and, with the CUDA checks mocked, on a GPU machine.

The tolerance. bf16 keeps 8 significant bits: its unit roundoff is u = 2^-8 = 3.9e-3. Every matmul output,
norm and activation of the bf16 model is rounded to it, so a bf16 run differs from fp32 by a few u in the
losses and by more in the gradients (they are products of many rounded factors; on these tiny models the
per-parameter relative error is 1-7e-2). What batching must not do is add error of its own. So the
reference for "close enough" is the per-example oracle itself run in bf16: the batched bf16 model must be
as close to the fp32 oracle as the bf16 oracle is, within 2x plus 2u (the two round in different places,
so their errors differ; measured on this grid the batched error is 0.01-1.4x the oracle's), and never
further than 4u on a loss or 0.1 on a gradient's relative norm.
"""

from __future__ import annotations

import copy
import random
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from codi.infra import device  # noqa: E402
from codi.infra.config import ConfigError  # noqa: E402
from codi.modeling.latent import PaddedRows, latent_input  # noqa: E402
from codi.training.args import training_arguments  # noqa: E402
from tests.codi_oracle import oracle_forward, tiny_base  # noqa: E402
from tests.tiny import shipped  # noqa: E402
from tests.unit.test_modeling_equivalence import LOSS_KEYS, NEW_OPTIONS, OPTIONS, build, edge_batch, mixed_batch, run  # noqa: E402

U = 2.0 ** -8  # bf16 unit roundoff


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / (b.norm() + 1e-12))


def bf16_errors(model, examples, ss_prob: float = 0.0) -> dict[str, tuple[float, float]]:
    """name -> (batched bf16 error, oracle bf16 error), each against the fp32 oracle: relative for each loss,
    relative norm for each parameter's gradient."""
    ref_out, ref_grads = run(lambda: oracle_forward(model, examples, ss_prob, random.Random(7)), model)
    low = copy.deepcopy(model).to(torch.bfloat16)
    o_out, o_grads = run(lambda: oracle_forward(low, examples, ss_prob, random.Random(7)), low)
    b_out, b_grads = run(lambda: low(examples, ss_prob=ss_prob, ss_rng=random.Random(7)), low)
    errors = {}
    for k in LOSS_KEYS:
        assert b_out[k].dtype == torch.float32, f"{k} is {b_out[k].dtype}: the losses are float32 (docs)"
        ref = float(ref_out[k])
        errors[k] = tuple(abs(float(x[k]) - ref) / (abs(ref) + 1e-6) for x in (b_out, o_out))
    for name, g in ref_grads.items():
        if g is not None:
            assert b_grads[name].dtype == torch.bfloat16, name
            errors[name] = (relative(b_grads[name], g), relative(o_grads[name], g))
    return errors


CASES = {
    **{f"{k}-{s}": (lambda k=k, s=s: build(s, **OPTIONS[k]), mixed_batch, 0.0) for k in OPTIONS for s in (1, 3)},
    **{f"{k}-2": (lambda k=k: build(2, **NEW_OPTIONS[k]), mixed_batch, 0.0) for k in NEW_OPTIONS},
    "edges-ss": (lambda: build(2), edge_batch, 1.0),
    "frozen-teacher": (lambda: build(1, teacher=tiny_base(seed=5, layers=3)), lambda: mixed_batch(seed=2), 0.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_on_cpu_is_as_close_to_the_fp32_oracle_as_the_bf16_oracle(case):
    make_model, make_batch, ss_prob = CASES[case]
    errors = bf16_errors(make_model(), make_batch(), ss_prob)
    for name, (batched, oracle) in errors.items():
        cap = 4 * U if name in LOSS_KEYS else 0.1
        assert batched <= min(2 * oracle + 2 * U, cap) or batched <= 2 * U, \
            f"{name}: batched bf16 off the fp32 oracle by {batched:.2e} (bf16 oracle: {oracle:.2e}, cap {cap:.2e})"


def test_bf16_keeps_the_documented_dtypes_in_the_projector_latents_and_cache():
    model = build(2, recon_weight=0.5).to(torch.bfloat16)
    assert {p.dtype for p in model.projector.parameters()} == {torch.bfloat16}
    rows = PaddedRows(model.model.model, batch_size=2, device="cpu")
    embeds = model.model.get_input_embeddings()(torch.tensor([[3, 4, 5], [6, 7, 8]]))
    hidden, _ = rows.step(embeds, torch.ones(2, 3, dtype=torch.bool))
    assert hidden.dtype == torch.bfloat16
    assert {layer.keys.dtype for layer in rows.cache.layers} == {torch.bfloat16}  # the KV cache: model dtype
    latent = latent_input(model.projector, hidden[:, -1])
    assert latent.dtype == torch.bfloat16
    out = model(mixed_batch(frames=(2, 1)))
    assert {out[k].dtype for k in LOSS_KEYS} == {torch.float32}


# --------------------------------------------------------------------------------- device policy
def test_auto_resolves_to_fp32_and_adamw_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.resolve_precision("auto") == {"bf16": False, "fp16": False}
    assert device.resolve_optimizer("auto") == "adamw_torch"
    assert device.resolve_precision("bf16") == {"bf16": True, "fp16": False}  # an explicit choice is kept
    assert device.resolve_optimizer("adafactor") == "adafactor"


@pytest.fixture
def cuda(monkeypatch):
    """A machine whose torch reports a CUDA device (set `bf16` to say whether it supports bfloat16)."""
    state = types.SimpleNamespace(bf16=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: state.bf16)
    return state


def test_auto_on_a_gpu_is_bf16_where_supported(cuda):
    assert device.resolve_precision("auto") == {"bf16": True, "fp16": False}
    cuda.bf16 = False  # e.g. a V100: fp32, never a silent fp16
    assert device.resolve_precision("auto") == {"bf16": False, "fp16": False}


def test_auto_optimizer_on_a_gpu_is_paged_8bit_adamw_only_with_bitsandbytes(cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    assert device.resolve_optimizer("auto") == "paged_adamw_8bit"
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    assert device.resolve_optimizer("auto") == "adamw_torch"


def test_training_arguments_on_a_gpu_machine(cuda, monkeypatch, tmp_path):
    """What the Trainer is given on a GPU: bf16, paged 8-bit AdamW, not use_cpu, and no gloo under a launcher."""
    import transformers

    from codi.training.args import training_arguments
    from tests.tiny import shipped

    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    monkeypatch.setattr(transformers, "TrainingArguments", lambda **kw: kw)
    monkeypatch.setenv("WORLD_SIZE", "2")
    kw = training_arguments(shipped("codi", precision="auto", optimizer="auto"), tmp_path, "run", has_eval=True)
    assert (kw["bf16"], kw["fp16"], kw["optim"], kw["use_cpu"], kw["ddp_backend"]) == \
        (True, False, "paged_adamw_8bit", False, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kw = training_arguments(shipped("codi", precision="auto", optimizer="auto"), tmp_path, "run", has_eval=True)
    assert (kw["bf16"], kw["optim"], kw["use_cpu"], kw["ddp_backend"]) == (False, "adamw_torch", True, "gloo")


def test_an_8bit_optimizer_without_bitsandbytes_is_an_error_naming_the_key(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(ConfigError, match=r"sft\.optimizer = 'paged_adamw_8bit': needs bitsandbytes.*make install-gpu"):
        device.resolve_optimizer("paged_adamw_8bit", "sft.optimizer")
    with pytest.raises(ConfigError, match=r"codi\.optimizer = 'paged_adamw_8bit'"):
        training_arguments(shipped("codi", optimizer="paged_adamw_8bit"), tmp_path, "run", has_eval=True,
                           section="codi")
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    assert device.resolve_optimizer("paged_adamw_8bit", "sft.optimizer") == "paged_adamw_8bit"


def test_a_stage_start_line_says_what_auto_resolved_to_and_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.describe_resolution("auto", "auto", "sft") == (
        "sft: optimizer adamw_torch (sft.optimizer = auto, auto: no GPU), precision fp32 (sft.precision = auto, "
        "auto: CPU), on CPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H200")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    line = device.describe_resolution("auto", "auto", "codi")
    assert line == ("codi: optimizer adamw_torch (codi.optimizer = auto, auto: no bitsandbytes, so no 8-bit AdamW "
                    "(make install-gpu)), precision bf16 (codi.precision = auto, auto: the GPU supports bf16), on "
                    "CUDA (NVIDIA H200)")
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    assert "optimizer paged_adamw_8bit (codi.optimizer = auto, auto: a GPU with bitsandbytes)" in \
        device.describe_resolution("auto", "fp32", "codi")
