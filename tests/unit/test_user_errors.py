"""Every error a user can cause prints one `error:` line naming the file, line or key, exits non-zero, and shows
no traceback: bad params, a bad dataset line, a missing file, a folder that is not a causal LM. (A cache made by
another tokenizer: tests/integration/test_stages_tiny.py, which has a cache to make it with.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from codi.__main__ import main
from codi.infra.config import ConfigError
from tests.tiny import ROOT, tiny_params, write_params


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one `error:` line on stderr (and nothing that looks like a traceback)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def params(tmp_path: Path) -> Path:
    return write_params(tmp_path / "params.yaml", tiny_params())


def test_bad_params(tmp_path, capsys):
    bad = write_params(tmp_path / "bad.yaml", tiny_params(sft={"lr": -0.001}))
    assert main(["--params", str(bad), "params"]) == 2
    assert error_line(capsys) == f"error: {bad}: sft.lr = -0.001: expected a float > 0"
    assert main(["--params", str(tmp_path / "none.yaml"), "params"]) == 2
    assert error_line(capsys).startswith(f"error: {tmp_path / 'none.yaml'}: cannot read params file")


def test_a_bad_dataset_line(params, tmp_path, capsys):
    bad = ROOT / "tests/fixtures/sources/cruxeval_bad.jsonl"
    assert main(["--params", str(params), "trace", "--source", "cruxeval", "--path", str(bad),
                 "--out", str(tmp_path / "x.parquet")]) == 2
    assert error_line(capsys) == f"error: {bad}:2: missing field 'output'"


def test_a_missing_file(params, tmp_path, capsys):
    assert main(["--params", str(params), "evaluate", "--cache", str(tmp_path / "nocache")]) == 2
    first_split = yaml.safe_load(params.read_text())["evaluate"]["splits"][0]  # evaluate reads its splits in order
    assert error_line(capsys) == (f"error: {tmp_path / 'nocache' / f'{first_split}.arrow'}: no such cache split "
                                  "(run the precompute stage)")
    assert main(["--params", str(params), "trace", "--source", "mbpp", "--path", str(tmp_path / "no.jsonl"),
                 "--out", str(tmp_path / "x.parquet")]) == 2
    assert error_line(capsys).startswith(f"error: {tmp_path / 'no.jsonl'}: cannot read dataset")


def test_a_folder_that_is_not_a_causal_lm(tmp_path):
    """The stages load every model through codi.infra.hf.load_causal_lm (the CLI path: test_stages_tiny.py)."""
    from transformers import ViTConfig

    from codi.infra.hf import load_causal_lm
    from codi.modeling import load_codi_model

    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: not a causal LM that transformers can load \(.*ViTConfig"):
        load_causal_lm(tmp_path, "auto")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'codi_config.json'}: cannot read the codi config"):
        load_codi_model(tmp_path)
