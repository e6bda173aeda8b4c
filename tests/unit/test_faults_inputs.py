"""Corrupted inputs and a full disk: each ends in one `error:` line that names the file (and the stage that
rebuilds it), exit 2, and a write that fills the disk leaves the previous output as it was.

The full disk is the kernel's own: the writer's temporary file is a link to /dev/full, where every write fails
with ENOSPC (a library that writes by itself, safetensors, is patched to raise it). The stage-level cases, on a
cache that precompute built: tests/integration/test_faults_inputs_cli.py.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from codi.__main__ import main
from codi.data.cache import CACHE_FORMAT_VERSION, SPLITS, CacheDataset, verify_split, write_split
from codi.data.traces import TracesFileError, read_traces, write_traces
from codi.infra.config import ConfigError
from codi.infra.files import DiskFullError, atomic_dir, temporary_sibling, write_json
from codi.infra.hf import check_model_folder
from tests.tiny import tiny_params, write_params

REBUILD_CACHE = "dvc repro precompute"
DEV_FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full on this system")


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one `error:` line on stderr (and nothing that looks like a traceback)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def row(k: int) -> dict:
    return {"sample_id": f"s/{k}/0", "source": "s", "problem_id": f"s/{k}", "prompt_ids": [1, 2, k],
            "trace_ids": list(range(k + 4)), "spans": [(0, 2)], "answer_ids": [7, 8], "answer": repr(k),
            "program": "def f(): pass\n", "call": "f()", "trace_text": "", "n_frames": 3, "difficulty": 0}


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A cache folder as precompute leaves it: every split, and a manifest with their sha256."""
    cache = tmp_path / "cache"
    shas = {split: write_split([row(k) for k in range(40)], cache / f"{split}.arrow") for split in SPLITS}
    write_json(cache / "manifest.json", {"format_version": CACHE_FORMAT_VERSION,
                                         "splits": {s: {"sha256": h} for s, h in shas.items()}})
    return cache


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# --- the cache --------------------------------------------------------------------------------------------------

def test_a_whole_cache_loads(cache):
    assert len(CacheDataset(cache / "val.arrow")) == 40


