"""The GPU check's results file: gpu_check.json (every section: status, seconds, limit, note, its numbers) and
gpu_check.md (the same as tables), from the sections gpu_check.sh has recorded so far. The script calls it
after every section, so a run cut short still leaves a valid results file.

    python benchmarks/gpu_report.py --sections S.tsv --numbers DIR --meta META.json --out DIR

S.tsv: one line per section, `name<TAB>status<TAB>seconds<TAB>limit<TAB>note`; DIR/<name>.json: that section's
numbers (the benchmarks' own --json files), when it wrote any.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

WHAT = {
    "wheels": "offline install of the carried wheels (.whl/, make gpu-wheels)",
    "header": "versions: python, torch, CUDA, GPU, driver, transformers, accelerate, peft",
    "bnb": "bitsandbytes importable: paged 8-bit AdamW",
    "a": "batched CodiModel vs the per-example oracle (bench_codi_model.py)",
    "c": "100 codi steps at the Qwen2.5-Coder-0.5B shape (bench_memory.py)",
    "d": "peak memory at the 0.5B shape, batch 8 x ~2k tokens (bench_memory.py)",
    "profile": "the GPU research profile through the stages' entry points (run_profile.py)",
}


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def summary_lines(name: str, n: dict) -> list[str]:
    """The few numbers of a section worth a line in the markdown."""
    out = []
    if name == "a" and n.get("rows"):
        out.append(f"batch {n['batch']}, {n['dtype']}, {n['device']}; loss tolerance {n['loss_tolerance']:.2e}")
        out.append("| LINE frames | latent steps | oracle ex/s | batched ex/s | speedup | loss rel diff |")
        out.append("|---:|---:|---:|---:|---:|---:|")
        for r in n["rows"]:
            if "o_eps" in r:
                out.append(f"| {r['frames']} | {r['ls']} | {r['o_eps']:.2f} | {r['b_eps']:.2f} | "
                           f"{r['b_eps'] / r['o_eps']:.1f}x | {r['diff']:.1e} |")
        if "speedup_min" in n:
            out.append(f"min speedup {n['speedup_min']:.1f}x"
                       + (f" (target >= {n['speedup_target']:.0f}x: {'met' if n['speedup_met'] else 'NOT met'})"
                          if "speedup_target" in n else "")
                       + f"; losses equal within tolerance: {'yes' if n.get('losses_equal') else 'NO'}")
    elif name in ("c", "d") and n.get("rows"):
        out.append(n.get("header", ""))
        out.append("| layers | config | steps | s/step | loss first -> last | CUDA max allocated MB | weights changed |")
        out.append("|---:|---|---:|---:|---|---:|---:|")
        for r in n["rows"]:
            out.append(f"| {r.get('layers')} | {r.get('config')} | {r.get('steps')} | {_num(r.get('s_per_step'))} | "
                       f"{_num(r.get('loss_first'), '.3f')} -> {_num(r.get('loss_last'), '.3f')} | "
                       f"{_num(r.get('cuda_max_allocated_mb'), '.0f')} | {_pct(r.get('weights_changed_frac'))} |")
    elif name == "profile" and n.get("stages"):
        out.append(f"profile {n['profile']}{' (tiny)' if n.get('tiny') else ''}: pipeline {n.get('pipeline_s')} s "
                   f"(budget {n.get('budget_s')} s: {'within' if n.get('within_budget') else 'OVER'})"
                   + (f"; FAILED: {n['failed']}" if n.get("failed") else ""))
        out.append("| stage | seconds | exit status |")
        out.append("|---|---:|---:|")
        for stage, s in n["stages"].items():
            out.append(f"| {stage} | {s['seconds']} | {s['exit_status']} |")
        for split, e in (n.get("eval") or {}).items():
            acc = lambda m: _pct((e.get(m) or {}).get("output_accuracy"))  # noqa: E731
            ratio = lambda k: _num((e.get(k) or {}).get("value"))  # noqa: E731
            out.append(f"{split}: explicit {acc('explicit')}, latent {acc('latent')}, direct {acc('direct')}, "
                       f"retention {ratio('retention')}, compression {ratio('compression')}x, "
                       f"speedup {ratio('speedup')}x")
        if "targets_met" in n:
            out.append("targets on test (explicit >= 90%, retention >= 0.9, compression >= 1.5x): "
                       + ", ".join(f"{k} {'met' if v else 'not met' if v is not None else 'n/a'}"
                                   for k, v in n["targets_met"].items()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", type=Path, required=True)
    ap.add_argument("--numbers", type=Path, required=True)
    ap.add_argument("--meta", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.md")
    args = ap.parse_args(argv)

    meta = json.loads(args.meta.read_text())
    sections = []
    for line in args.sections.read_text().splitlines():
        name, status, seconds, limit, note = (line.split("\t") + [""] * 5)[:5]
        numbers = None
        f = args.numbers / f"{name}.json"
        if f.is_file():
            try:
                numbers = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                note = (note + "; " if note else "") + f"{f.name} is not valid JSON ({e})"
        sections.append({"name": name, "what": WHAT.get(name, ""), "status": status, "seconds": float(seconds),
                         "limit_s": float(limit) if limit else None, "note": note, "numbers": numbers})
    failed = [s for s in sections if s["status"] == "FAIL"]
    result = {**meta, "sections": sections, "failed": [s["name"] for s in failed],
              "first_failure": f"{failed[0]['name']}: {failed[0]['note']}" if failed else None,
              "total_s": round(sum(s["seconds"] for s in sections), 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2))

    md = [f"# GPU check: {meta.get('device')}{' (tiny dry run)' if meta.get('tiny') else ''}", "",
          f"commit {meta.get('commit')}, {meta.get('date')}, host {meta.get('host')}; sections' total "
          f"{result['total_s']} s (budget {meta.get('budget_s')} s){'' if meta.get('complete') else '; INCOMPLETE: still running or cut short'}",
          "", "| section | what | status | seconds | limit | note |", "|---|---|---|---:|---:|---|"]
    md += [f"| {s['name']} | {s['what']} | {s['status']} | {s['seconds']} | {s['limit_s'] or '-'} | {s['note']} |"
           for s in sections]
    md += ["", f"first failure: {result['first_failure'] or 'none'}"]
    for s in sections:
        lines = summary_lines(s["name"], s["numbers"] or {})
        if lines:
            md += ["", f"## {s['name']}: {s['what']}", "", *lines]
    (args.out / "gpu_check.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
