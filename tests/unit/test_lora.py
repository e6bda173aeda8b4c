"""LoRA and QLoRA (codi.modeling.lora): what trains, the folders a LoRA stage writes, resuming, and the params' errors.

Most tests use a random 2-layer Qwen2 (tests/codi_oracle.py); the last runs `python -m codi sft` and `codi`
with LoRA on a tiny workspace, as the pipeline does (about 10 s alone on 2 cores).
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from codi.infra.config import ConfigError, params_from_dict, sections
from codi.infra.hf import load_causal_lm
from codi.modeling.lora import (
    ADAPTER_DIR,
    LoraRun,
    apply_lora,
    load_for_lora,
    load_unmerged,
    new_token_ids,
    qlora_problem,
)
from codi.schemas.lora import LoraConfig
from codi.training.checkpoints import checkpoint_problem
from tests.codi_oracle import TOKEN_IDS, codi_model, make_example, tiny_base
from tests.tiny import shipped, tiny_params

torch.set_num_threads(1)

LORA = dict(r=4, alpha=8.0, dropout=0.0)


def lora_cfg(**kw) -> LoraConfig:
    return shipped("sft.lora", **{**LORA, **kw})


@pytest.fixture
def start(tmp_path) -> Path:
    """A saved random tiny model: the start model a LoRA run merges its adapter into."""
    folder = tmp_path / "start"
    tiny_base(seed=0).save_pretrained(folder)
    return folder


def lora_run(start: Path, **kw) -> LoraRun:
    torch.manual_seed(1)
    cfg = lora_cfg(**kw)
    return apply_lora(load_for_lora(start, torch.float32, cfg), cfg, TOKEN_IDS, start=start,
                      gradient_checkpointing=False)


def perturb_adapters(run: LoraRun, seed: int = 2) -> None:
    """Trained-looking adapters: B starts at zero (a fresh adapter changes nothing), so give every trainable
    weight some noise, as a few optimizer steps would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in run.peft.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def seq_batch(seed: int = 0, n: int = 3) -> torch.Tensor:
    rng = random.Random(seed)
    exs = [make_example(rng, k) for k in (1, 2, 3)[:n]]
    width = min(len(e["prompt_ids"]) + len(e["trace_ids"]) for e in exs)
    return torch.tensor([(e["prompt_ids"] + e["trace_ids"])[:width] for e in exs])


def trainable_kind(name: str) -> str | None:
    """What a parameter is: an adapter, the new token rows, the projector; None for the frozen base."""
    if ".lora_A." in name or ".lora_B." in name:
        return "adapter"
    if "trainable_tokens_delta" in name:
        return "token_rows"
    if name.startswith("projector."):
        return "projector"
    return None


def grads_by_kind(named) -> tuple[set[str], list[str]]:
    """(kinds that got a nonzero gradient, names of base parameters that got any gradient)."""
    kinds, leaked = set(), []
    for name, p in named:
        kind = trainable_kind(name)
        if kind is None:
            if p.requires_grad or p.grad is not None:
                leaked.append(name)
        else:
            assert p.requires_grad, name
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient"
            kinds.add(kind)
    return kinds, leaked


# ------------------------------------------------------------------------------------------- what trains
@pytest.mark.parametrize("tie", [True, False])
def test_sft_gradients_reach_only_the_adapters_and_the_new_token_rows(tmp_path, tie):
    folder = tmp_path / "start"
    tiny_base(seed=0, tie=tie).save_pretrained(folder)
    run = lora_run(folder)
    perturb_adapters(run)  # B starts at zero, and so would A's gradient
    ids = seq_batch()
    run.peft(input_ids=ids, labels=ids).loss.backward()
    kinds, leaked = grads_by_kind(run.peft.named_parameters())
    assert kinds == {"adapter", "token_rows"} and leaked == []
    lm = run.model
    emb, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    assert emb.token_adapter.token_indices["default"] == new_token_ids(TOKEN_IDS)
    # The head's rows of the new tokens train too: shared with the embedding when tied, their own when not.
    assert head.token_adapter.token_indices["default"] == new_token_ids(TOKEN_IDS)
    shared = head.token_adapter.trainable_tokens_delta["default"] is emb.token_adapter.trainable_tokens_delta["default"]
    assert shared == tie
    # The embedding matrix itself stays frozen: only the delta rows of the new tokens have a gradient.
    assert emb.token_adapter.trainable_tokens_delta["default"].shape[0] == len(new_token_ids(TOKEN_IDS))
    table = emb.token_adapter.get_base_layer().weight
    assert isinstance(table, torch.nn.Parameter) and not table.requires_grad and table.grad is None