@pytest.mark.parametrize("damage, what", [
    (truncate, "truncated"),
    (lambda p: p.write_bytes(b"PAR1" + p.read_bytes()[4:]), "not an Arrow file"),
    (lambda p: p.write_bytes(b""), "empty"),
    # the same length, one byte flipped in the middle: only the manifest's hash sees it
    (lambda p: p.write_bytes((d := bytearray(p.read_bytes()), d.__setitem__(len(d) // 2, d[len(d) // 2] ^ 1), d)[2]),
     "hash mismatch with the manifest"),
])
def test_a_damaged_split_is_an_error_naming_it(cache, damage, what):
    damage(cache / "val.arrow")
    with pytest.raises(ConfigError) as e:
        CacheDataset(cache / "val.arrow")
    assert str(e.value).startswith(f"{cache / 'val.arrow'}: {what}") and REBUILD_CACHE in str(e.value)


@pytest.mark.parametrize("damage, what", [
    (lambda m: m.unlink(), "manifest.json: missing"),
    (lambda m: m.write_text(m.read_text()[:20]), "manifest.json: the cache manifest is not valid JSON"),
    (lambda m: m.write_text(json.dumps({"format_version": CACHE_FORMAT_VERSION - 1})),
     f"manifest.json: cache format_version {CACHE_FORMAT_VERSION - 1}"),
    (lambda m: m.write_text(json.dumps({"format_version": CACHE_FORMAT_VERSION, "splits": {}})),
     "manifest.json: records no sha256 for val.arrow"),
])
def test_a_missing_or_damaged_manifest_is_an_error_naming_it(cache, damage, what):
    damage(cache / "manifest.json")
    with pytest.raises(ConfigError) as e:
        CacheDataset(cache / "val.arrow")
    assert str(e.value).startswith(f"{cache}/{what}") and REBUILD_CACHE in str(e.value)


def test_each_split_is_hashed_once_per_process(cache, monkeypatch):
    import codi.data.cache as cache_module

    hashed = []
    real = cache_module.file_sha256
    monkeypatch.setattr(cache_module, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    for _ in range(3):
        CacheDataset(cache / "train.arrow")
    assert hashed == ["train.arrow"]
    (cache / "train.arrow").write_bytes((cache / "train.arrow").read_bytes()[:-1])  # a new version: checked again
    with pytest.raises(ConfigError, match="truncated"):
        verify_split(cache / "train.arrow")


def test_evaluate_on_a_truncated_split_prints_one_error_line(cache, tmp_path, capsys):
    params = write_params(tmp_path / "params.yaml", tiny_params())
    first = tiny_params()["evaluate"]["splits"][0]  # evaluate reads its splits in order
    truncate(cache / f"{first}.arrow")
    assert main(["--params", str(params), "evaluate", "--cache", str(cache)]) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: {cache / f'{first}.arrow'}: truncated") and REBUILD_CACHE in line


# --- the traces -------------------------------------------------------------------------------------------------

def traces_file(path: Path) -> Path:
    from codi.data.traces import TRACE_SCHEMA

    write_traces([{name: None for name in TRACE_SCHEMA.names} | {"sample_id": f"h/{k}", "status": "ok"}
                  for k in range(200)], path)
    return path


@pytest.mark.parametrize("damage, what", [
    (truncate, "truncated"),
    (lambda p: p.write_bytes(b"ARROW1" + p.read_bytes()[6:]), "not a Parquet file"),
    (lambda p: p.write_bytes((d := p.read_bytes())[:-28] + bytes(b ^ 0xFF for b in d[-28:-20]) + d[-20:]),
     "corrupted"),  # whole, but its footer's metadata garbled
])
def test_a_damaged_traces_file_is_an_error_naming_it(tmp_path, damage, what):
    f = traces_file(tmp_path / "humaneval.parquet")
    assert len(read_traces(f, ["sample_id"])) == 200
    damage(f)
    with pytest.raises(TracesFileError) as e:
        read_traces(f, ["sample_id"])
    assert str(e.value).startswith(f"{f}: {what}") and "dvc repro extract" in str(e.value)


def test_precompute_on_a_truncated_traces_file_prints_one_error_line(tmp_path, capsys):
    traces = tmp_path / "traces"
    truncate(traces_file(traces / "humaneval.parquet"))
    params = write_params(tmp_path / "params.yaml", tiny_params())
    assert main(["--params", str(params), "precompute", "--traces", str(traces), "--cache", str(tmp_path / "cache"),
                 "--base-out", str(tmp_path / "base"), "--metrics", str(tmp_path / "m.json")]) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: {traces / 'humaneval.parquet'}: truncated") and "dvc repro extract" in line
    assert not (tmp_path / "cache").exists() and not (tmp_path / "base").exists()


# --- model folders ----------------------------------------------------------------------------------------------

def tiny_lm():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model") / "sft"
    tiny_lm().save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return folder


def damaged_copy(saved: Path, tmp_path: Path, name: str, damage) -> Path:
    import shutil

    folder = tmp_path / saved.name
    shutil.copytree(saved, folder)
    damage(folder / name)
    return folder


@pytest.mark.parametrize("name, damage, what", [
    ("model.safetensors", truncate, "truncated"),
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:5]), "truncated"),
    ("model.safetensors", lambda p: p.write_bytes(b"\xff" * 64), "not a safetensors file"),
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes() + b"\0"), "corrupted"),
    ("config.json", lambda p: p.write_text(p.read_text()[:30]), "not valid JSON"),
    ("config.json", lambda p: p.write_text("[]"), "not a model config"),
    ("tokenizer_config.json", lambda p: p.write_text("{"), "not valid JSON"),
])
def test_a_damaged_model_folder_is_an_error_naming_the_file(saved_model, tmp_path, name, damage, what):
    check_model_folder(saved_model, made_by="sft")
    folder = damaged_copy(saved_model, tmp_path, name, damage)
    with pytest.raises(ConfigError) as e:
        check_model_folder(folder, made_by="sft")
    assert str(e.value).startswith(f"{folder / name}: {what}") and "dvc repro sft" in str(e.value)


