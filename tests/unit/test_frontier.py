"""experiments.frontier: seed groups become frontier points (mean, sd, worst seed), a table and a plot."""

from __future__ import annotations

import json

from experiments.frontier import frontier, main, markdown


def row(name, compression, retention, latent=0.8, rung="mix3", errors=None):
    return {"experiment": name, "rung": rung, "params_diff": {"codi.latent_unit": "frame"},
            "test": {"retention": [retention, retention - 0.05, retention + 0.05], "compression": [compression, 0, 0],
                     "latent": [latent, 0, 0, 540], "explicit": [0.93, 0, 0, 540], "direct": [0.19, 0, 0, 540],
                     "constant_latents": [0.15, 0, 0], "speedup": [1.5, 0, 0], "latents_carry_gain": True},
            "latent_first_error": errors or {"action": 3, "value": 5}}


def test_seed_groups_become_points_ordered_by_compression():
    rows = [row("r6-fpb3-s0", 3.16, 0.80), row("r6-fpb3-s1", 3.16, 0.90), row("r6-frame-s0", 2.4, 0.85),
            row("main", 1.33, 0.87, errors={"grammar": 1})]
    points = frontier(rows)
    assert list(points) == ["main", "r6-frame", "r6-fpb3"]
    p = points["r6-fpb3"]
    assert p["seeds"] == 2 and abs(p["retention"] - 0.85) < 1e-9 and p["retention_worst"] == 0.80
    assert abs(p["retention_sd"] - 0.0707) < 1e-3 and p["first_error"] == {"action": 6, "value": 10}
    assert points["main"]["retention_sd"] is None
    table = markdown(points)
    assert "| r6-fpb3 (r6-fpb3-s0, r6-fpb3-s1) | 2 | 3.16x | 0.85 ± 0.07 (0.80) |" in table
    assert "| 6 / 10 / 0 / 0 |" in table


def test_the_command_writes_the_table_and_the_plot(tmp_path, capsys):
    data = tmp_path / "r6.json"
    data.write_text(json.dumps([row("r6-frame-s0", 2.4, 0.85), row("b3-frame-s0", 2.2, 0.7, rung="branch3")]))
    assert main(["--data", str(data), "--plot", str(tmp_path / "frontier.png")]) == 0
    assert "r6-frame" in capsys.readouterr().out
    assert (tmp_path / "frontier.png").stat().st_size > 1000


def test_groups_keep_the_matching_seed_groups_of_every_file(tmp_path, capsys):
    r6, r5 = tmp_path / "r6.json", tmp_path / "r5.json"
    r6.write_text(json.dumps([row("r6-frame-s0", 2.4, 0.85), row("r6-frame-s1", 2.4, 0.8)]))
    r5.write_text(json.dumps([row("r5-ramp-s0", 1.33, 0.87), row("r5-ramp-vw2-s0", 1.33, 0.7)]))
    assert main(["--data", str(r6), str(r5), "--groups", "r6-*", "r5-ramp"]) == 0
    out = capsys.readouterr().out
    assert "| r5-ramp (r5-ramp-s0) |" in out and "| r6-frame (r6-frame-s0, r6-frame-s1) | 2 |" in out
    assert "vw2" not in out
    import pytest
    with pytest.raises(SystemExit):
        main(["--data", str(r6), "--groups", "r7-*"])


def test_each_point_carries_the_pooled_interval_of_its_seeds():
    import pandas as pd

    from experiments.frontier import pooled_retention

    def predictions(latent_right):
        return pd.DataFrame([{"split": "test", "source": "synthetic", "problem_id": f"p{k}", "mode": mode,
                              "correct": mode == "explicit" or k < latent_right} for k in range(20)
                             for mode in ("explicit", "latent", "direct")])

    rows = [row("r6-a-s0", 2.4, 0.5), row("r6-a-s1", 2.4, 0.6), row("r6-b-s0", 3.0, 0.4)]
    tables = {"r6-a-s0": predictions(10), "r6-a-s1": predictions(12)}
    pooled = pooled_retention(rows, "test", lambda r: tables.get(r["experiment"]))
    lo, hi = pooled["r6-a"]
    assert lo < 0.55 < hi and pooled["r6-b"] is None  # r6-b's predictions are missing
    table = markdown(frontier(rows, "test", pooled))
    assert f"| 0.55 ± 0.07 (0.50) | [{lo:.2f}, {hi:.2f}] |" in table and "| 0.40 (0.40) | - |" in table