def test_without_train_new_tokens_only_the_adapters_train(start):
    run = lora_run(start, train_new_tokens=False, target_modules=["q_proj", "v_proj"])
    perturb_adapters(run)
    ids = seq_batch()
    run.peft(input_ids=ids, labels=ids).loss.backward()
    kinds, leaked = grads_by_kind(run.peft.named_parameters())
    assert kinds == {"adapter"} and leaked == []
    adapted = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in run.peft.named_parameters() if ".lora_A." in n}
    assert adapted == {"q_proj", "v_proj"}


def test_reentrant_activation_checkpointing_still_reaches_the_adapters(start):
    """With a frozen embedding (no token rows) no checkpointed segment's input needs a gradient; the embedding's
    output must be made to require one (apply_lora does, as transformers does for reentrant checkpointing), or
    reentrant checkpointing would leave the adapters without gradients."""
    cfg = lora_cfg(train_new_tokens=False)
    run = apply_lora(load_for_lora(start, torch.float32, cfg), cfg, TOKEN_IDS, start=start,
                     gradient_checkpointing=True)
    perturb_adapters(run)
    run.peft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = seq_batch()
    run.peft(input_ids=ids, labels=ids).loss.backward()
    kinds, leaked = grads_by_kind(run.peft.named_parameters())
    assert kinds == {"adapter"} and leaked == []


def test_codi_gradients_reach_only_the_adapters_the_projector_and_the_new_token_rows(start):
    run = lora_run(start)
    model = codi_model(run.model, TOKEN_IDS, latent_steps=2)
    perturb_adapters(run)
    rng = random.Random(0)
    out = model([make_example(rng, n) for n in (1, 3, 2)])
    out["loss"].backward()
    kinds, leaked = grads_by_kind(model.named_parameters())
    assert kinds == {"adapter", "token_rows", "projector"} and leaked == []
    n_proj = sum(p.numel() for p in model.projector.parameters())
    assert all(p.requires_grad for p in model.projector.parameters()) and n_proj > 0


# ----------------------------------------------------------------------------------- merged or not
def test_a_lora_sft_folder_loads_merged_or_not_with_equal_logits(start, tmp_path):
    run = lora_run(start)
    perturb_adapters(run)
    run.peft.eval()
    ids = seq_batch()
    with torch.no_grad():
        live = run.peft(input_ids=ids).logits
        run.save(tmp_path / "sft")
        merged = load_causal_lm(tmp_path / "sft", torch.float32).eval()      # what codi and evaluate read
        unmerged = load_unmerged(tmp_path / "sft")                           # start model + adapter/
        base = load_causal_lm(start, torch.float32).eval()
        m, u, b = (x(input_ids=ids).logits for x in (merged, unmerged, base))
    assert type(merged).__name__ == "Qwen2ForCausalLM"
    assert (tmp_path / "sft" / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "sft" / "adapter_config.json").exists()  # transformers would load the folder as an adapter
    torch.testing.assert_close(m, u, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m, live, atol=1e-5, rtol=1e-5)
    assert (m - b).abs().max() > 1e-2  # the adapter and the token rows changed the model


