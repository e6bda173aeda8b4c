"""load_samples: source dispatch, paths (files, gzip, hf:), and clear errors."""

import dataclasses
import gzip
import sys
import types
from pathlib import Path

import pytest

import codi.schemas.source_names
import codi.sources
from codi.infra.config import ConfigError, params_from_dict
from codi.schemas.source_names import source_names
from codi.sources.base import DatasetError
from codi.sources.registry import load_samples, parse_hub_path
from codi.stages.extract import check_tracked_paths
from tests.tiny import shipped, tiny_params

FIX = Path(__file__).parents[1] / "fixtures" / "sources"
CFG = shipped("extract")
CRUX = {"code": "def f(x):\n    return x\n", "input": "1", "output": "1", "id": "a"}


def test_unknown_source_and_synthetic_path():
    with pytest.raises(DatasetError, match="unknown source 'apps': expected one of cruxeval, humaneval, mbpp, pyx, "
                                           "synthetic"):
        load_samples("apps", CFG)
    with pytest.raises(DatasetError, match="source synthetic is generated"):
        load_samples("synthetic", CFG, path="x.jsonl")


def test_synthetic_comes_from_its_config():
    cfg = dataclasses.replace(CFG, synthetic=shipped("extract.synthetic", n_programs=3, calls_per_program=2, difficulty=1, seed=4))
    load = load_samples("synthetic", cfg)
    assert [s.sample_id for s in load.samples] == [f"synthetic/{i}/{k}" for i in range(3) for k in range(2)]
    assert not load.skipped and not load.unchecked


def test_a_file_source_needs_a_path_and_reads_the_configured_one():
    with pytest.raises(DatasetError, match=r"source mbpp: no path: set extract.paths.mbpp in params.yaml or pass --path"):
        load_samples("mbpp", CFG)
    cfg = dataclasses.replace(CFG, paths=shipped("extract.paths", cruxeval=str(FIX / "cruxeval.jsonl")))
    assert len(load_samples("cruxeval", cfg).samples) == 5
    with pytest.raises(DatasetError, match="cruxeval_bad.jsonl:2"):  # path overrides extract.paths
        load_samples("cruxeval", cfg, path=str(FIX / "cruxeval_bad.jsonl"))


def test_unreadable_files(tmp_path):
    with pytest.raises(DatasetError, match=r"nope.jsonl: cannot read dataset: No such file or directory"):
        load_samples("cruxeval", CFG, str(tmp_path / "nope.jsonl"))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"code": "\xe9"}\n')
    with pytest.raises(DatasetError, match="latin.jsonl: cannot read dataset: 'utf-8' codec"):
        load_samples("cruxeval", CFG, str(latin))


def test_gzip_and_blank_lines(tmp_path):
    import json

    path = tmp_path / "crux.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n" + json.dumps(CRUX) + "\n\n   \n" + json.dumps({**CRUX, "id": "b"}) + "\n")
    load = load_samples("cruxeval", CFG, str(path))
    assert [s.sample_id for s in load.samples] == ["cruxeval/a/0", "cruxeval/b/0"]
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(DatasetError, match="bad.jsonl.gz: cannot read dataset"):
        load_samples("cruxeval", CFG, str(bad))


@pytest.mark.parametrize("spec, parsed", [
    ("hf:cruxeval-org/cruxeval", ("cruxeval-org/cruxeval", None)),
    ("hf:google-research-datasets/mbpp:test", ("google-research-datasets/mbpp", "test")),
])
def test_parse_hub_path(spec, parsed):
    assert parse_hub_path(spec) == parsed


@pytest.mark.parametrize("spec", ["hf:", "hf::test", "hf:a/b:", "hf:a/b:test:extra"])
def test_parse_hub_path_rejects(spec):
    with pytest.raises(DatasetError, match=r"expected hf:<dataset id>\[:<split>\]"):
        parse_hub_path(spec)


def _fake_datasets(monkeypatch, load_dataset):
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_hub_path_goes_through_load_dataset(monkeypatch):
    calls = []

    def load_dataset(dataset_id, split=None):
        calls.append((dataset_id, split))
        rows = [CRUX, {**CRUX, "id": "b", "input": 7}]
        return rows if split else {"test": rows[:1], "extra": [{**CRUX, "id": "c"}]}

    _fake_datasets(monkeypatch, load_dataset)
    with pytest.raises(DatasetError, match=r"^hf:org/crux:test:1: field 'input': expected a string, got int 7$"):
        load_samples("cruxeval", CFG, "hf:org/crux:test")
    load = load_samples("cruxeval", CFG, "hf:org/crux")
    assert [s.sample_id for s in load.samples] == ["cruxeval/a/0", "cruxeval/c/0"]
    assert calls == [("org/crux", "test"), ("org/crux", None)]


def test_an_unreachable_hub_is_a_clear_error(monkeypatch):
    def offline(dataset_id, split=None):
        raise ConnectionError("Couldn't reach 'org/crux' on the Hub (LocalEntryNotFoundError)\nlong detail")

    _fake_datasets(monkeypatch, offline)
    with pytest.raises(DatasetError) as err:
        load_samples("mbpp", CFG, "hf:org/crux")
    assert str(err.value) == (
        "hf:org/crux: cannot load 'org/crux' from the Hugging Face hub (ConnectionError: Couldn't reach "
        "'org/crux' on the Hub (LocalEntryNotFoundError)). Offline? Download it once and set a local jsonl "
        "path instead.")
    assert err.value.__cause__ is None and err.value.__suppress_context__


TOY_SOURCE = '''"""A toy file source: one call of `f` per record."""

from codi.sources.asserts import Harvest
from codi.sources.base import Sample, normalize_program

NAME = "toy"
FIELDS = {"id": ((str,), True), "code": ((str,), True), "call": ((str,), True)}


def harvest(rec):
    return Harvest(samples=[Sample(sample_id=f"toy/{rec['id']}/0", source=NAME, problem_id=f"toy/{rec['id']}",
                                   program=normalize_program(rec["code"]), call=rec["call"])])
'''


def test_a_new_source_is_one_module_plus_its_params_entries(tmp_path, monkeypatch):
    """Adding a source (docs/design/sources.md, "Adding a source"): a module in codi/sources/ (here a second
    folder of the package) and its params.yaml entries; nothing else lists it, and the data/raw/ check covers it."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "toy.py").write_text(TOY_SOURCE)
    monkeypatch.setattr(codi.sources, "__path__", [*codi.sources.__path__, str(plugins)])
    monkeypatch.setattr(codi.schemas.source_names, "SOURCE_DIRS", [*codi.schemas.source_names.SOURCE_DIRS, plugins])
    monkeypatch.delitem(sys.modules, "codi.sources.toy", raising=False)
    assert "toy" in source_names()

    data = tmp_path / "toy.jsonl"
    data.write_text('{"id": "a", "code": "def f(x):\\n    return x + 1\\n", "call": "f(1)"}\n')
    params = params_from_dict(tiny_params(extract={"sources": ["synthetic", "toy"], "paths": {"toy": str(data)}}))
    assert [s.sample_id for s in load_samples("toy", params.extract).samples] == ["toy/a/0"]
    with pytest.raises(ConfigError, match=r"extract.paths.toy = '.*toy.jsonl': outside data/raw/"):
        check_tracked_paths(params.extract)
    with pytest.raises(ConfigError, match=r"unknown key extract.paths.toy2"):
        params_from_dict(tiny_params(extract={"paths": {"toy2": "x"}}))
    monkeypatch.delitem(sys.modules, "codi.sources.toy", raising=False)
