"""The README's "On your GPU" recipe, run on the CPU: your model folder under base_models/, your MBPP file in
data/raw/, one `dvc exp run -S ...` with LoRA on sft and codi, results where the README says they land; then
new weights in the folder make precompute (and so everything after it) stale.

Slow (a few minutes on 2 cores): `pytest -m slow tests/integration/test_gpu_recipe.py`. The model is a small
random Qwen2-family folder (tests/integration/test_real_base.py), the MBPP file the repository's fixture.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.test_real_base import make_base_folder
from tests.integration.test_real_pipeline_dvc import GIT, copy_project, dvc, ran, sh
from tests.tiny import ROOT, tiny_params, write_params

pytestmark = pytest.mark.slow

# The README's line, with the folder and file of this test (the README names base_models/<your model>).
RECIPE = ["-S", "model.base=base_models/mini", "-S", "extract.sources=[mbpp]",
          "-S", "extract.paths.mbpp=data/raw/mbpp.jsonl", "-S", "sft.lora.r=8", "-S", "codi.lora.r=8"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("recipe")
    copy_project(repo)
    write_params(repo / "params.yaml", tiny_params())  # small steps: the recipe's -S lines are the user's
    make_base_folder(repo / "base_models/mini", "qwen2")
    shutil.copy(ROOT / "tests/fixtures/sources/mbpp.jsonl", repo / "data/raw/mbpp.jsonl")
    sh(repo, "git", "init", "-q")
    sh(repo, "git", "add", "-A")
    sh(repo, *GIT, "commit", "-qm", "the user's project")
    return repo


def test_the_recipe_trains_with_lora_on_the_users_model_and_data_and_lands_its_results(repo):
    out = dvc(repo, "exp", "run", "-n", "my-model", *RECIPE)
    assert sorted(ran(out)) == sorted(["extract", "precompute", "sft", "sft_direct", "codi", "evaluate"])
    assert "sft: LoRA r=8" in out and "codi: LoRA r=8" in out
    assert "optimizer adamw_torch (sft.optimizer = auto, auto: no GPU)" in out
    extract = json.loads((repo / "metrics/extract.json").read_text())
    assert set(extract) == {"mbpp", "total"} and extract["mbpp"]["status"]["ok"] > 0
    evaluation = json.loads((repo / "metrics/eval.json").read_text())
    assert {"explicit", "latent", "direct"} <= set(evaluation)
    for folder in ("models/sft", "models/codi"):  # merged for evaluate, the adapter beside it
        assert (repo / folder / "config.json").is_file() and (repo / folder / "adapter/adapter_config.json").is_file()
    assert (repo / "metrics/eval.md").is_file()
    show = json.loads(dvc(repo, "exp", "show", "--json"))
    assert "my-model" in json.dumps(show)


def test_new_weights_in_the_model_folder_make_precompute_and_all_after_it_stale(repo):
    assert "precompute" not in dvc(repo, "status")
    import torch
    from safetensors.torch import load_file, save_file

    weights = repo / "base_models/mini/model.safetensors"
    state = load_file(str(weights))
    name = next(k for k in state if k.endswith("q_proj.weight"))
    state[name] = state[name] + torch.full_like(state[name], 1e-3)
    save_file(state, str(weights), metadata={"format": "pt"})
    status = dvc(repo, "status")
    assert "precompute:" in status and "modified:" in status and "base_models" in status, status
