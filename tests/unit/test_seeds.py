"""Seeds as an axis of the experiment tools (experiments/seeds.py): seeded names, the spread over seeds, the
interval pooled over seeds and problems, the seed table; all on plain data (no dvc, no git refs)."""

from __future__ import annotations

import hashlib
import json
import statistics

import numpy as np
import pandas as pd
import pytest

from codi.evaluation.metrics import Bootstrap, bootstrap_intervals, scores_frame
from experiments.seeds import (
    cached_file,
    group_rows,
    has_seeds,
    outcomes,
    pooled_interval,
    predictions_md5,
    predictions_reader,
    seed_summary,
    seed_table,
    seeded_name,
    split_seed,
    spread,
)

BOOT = Bootstrap(2000, 0, 0.95)  # the evaluate stage's (params.yaml evaluate.bootstrap_*)


def test_a_seeded_name_splits_back_into_its_group_and_seed():
    assert seeded_name("r5-base", 3) == "r5-base-s3" and seeded_name("ladder-copy", None) == "ladder-copy"
    assert split_seed("r5-base-s3") == ("r5-base", 3) and split_seed("ladder-copy-s12") == ("ladder-copy", 12)
    assert split_seed("ladder-copy") == ("ladder-copy", None) and split_seed("main") == ("main", None)
    assert split_seed("x-s01") == ("x-s01", None)  # not a name --seeds writes
    assert split_seed("main (before, 8856ab1)") == ("main (before, 8856ab1)", None)


def test_spread_is_mean_sample_sd_worst_best_and_every_seed():
    s = spread({"0": 0.40, "1": 0.46, "2": 0.43})
    assert s["mean"] == pytest.approx(0.43) and s["sd"] == pytest.approx(statistics.stdev([0.40, 0.46, 0.43]))
    assert s["sd"] == pytest.approx(0.03)  # ddof=1: sqrt((0.03² + 0.03² + 0) / 2)
    assert (s["min"], s["max"], s["n_seeds"], s["seeds"]) == (0.40, 0.46, 3, {"0": 0.40, "1": 0.46, "2": 0.43})
    assert spread({"0": 0.5})["sd"] is None


def _row(name: str, latent: float, explicit: float = 0.8, constant: float | None = 0.2, **extra) -> dict:
    group, seed = split_seed(name)
    test = {"explicit": [explicit, None, None, 10], "latent": [latent, latent - 0.1, latent + 0.1, 10],
            "direct": [0.1, None, None, 10], "retention": [latent / explicit, None, None],
            "compression": [2.0, None, None]}
    if constant is not None:
        test |= {"constant_latents": [constant, None, None], "kept_share": [None, None, None]}
    return {"experiment": name, "seed_group": group, "seed": seed, "rung": "mix3", "params_diff": {}, "test": test,
            "line_frames": None, "computed_values": None, "tokens": None, "seconds": {}} | extra


def test_seed_summary_groups_seeds_and_spreads_every_figure():
    rows = [_row("r5-base-s1", 0.46), _row("r5-base-s0", 0.40), _row("r5-base-s2", 0.43), _row("main", 0.5)]
    summary = seed_summary(rows, boot=BOOT)
    assert list(summary) == ["r5-base", "main"]
    base = summary["r5-base"]
    assert base["experiments"] == ["r5-base-s0", "r5-base-s1", "r5-base-s2"] and base["seeds"] == [0, 1, 2]
    assert base["n_seeds"] == 3 and "val" not in base  # no row has val
    latent = base["test"]["latent"]
    assert latent["mean"] == pytest.approx(0.43) and latent["sd"] == pytest.approx(0.03)
    assert (latent["min"], latent["max"], latent["seeds"]) == (0.40, 0.46, {"0": 0.40, "1": 0.46, "2": 0.43})
    assert base["test"]["retention"]["mean"] == pytest.approx(0.43 / 0.8)
    assert base["test"]["constant_latents"]["seeds"] == {"0": 0.2, "1": 0.2, "2": 0.2}
    assert "kept_share" not in base["test"] and "speedup" not in base["test"]  # None / absent in every seed
    assert base["test"]["pooled"] is None and "r5-base-s0" in base["test"]["pooled_unavailable"]  # no predictions
    main = summary["main"]["test"]["latent"]
    assert main["seeds"] == {"main": 0.5} and main["sd"] is None
    assert has_seeds(summary) and not has_seeds(seed_summary([_row("main", 0.5)], boot=BOOT))
    json.dumps(summary)  # the --seeds-json shape