def word_tokenizer():
    """A word-level tokenizer with the trace tokens added (a codi folder saves one; its ids must be the model's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from codi.tracing.tokens import add_trace_tokens

    tk = Tokenizer(models.WordLevel({"<unk>": 0, **{f"w{i}": i + 1 for i in range(40)}}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    add_trace_tokens(tok)
    return tok


def test_a_lora_codi_folder_loads_merged_or_not_with_equal_logits(tmp_path):
    from codi.modeling.io import load_codi_model, save_codi_model
    from codi.tracing.tokens import token_ids

    tok = word_tokenizer()
    tids = token_ids(tok)
    start = tmp_path / "sft"
    tiny_base(vocab=len(tok)).save_pretrained(start)
    cfg = lora_cfg()
    torch.manual_seed(1)
    run = apply_lora(load_for_lora(start, torch.float32, cfg), cfg, tids, start=start, gradient_checkpointing=False)
    model = codi_model(run.model, tids, latent_steps=2)
    perturb_adapters(run)
    model.eval()
    out = tmp_path / "codi"
    save_codi_model(model, tok, out, base=run.merged(run.save_adapter(out / ADAPTER_DIR)))
    loaded = load_codi_model(out)                 # what evaluate reads: merged base + projector
    unmerged = load_unmerged(out)                 # models/sft + adapter/
    ids = torch.tensor([[tids.trace_context_start, 5, 6, tids.frame_sep, tids.line_sep, 7, tids.action_sep, 8]])
    h = torch.randn(2, 32)
    with torch.no_grad():
        m, u, live = (x(input_ids=ids).logits for x in (loaded.model, unmerged, run.peft))
        torch.testing.assert_close(loaded.projector(h), model.projector(h))
    torch.testing.assert_close(m, u, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m, live, atol=1e-5, rtol=1e-5)
    assert (out / "codi_config.json").is_file() and not (out / "adapter_config.json").exists()


# ---------------------------------------------------------------------------------------- checkpoints
def test_an_adapter_checkpoint_is_complete_and_a_broken_one_is_not(tmp_path):
    import json

    from safetensors.torch import save_file

    d = tmp_path / "checkpoint-4"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    save_file({"w": torch.zeros(64)}, str(d / "adapter_model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({"x": torch.zeros(4)}, d / name)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    assert checkpoint_problem(d) is None                      # no config.json: a LoRA checkpoint has none
    (d / "adapter_model.safetensors").write_bytes((d / "adapter_model.safetensors").read_bytes()[:40])
    assert "truncated" in checkpoint_problem(d)
    (d / "adapter_model.safetensors").unlink()
    assert checkpoint_problem(d) == "adapter_model.safetensors missing"


# ------------------------------------------------------------------------------------------- params
@pytest.mark.parametrize("section,key,value,expected", [
    ("sft", "r", -1, "sft.lora.r = -1: expected an integer >= 0"),
    ("sft", "alpha", 0.0, "sft.lora.alpha = 0.0: expected a float > 0"),
    ("codi", "dropout", 1.0, "codi.lora.dropout = 1.0: expected a float >= 0.0 and < 1.0"),
    ("codi", "quantize", "8bit", "codi.lora.quantize = '8bit': expected one of 'none', '4bit'"),
    ("sft_direct", "target_modules", [], "sft_direct.lora.target_modules = []: expected a non-empty list"),
    ("sft", "target_modules", ["all-linear", "q_proj"], "sft.lora.target_modules = ['all-linear', 'q_proj']"),
    ("sft_direct", "quantize", "4bit", "sft_direct.lora.quantize = '4bit' with r = 0"),
    ("codi", "rank", 8, "unknown key codi.lora.rank"),
])
def test_bad_lora_values_name_the_key(section, key, value, expected):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("(", r"\(")):
        params_from_dict(tiny_params(**{section: {"lora": {key: value}}}))


@pytest.mark.skipif(qlora_problem() is None, reason="this machine can run QLoRA")
@pytest.mark.parametrize("stage", ["sft", "sft_direct", "codi"])
def test_qlora_without_cuda_is_a_config_error_naming_the_key_before_any_work(tmp_path, stage):
    params = params_from_dict(tiny_params(**{stage: {"lora": {"r": 16, "quantize": "4bit"}}}))
    nowhere = tmp_path / "nothing-here"  # no cache, no model: the error must come before anything is read
    with pytest.raises(ConfigError, match=rf"^{stage}\.lora\.quantize = '4bit': needs .*make install-gpu"):
        if stage == "codi":
            from codi.stages.codi_stage import CodiParams, run
            run(sections(params, CodiParams), nowhere, nowhere, nowhere, nowhere, nowhere, nowhere, nowhere, [])
        else:
            from codi.stages.sft import SftParams, run
            run(sections(params, SftParams), stage, nowhere, nowhere, nowhere, nowhere, nowhere, nowhere, nowhere,
                [])
    assert not any(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="needs"):
        load_for_lora(nowhere, torch.float32, lora_cfg(quantize="4bit"))


def test_lora_is_off_by_default_and_apply_lora_refuses_r_0(start):
    params = params_from_dict(tiny_params())
    assert all(not getattr(params, s).lora.enabled for s in ("sft", "sft_direct", "codi"))
    with pytest.raises(ValueError, match="r = 0"):
        apply_lora(tiny_base(), dataclasses.replace(lora_cfg(), r=0), TOKEN_IDS, start=start,
                   gradient_checkpointing=False)


# ------------------------------------------------------------------------------ the stages, end to end
@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A tiny workspace after extract and precompute, with LoRA params for sft and codi."""
    from tests.integration.test_stages_tiny import cli
    from tests.tiny import write_params

    ws = tmp_path_factory.mktemp("lora-ws")
    lora = {"r": 8, "alpha": 16.0, "dropout": 0.0}
    write_params(ws / "params.yaml", tiny_params(
        sft={"lora": lora, "max_steps": 12, "lr": 0.01, "save_steps": 6, "eval_steps": 6, "logging_steps": 2},
        codi={"lora": lora, "max_steps": 4, "lr": 0.01, "save_steps": 2, "eval_steps": 2}))
    for stage in ("extract", "precompute"):
        assert cli(ws, stage) == 0, stage
    return ws