def test_a_model_folder_without_config_or_weights(saved_model, tmp_path):
    folder = damaged_copy(saved_model, tmp_path, "config.json", Path.unlink)
    with pytest.raises(ConfigError, match=f"^{folder}: no config.json.*dvc repro precompute"):
        check_model_folder(folder, made_by="precompute")
    (folder / "config.json").write_text((saved_model / "config.json").read_text())
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=f"^{folder}: no weights file"):
        check_model_folder(folder, made_by="precompute")


def test_sft_from_a_truncated_base_prints_one_error_line(saved_model, tmp_path, capsys):
    base = damaged_copy(saved_model, tmp_path, "model.safetensors", truncate)
    params = write_params(tmp_path / "params.yaml", tiny_params())
    assert main(["--params", str(params), "sft", "--base", str(base), "--cache", str(tmp_path / "cache"),
                 "--out", str(tmp_path / "out"), "--checkpoints", str(tmp_path / "ck")]) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: {base / 'model.safetensors'}: truncated") and "dvc repro precompute" in line


def test_evaluate_with_a_truncated_codi_model(saved_model, tmp_path):
    from codi.evaluation.core import mode_folder

    codi = damaged_copy(saved_model, tmp_path, "model.safetensors", truncate)
    with pytest.raises(ConfigError, match=f"^{codi / 'model.safetensors'}: truncated.*dvc repro codi"):
        mode_folder("latent", {"sft": saved_model, "codi": codi, "sft_direct": saved_model})


# --- a full disk ------------------------------------------------------------------------------------------------

def fill_disk_at(path: Path) -> None:
    """Every write to `path`'s temporary sibling (atomic_path's) now fails in the kernel with ENOSPC."""
    temporary_sibling(path).symlink_to(DEV_FULL)


def assert_no_temporary_left(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if ".tmp-" in p.name]


@needs_dev_full
@pytest.mark.parametrize("writer", ["json", "cache split", "traces"])
def test_a_full_disk_names_the_path_and_keeps_the_previous_file(tmp_path, writer):
    target = tmp_path / {"json": "metrics.json", "cache split": "train.arrow", "traces": "mbpp.parquet"}[writer]
    write = {"json": lambda: write_json(target, {"loss": [0.5] * 5000}),
             "cache split": lambda: write_split([row(k) for k in range(400)], target),
             "traces": lambda: traces_file(target)}[writer]
    target.write_bytes(b"the previous complete output")
    fill_disk_at(target)
    with pytest.raises(DiskFullError) as e:
        write()
    assert str(e.value).startswith(f"{target}: no space left on the device")
    assert target.read_bytes() == b"the previous complete output"
    assert_no_temporary_left(tmp_path)


def test_a_full_disk_while_saving_a_model_folder_keeps_the_previous_folder(saved_model, tmp_path, monkeypatch):
    import transformers.modeling_utils

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = damaged_copy(saved_model, tmp_path, "config.json", lambda p: None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", no_space)
    with pytest.raises(DiskFullError, match=f"^{out}: no space left on the device while writing this folder"):
        with atomic_dir(out) as tmp:
            tiny_lm().save_pretrained(tmp)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert_no_temporary_left(tmp_path)


def test_a_full_disk_inside_a_folder_names_the_folder_not_its_temporary_file(tmp_path):
    out = tmp_path / "codi"
    with pytest.raises(DiskFullError, match=f"^{out}: no space left"):
        with atomic_dir(out) as tmp:
            if DEV_FULL.exists():
                fill_disk_at(tmp / "codi_config.json")
                write_json(tmp / "codi_config.json", {"format_version": 4})
            else:
                raise OSError(errno.ENOSPC, "No space left on device")
    assert not out.exists()
    assert_no_temporary_left(tmp_path)