def test_rows_collected_before_seeds_group_by_their_names():
    old = [{k: v for k, v in _row(n, 0.4).items() if k not in ("seed_group", "seed")} for n in ("g-s1", "g-s0", "h")]
    assert {g: [r["experiment"] for r in m] for g, m in group_rows(old).items()} == {"g": ["g-s0", "g-s1"], "h": ["h"]}


def _outcomes(rng: np.random.Generator, problems: int, p: dict[str, float], calls: int = 2) -> pd.DataFrame:
    """Scored rows of a synthetic evaluation: `calls` examples per problem, each mode right with probability p."""
    rows = [{"mode": mode, "problem_id": f"p{k:03d}", "correct": bool(rng.random() < q)}
            for mode, q in p.items() for k in range(problems) for _ in range(calls)]
    return pd.DataFrame(rows)


def test_the_pooled_interval_holds_the_mean_and_is_narrower_than_one_seeds():
    rng = np.random.default_rng(7)
    seeds = {str(s): _outcomes(rng, 150, {"explicit": 0.8, "latent": 0.5, "direct": 0.1}) for s in range(2)}
    pooled = pooled_interval(seeds, BOOT)
    own = {s: pooled_interval({s: t}, BOOT) for s, t in seeds.items()}
    mean = np.mean([t.loc[t["mode"] == "latent", "correct"].mean() for t in seeds.values()])
    point, lo, hi = pooled["latent"]
    assert point == pytest.approx(mean) and lo < point < hi
    for s in seeds:  # two independent seeds' outcomes average out: a narrower interval than either alone
        assert hi - lo < own[s]["latent"][2] - own[s]["latent"][1]
    r_point, r_lo, r_hi = pooled["retention"]
    ratios = [(t["correct"][t["mode"] == "latent"].mean() / t["correct"][t["mode"] == "explicit"].mean())
              for t in seeds.values()]
    assert r_point == pytest.approx(np.mean(ratios)) and r_lo < r_point < r_hi
    assert (pooled["n_problems"], pooled["n_seeds"], pooled["resamples"], pooled["level"]) == (150, 2, 2000, 0.95)


def test_over_one_seed_the_pooled_interval_is_the_evaluate_stages_own():
    table = _outcomes(np.random.default_rng(3), 80, {"explicit": 0.7, "latent": 0.4})
    ours = pooled_interval({"0": table}, BOOT)
    stage = bootstrap_intervals(scores_frame([{**r, "positions": 1, "time_s": 1.0} for r in table.to_dict("records")]),
                                BOOT)
    assert ours["latent"][1:] == pytest.approx(stage["latent"]["output_accuracy"])
    assert ours["retention"][1:] == pytest.approx(stage["retention"])


def test_the_pooled_interval_needs_the_same_problems_in_every_seed():
    rng = np.random.default_rng(0)
    a, b = _outcomes(rng, 20, {"latent": 0.5}), _outcomes(rng, 21, {"latent": 0.5})
    with pytest.raises(ValueError, match="same problems"):
        pooled_interval({"0": a, "1": b}, BOOT)


def _predictions(latent_p: float, rng: np.random.Generator) -> pd.DataFrame:
    """An evaluate stage's predictions: test and val, a synthetic source and another."""
    parts = []
    for split in ("test", "val"):
        for source in ("synthetic", "other"):
            t = _outcomes(rng, 40, {"explicit": 0.8, "latent": latent_p, "direct": 0.1})
            parts.append(t.assign(split=split, source=source, id=range(len(t))))
    return pd.concat(parts, ignore_index=True)


def test_seed_summary_pools_the_predictions_a_reader_finds_and_says_when_one_is_missing():
    rng = np.random.default_rng(1)
    preds = {"g-s0": _predictions(0.4, rng), "g-s1": _predictions(0.6, rng)}
    rows = []
    for name, p in preds.items():
        t = outcomes(p, "test", "synthetic")
        acc = {m: float(t.loc[t["mode"] == m, "correct"].mean()) for m in ("explicit", "latent")}
        rows.append(_row(name, acc["latent"], acc["explicit"]))
    summary = seed_summary(rows, lambda row: preds.get(row["experiment"]), BOOT)
    test = summary["g"]["test"]
    assert test["pooled"]["n_problems"] == 40 and test["pooled"]["n_seeds"] == 2  # synthetic test problems only
    assert test["pooled"]["latent"][0] == pytest.approx(test["latent"]["mean"])
    assert test["pooled"]["retention"][0] == pytest.approx(test["retention"]["mean"])
    assert "pooled_unavailable" not in test
    gone = seed_summary(rows, lambda row: preds.get(row["experiment"]) if row["seed"] == 0 else None, BOOT)
    assert gone["g"]["test"]["pooled"] is None and "g-s1" in gone["g"]["test"]["pooled_unavailable"]
    assert gone["g"]["test"]["latent"]["n_seeds"] == 2  # the spread stands without predictions


