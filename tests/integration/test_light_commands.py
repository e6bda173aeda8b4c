"""`python -m codi params` and `python -m codi extract` import neither torch nor transformers: reading params and
tracing programs stay light (the CODI options are stdlib-only dataclasses in codi/schemas/, and codi.modeling
is lazy), so a tracing worker or a params check never pays for a deep-learning stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.tiny import tiny_params, write_params

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")

PROBE = """
import json, os, sys
from codi.__main__ import main
os.chdir(sys.argv[1])
rc = main(["--params", "params.yaml", *sys.argv[2:]])
print(json.dumps({"rc": rc, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def _run(ws: Path, *command: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(ws), *command], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_params_and_extract_import_no_torch_nor_transformers(tmp_path):
    write_params(tmp_path / "params.yaml", tiny_params(extract={"synthetic": {"n_programs": 4}}))
    assert _run(tmp_path, "params") == {"rc": 0, "heavy": []}
    result = _run(tmp_path, "extract", "--out", "data/traces", "--metrics", "metrics/extract.json")
    assert result == {"rc": 0, "heavy": []}
    assert (tmp_path / "data/traces").exists() and json.loads((tmp_path / "metrics/extract.json").read_text())
