"""benchmarks/roofline.py: its FLOP count against the model's own parameters (the timing itself is a benchmark)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.tiny import ROOT

spec = importlib.util.spec_from_file_location("roofline", ROOT / "benchmarks" / "roofline.py")
roofline = importlib.util.module_from_spec(spec)
sys.modules["roofline"] = roofline  # dataclasses look their module up there
spec.loader.exec_module(roofline)


def _model(kv_heads: int) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=333, hidden_size=96, intermediate_size=384, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=kv_heads, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def test_linear_flops_are_two_per_weight_of_every_linear_and_the_tied_head(tmp_path):
    for kv_heads in (6, 2):  # multi-head and grouped-query attention
        model = _model(kv_heads)
        model.config.to_json_file(tmp_path / "config.json")
        dims = roofline.Dims.from_config(tmp_path / "config.json")
        weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert dims.forward_flops(0) == 2 * weights  # the head is a Linear (tied to the embedding)
        # attention: scores and weighted sum, 2 FLOPs a multiply-add, every layer, every context token
        assert dims.forward_flops(10) - dims.forward_flops(0) == 3 * 4 * 10 * 96


def test_missing_metrics_name_the_file_and_the_fix(tmp_path):
    try:
        roofline._json(tmp_path / "codi.json")
    except SystemExit as exit_:
        assert str(tmp_path / "codi.json") in str(exit_) and "dvc repro" in str(exit_)
    else:
        raise AssertionError("no error")
    (tmp_path / "ok.json").write_text(json.dumps({"a": 1}))
    assert roofline._json(tmp_path / "ok.json") == {"a": 1}


def test_the_shared_prefix_is_the_prompt_and_the_trace_up_to_the_first_line_sep(tmp_path):
    import pyarrow as pa

    table = pa.table({"prompt_ids": [[1, 2, 3], [4, 5]], "trace_ids": [[6, 7, 8, 9, 10], [11, 12, 13]],
                      "span_starts": [[2, 4], []]})
    with pa.OSFile(str(tmp_path / "train.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    # example 0: 3 prompt tokens + trace[:2 + 1]; example 1 has no LINE frame: all 2 + 3 of its tokens
    assert roofline.shared_prefix(tmp_path) == ((3 + 3) + (2 + 3)) / 2
    with pytest.raises(SystemExit, match="dvc repro"):
        roofline.shared_prefix(tmp_path / "absent")