def run_stage(ws: Path, stage: str) -> int:
    from tests.integration.test_stages_tiny import cli

    return cli(ws, stage)


def losses(history: list[dict], key: str) -> list[float]:
    return [h[key] for h in history if key in h]


def test_a_tiny_lora_sft_and_codi_lower_their_losses_and_resume(ws, capsys):
    """sft then codi with LoRA through `python -m codi`: losses fall, the folders load as the next stage and
    evaluate read them (merged) and unmerged, and a run killed after a checkpoint resumes to the same bytes."""
    import json

    from codi.modeling.io import load_codi_model

    assert run_stage(ws, "sft") == 0
    out = capsys.readouterr().out
    assert "sft: LoRA r=8:" in out
    live = json.loads((ws / "dvclive/sft/metrics.json").read_text())
    state = json.loads((ws / "checkpoints/sft/checkpoint-12/trainer_state.json").read_text())
    train, val = losses(state["log_history"], "loss"), losses(state["log_history"], "eval_loss")
    assert train[-1] < train[0] and val[-1] < val[0], (train, val)
    assert live["step"] == 12
    assert (ws / "models/sft/adapter/adapter_model.safetensors").is_file()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        m = load_causal_lm(ws / "models/sft", torch.float32).eval()(input_ids=ids).logits
        u = load_unmerged(ws / "models/sft", base=ws / "models/base")(input_ids=ids).logits
    torch.testing.assert_close(m, u, atol=1e-5, rtol=1e-5)

    assert run_stage(ws, "codi") == 0
    state = json.loads((ws / "checkpoints/codi/checkpoint-4/trainer_state.json").read_text())
    student = losses(state["log_history"], "student_loss")
    assert student[-1] < student[0], student
    loaded = load_codi_model(ws / "models/codi")
    with torch.no_grad():
        m = loaded.model(input_ids=ids).logits
        u = load_unmerged(ws / "models/codi", base=ws / "models/sft")(input_ids=ids).logits
    torch.testing.assert_close(m, u, atol=1e-5, rtol=1e-5)

    # Killed after the step-6 (sft) and step-2 (codi) checkpoints: the rerun resumes and ends where the
    # uninterrupted run ended, byte for byte.
    for stage, last, files in (("sft", 12, ("model.safetensors", "adapter/adapter_model.safetensors")),
                               ("codi", 4, ("model.safetensors", "thought_projector.safetensors",
                                            "adapter/adapter_model.safetensors"))):
        done = {f: (ws / "models" / stage / f).read_bytes() for f in files}
        shutil.rmtree(ws / f"checkpoints/{stage}/checkpoint-{last}")
        shutil.rmtree(ws / "models" / stage)
        capsys.readouterr()
        assert run_stage(ws, stage) == 0
        assert f"resuming from {os.path.join('checkpoints', stage)}" in capsys.readouterr().out
        assert {f: (ws / "models" / stage / f).read_bytes() for f in files} == done, stage
