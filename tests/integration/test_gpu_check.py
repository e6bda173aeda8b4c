"""The GPU check's CPU dry run (issue 23, item 3): `bash benchmarks/gpu_check.sh --device cpu --tiny` runs every
section at tiny shapes, the GPU profile through the stages' entry points included, with the packages the GPU
machine lacks made unimportable, and writes one results file whose JSON has every section with a status and
its numbers. Slow: about 4 minutes on 2 cores. The profile itself (fast): its params file is valid, its
`dvc exp run` command names every key, and a bad profile is refused naming the file and key.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from codi.infra.config import ConfigError, load_params, read_yaml
from experiments.profile import dvc_command, load_profile, make_params

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["wheels", "header", "bnb", "a", "c", "d", "profile"]
STAGES = ["extract", "precompute", "sft", "sft_direct", "codi", "evaluate"]


def test_the_gpu_profile_makes_a_valid_params_file_and_one_dvc_command(tmp_path):
    prof = load_profile("gpu-h200")
    assert prof.rung == "level1"
    base = read_yaml(ROOT / "params.yaml")
    for tiny in (False, True):
        out = tmp_path / f"p{int(tiny)}.yaml"
        out.write_text(yaml.safe_dump(make_params(prof, base, tiny=tiny)))
        params = load_params(out)
        assert params.extract.synthetic.templates == []  # the rung's own key
        assert params.sft.max_steps == (4 if tiny else prof.overrides["sft.max_steps"])
    words = dvc_command(prof)
    assert words[:5] == ["dvc", "exp", "run", "-n", "gpu-h200"]
    keys = [w.split("=", 1)[0] for w in words[5:] if w != "-S"]
    assert keys == list(prof.all_overrides()) and len(words[5:]) == 2 * len(keys)
    assert shlex.split(shlex.join(words)) == words


@pytest.mark.parametrize("body, message", [
    ("name: bad\ndoc: d\nrung: level1\nset: {sft.nope: 1}\ntiny: {}\n", "unknown params key sft.nope"),
    ("name: bad\ndoc: d\nrung: level9\nset: {}\ntiny: {}\n", "rung 'level9'"),
    ("name: bad\ndoc: d\nrung: level1\nset: {sft.lr: -1.0}\ntiny: {}\n", "sft.lr"),
    ("name: bad\ndoc: d\nrung: level1\nset: {extract.synthetic.difficulty: 2}\ntiny: {}\n", "the rung's (level1) own key"),
    ("name: bad\ndoc: d\nrung: level1\nset: {}\n", "expected exactly the keys"),
])
def test_a_bad_profile_is_refused_naming_the_file_and_key(tmp_path, body, message):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError, match="bad.yaml") as e:
        load_profile(path)
    assert message in str(e.value)


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_section_with_its_numbers(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--tiny", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["complete"] and res["tiny"] and res["failed"] == [] and res["first_failure"] is None
    sections = {s["name"]: s for s in res["sections"]}
    assert list(sections) == SECTIONS
    for s in res["sections"]:
        assert s["status"] in ("PASS", "SKIP") and s["seconds"] >= 0, s
    assert sections["bnb"]["status"] == "SKIP"  # paged 8-bit AdamW needs CUDA
    assert sections["header"]["numbers"]["torch"] and sections["header"]["numbers"]["python"]

    a = sections["a"]["numbers"]
    assert a["losses_equal"] and a["rows"] and all(r["o_eps"] > 0 and r["b_eps"] > 0 for r in a["rows"])
    for name, n_configs in (("c", 1), ("d", 2)):
        rows = sections[name]["numbers"]["rows"]
        assert len(rows) == n_configs and all(r["finite"] and r["s_per_step"] > 0 for r in rows)
    assert 0 < sections["c"]["numbers"]["rows"][0]["weights_changed_frac"] <= 1

    prof = sections["profile"]["numbers"]
    assert prof["profile"] == "gpu-h200" and prof["tiny"] and "failed" not in prof
    assert list(prof["stages"]) == STAGES
    assert all(s["exit_status"] == 0 and s["seconds"] > 0 for s in prof["stages"].values())
    assert prof["params"]["model"]["tiny"]["hidden_size"] == 32 and prof["params"]["extract"]["sources"] == ["synthetic"]
    assert prof["pipeline_s"] > 0 and prof["stages"]["sft"]["metrics"]["steps"] == 4
    for split in ("val", "test"):
        for mode in ("explicit", "latent", "direct"):
            acc = prof["eval"][split][mode]["output_accuracy"]
            assert 0 <= acc <= 1 and prof["eval"][split][mode]["n"] > 0
        assert math.isfinite(prof["eval"][split]["compression"]["value"])
    assert set(prof["targets_met"]) == {"explicit", "retention", "compression"}

    md = (out / "gpu_check.md").read_text()
    assert "| section | what | status |" in md and "## profile" in md and "first failure: none" in md
    log = (out / "gpu_check.log").read_text()
    assert "note: dvclive is off" in log and "note: wandb is off" in log  # absent in the dry run, as on the GPU


def test_without_dask_the_dask_executor_names_the_fix(monkeypatch):
    """The GPU machine has no Dask: extract's local executor needs none, the dask one says what to do."""
    import dataclasses

    from codi.tracing import cluster

    monkeypatch.setattr(cluster, "DASK_MISSING", ImportError("No module named 'distributed'"))
    cfg = dataclasses.replace(load_params(ROOT / "params.yaml").extract, executor="dask")
    with pytest.raises(ConfigError, match="extract.executor = dask.*extract.executor: local"):
        with cluster.open_tracer(cfg):
            pass
