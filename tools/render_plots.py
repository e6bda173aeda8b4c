"""Render the eval plots as `dvc plots show` draws them, offline, and screenshot the page (a manual check).

    .venv/bin/python tools/render_plots.py [--plots plots/eval] [--out /tmp/codi-plots]

Needs what the project does not install: Node's npm (vega, vega-lite and vega-embed, at the versions DVC's
page loads from its CDN, are installed once into --js-cache) and Chromium (Debian: `apt-get install -y
chromium`). Without --plots, the CSVs and PNGs are written by codi.evaluation.report.write_plots from the committed
metrics/eval.json and metrics/eval_by_source.json. Everything is written under --out (a temporary DVC
project with .dvc/plots/ and the eval entries of dvc.yaml, the HTML page, the screenshot), nothing in the
repository. Not part of the tests (tests/integration/test_eval_plots.py checks the rendered data).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EVAL_PREFIX = "plots/eval/"
PAGE = """<!DOCTYPE html>
<html>
<head><meta charset="utf-8"><title>DVC plots (local vega)</title>
<script src="vega.min.js"></script>
<script src="vega-lite.min.js"></script>
<script src="vega-embed.min.js"></script>
</head>
<body>
{plot_divs}
</body>
</html>
"""  # dvc-render fills {plot_divs}; {scripts} (the CDN tags) is left out on purpose
JS_FILES = {"vega": "vega/build/vega.min.js", "vega-lite": "vega-lite/build/vega-lite.min.js",
            "vega-embed": "vega-embed/build/vega-embed.min.js"}
OUTPUTS = ("written", "project", "html", "json")  # folders under --out, with page.html and eval_plots.png
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,3000", "--virtual-time-budget=15000"]


def eval_plot_entries(dvc_yaml: Path) -> list:
    """The top-level `plots:` entries of dvc.yaml that draw files under plots/eval/."""
    def files(entry: str | dict) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        plot_id, props = next(iter(entry.items()))
        y = (props or {}).get("y")
        return list(y) if isinstance(y, dict) else [plot_id]

    entries = yaml.safe_load(dvc_yaml.read_text()).get("plots", [])
    return [e for e in entries if all(f.startswith(EVAL_PREFIX) for f in files(e))]


def make_project(dest: Path, plots_dir: Path, repo: Path = ROOT) -> Path:
    """A DVC project (no git) at `dest`: the repo's plot templates, its eval plot entries and `plots_dir`'s files."""
    (dest / ".dvc").mkdir(parents=True, exist_ok=True)
    (dest / ".dvc/config").write_text("[core]\n    no_scm = true\n    analytics = false\n    check_update = false\n")
    shutil.copytree(repo / ".dvc/plots", dest / ".dvc/plots", dirs_exist_ok=True)
    (dest / "dvc.yaml").write_text(yaml.safe_dump({"plots": eval_plot_entries(repo / "dvc.yaml")}, sort_keys=False))
    shutil.copytree(plots_dir, dest / EVAL_PREFIX, dirs_exist_ok=True)
    return dest


def dvc(project: Path, *args: str) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, env=env, text=True,
                          capture_output=True, check=False)
    if done.returncode:
        sys.exit(f"dvc {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


def cdn_versions() -> dict[str, str]:
    """The vega packages and versions that DVC's page loads (dvc_render.VegaRenderer.SCRIPTS)."""
    from dvc_render.vega import VegaRenderer

    return dict(re.findall(r"npm/([a-z-]+)@([\d.]+)", VegaRenderer.SCRIPTS))


def vega_js(cache: Path) -> list[Path]:
    """The three browser bundles, installed from npm into `cache` on first use."""
    versions = cdn_versions()
    paths = [cache / "node_modules" / JS_FILES[name] for name in JS_FILES]
    stamp = cache / "versions.json"
    if not (all(p.is_file() for p in paths) and stamp.is_file() and json.loads(stamp.read_text()) == versions):
        if shutil.which("npm") is None:
            sys.exit("npm not found: install Node.js (Debian: apt-get install -y npm) or pass --js-cache with the "
                     f"bundles {list(JS_FILES.values())} under node_modules/")
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "package.json").write_text('{"name": "codi-vega-js", "private": true}\n')
        # DVC's pins (vega 5.20.2 under vega-lite 5.2.0) disagree with vega-lite's peer range: the browser
        # bundles do not care, npm's resolver does
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--legacy-peer-deps",
                        *(f"{n}@{v}" for n, v in versions.items())], cwd=cache, check=True)
        stamp.write_text(json.dumps(versions))
    return paths


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    sys.exit("chromium not found: install it (Debian, as root: apt-get install -y chromium)")


def screenshot(page: Path, png: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="codi-chromium-") as profile:
        subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
                        page.as_uri()], check=True, capture_output=True, timeout=180)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plots", type=Path, help="a plots/eval folder to draw (default: write_plots of the metrics)")
    ap.add_argument("--metrics", type=Path, default=ROOT / "metrics", help="holds eval.json, eval_by_source.json")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "codi-plots")
    ap.add_argument("--js-cache", type=Path, default=Path(tempfile.gettempdir()) / "codi-vega-js")
    args = ap.parse_args(argv)

    out = args.out.resolve()
    for name in OUTPUTS:  # only what an earlier run wrote: --out may be a folder that holds other things
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    plots_dir = args.plots
    if plots_dir is None:
        sys.path.insert(0, str(ROOT))
        from codi.evaluation.report import write_plots

        plots_dir = out / "written"
        write_plots(json.loads((args.metrics / "eval.json").read_text()),
                    json.loads((args.metrics / "eval_by_source.json").read_text()), plots_dir)
    project = make_project(out / "project", plots_dir)
    html = out / "html"
    page = out / "page.html"
    page.write_text(PAGE)
    dvc(project, "plots", "show", "--html-template", str(page), "-o", str(html))
    for js in vega_js(args.js_cache):
        shutil.copy(js, html / js.name)
    rendered = json.loads(dvc(project, "plots", "show", "--json", "-o", str(out / "json")))
    for plot_id, items in rendered.get("data", {}).items():
        for item in items:
            rows = item.get("content", {}).get("data", {}).get("values", [])
            print(f"{plot_id}: {item['type']}" + (f", {len(rows)} rows" if item["type"] == "vega" else ""))
    for error in rendered.get("errors", []):
        print("dvc error:", error, file=sys.stderr)
    png = out / "eval_plots.png"
    screenshot(html / "index.html", png)
    print(f"page: {(html / 'index.html').as_uri()}\nscreenshot: {png}")
    return 1 if rendered.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