def test_the_seed_table_shows_mean_sd_range_pooled_interval_and_every_seed():
    summary = seed_summary([_row("r5-s0", 0.40), _row("r5-s1", 0.46), _row("r5-s2", 0.43), _row("main", 0.5)],
                           boot=BOOT)
    summary["r5"]["test"]["pooled"] = {"n_problems": 270, "latent": [0.43, 0.40, 0.47], "direct": [0.1, 0.08, 0.12],
                                       "retention": [0.54, 0.5, 0.59]}
    text = seed_table(summary, "test")
    assert text.splitlines()[0] == "| group | seeds | latent | retention | constant latents | direct | pooled over |"
    assert ("| r5 | 3 | 43.0% ± 3.0 (40.0..46.0) [40.0, 47.0] | 0.54 ± 0.04 (0.50..0.57) [0.50, 0.59] | "
            "20.0% ± 0.0 (20.0..20.0) | 10.0% ± 0.0 (10.0..10.0) [8.0, 12.0] | 270 problems |") in text
    assert "- r5 latent per seed: s0 40.0%, s1 46.0%, s2 43.0%" in text
    assert "| main |" not in text  # one seed: the ladder table has it already
    del summary["r5"]["test"]["pooled"]
    summary["r5"]["test"] |= {"pooled": None, "pooled_unavailable": "no predictions for r5-s2"}
    text = seed_table(summary, "test")
    assert "| 10.0% ± 0.0 (10.0..10.0) | unavailable |" in text
    assert text.endswith("s2 43.0% (pooled interval unavailable: no predictions for r5-s2)")


def test_the_predictions_are_found_by_their_md5_in_the_dvc_cache(tmp_path):
    lock = {"stages": {"evaluate": {"outs": [{"path": "metrics/eval.json", "md5": "x"},
                                             {"path": "data/eval/predictions.parquet", "md5": "ab12cd"}]}}}
    assert predictions_md5(lock) == "ab12cd" and predictions_md5({"stages": {}}) is None
    frame = _predictions(0.5, np.random.default_rng(2))
    data = tmp_path / "p.parquet"
    frame.to_parquet(data, index=False)
    md5 = hashlib.md5(data.read_bytes()).hexdigest()  # noqa: S324
    assert cached_file(md5, tmp_path) is None
    cached = tmp_path / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
    cached.parent.mkdir(parents=True)
    data.rename(cached)
    assert cached_file(md5, tmp_path) == cached
    read = predictions_reader(tmp_path)
    got = read({"experiment": "g-s0", "predictions_md5": md5})
    assert list(got.columns) == ["mode", "split", "source", "problem_id", "correct"] and len(got) == len(frame)
    assert read({"experiment": "g-s1", "predictions_md5": None}) is None
    assert read({"experiment": "g-s2", "predictions_md5": "0" * 32}) is None
    other = tmp_path / "elsewhere"  # a cache moved by `dvc cache dir`
    (other / "files" / "md5" / md5[:2]).mkdir(parents=True)
    cached.rename(other / "files" / "md5" / md5[:2] / md5[2:])
    (tmp_path / ".dvc" / "config").write_text(f"[core]\n    analytics = false\n[cache]\n    dir = {other}\n")
    assert cached_file(md5, tmp_path) == other / "files" / "md5" / md5[:2] / md5[2:]


def test_dvclive_curves_parse_and_plot(tmp_path):
    from experiments.seeds import curve_at, parse_tsv, plot_seed_curves

    pts = parse_tsv("step\tvalue_loss\n1\t16.0\n10\t2.5\n20\t0.5\n")
    assert pts == [[1.0, 16.0], [10.0, 2.5], [20.0, 0.5]]
    assert curve_at({"train/value_loss": pts}, "train/value_loss", 15) == 2.5
    assert curve_at({"train/value_loss": pts}, "train/value_loss", 0) is None
    rows = [{"experiment": f"r5-s{s}", "seed_group": "r5", "seed": s,
             "curves": {"train/value_loss": pts, "eval/latent_accuracy": [[400.0, 0.1 * s], [800.0, 0.5]]}}
            for s in range(3)]
    plot_seed_curves(rows, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
