"""The task ladder's tooling: rungs load and validate, queue commands, results collected from experiment refs."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from codi.infra.config import ConfigError, params_from_dict, read_yaml, set_dotted
from experiments.dvc_exp import set_args
from experiments.ladder import (
    Rung,
    collect,
    load_rungs,
    markdown_table,
    plot,
    queue_command,
    rung_of,
    rung_row,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_rungs_are_valid_params_and_span_the_axes():
    rungs = load_rungs()
    assert len(rungs) >= 6 and len({r.name for r in rungs}) == len(rungs)
    shipped = read_yaml(ROOT / "params.yaml")
    for r in rungs:
        params = params_from_dict(set_dotted(shipped, r.overrides))
        assert r.doc and all(k.startswith(("extract.synthetic.", "sft.")) for k in r.overrides), r.name
        assert params.extract.synthetic  # a full, valid params file
    ops = {tuple(r.overrides.get("extract.synthetic.operators", ())) for r in rungs}
    assert ("copy",) in ops and ("max", "min") in ops  # the operations axis, from copying up
    steps = {tuple(r.overrides["extract.synthetic.chain_steps"]) for r in rungs
             if r.overrides.get("extract.synthetic.templates") == ["chain_const"]}
    assert len(steps) >= 2  # the dependent-steps axis
    assert rung_of(shipped, rungs) is not None  # the committed default is a rung of its own ladder


def _rungs_file(tmp_path, rungs):
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump({"rungs": rungs}))
    return path


@pytest.mark.parametrize("rung,msg", [
    ({"name": "a", "doc": "d", "set": {"extract.synthetic.nope": 1}}, "unknown params key extract.synthetic.nope"),
    ({"name": "a", "doc": "d", "set": {"extract.synthetic.value_range": [5, 1]}}, r"value_range = \[5, 1\]"),
    ({"name": "a b", "doc": "d", "set": {}}, "name 'a b'"),
    ({"name": "a", "set": {}}, "expected exactly the keys name, doc, set"),
])
def test_a_bad_rung_is_a_clear_error_naming_the_file_and_rung(tmp_path, rung, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        load_rungs(_rungs_file(tmp_path, [rung]), ROOT / "params.yaml")
    assert str(tmp_path / "ladder.yaml") in str(e.value)


def test_queue_command_sets_every_override_in_flow_style():
    rung = Rung("mix", "d", {"extract.synthetic.operators": ["+", "-", "max"], "extract.synthetic.value_range": [0, 9],
                             "extract.synthetic.templates": ["chain"]})
    cmd = queue_command(rung, {"sft.max_steps": 7200}, prefix="budget")
    assert cmd[:6] == ["dvc", "exp", "run", "--queue", "-n", "budget-mix"]
    sets = dict(a.split("=", 1) for a in cmd[6:] if a != "-S")
    assert set(sets) == {*rung.overrides, "sft.max_steps"} and sets["extract.synthetic.value_range"] == "[0, 9]"
    for key, text in sets.items():  # what DVC reads back (YAML) is the value asked for
        assert yaml.safe_load(text) == {**rung.overrides, "sft.max_steps": 7200}[key]
    assert set_args({"gamma": 2.0}) == ["-S", "gamma=2.0"]


def _by_split(acc):
    def summary(a):
        return {"explicit": {"n": 10, "output_accuracy": a, "output_accuracy_lo": a - 0.1, "output_accuracy_hi": a + 0.1},
                "latent": {"n": 10, "output_accuracy": a / 2, "output_accuracy_lo": 0.0, "output_accuracy_hi": a},
                "direct": {"n": 10, "output_accuracy": 0.1},
                "retention": 0.5, "retention_lo": 0.3, "retention_hi": 0.7, "compression": 1.6}
    return {"val": {"all": summary(acc), "synthetic": summary(acc)}, "test": {"synthetic": summary(acc - 0.05)}}


def test_rung_row_reads_each_split_and_the_task_size():
    base = {"gamma": 0.5, "extract": {"synthetic": {"chain_steps": [2, 4]}}}
    params = {"gamma": 0.5, "extract": {"synthetic": {"chain_steps": [5, 7]}}}
    pre = {"tokens_by_source": {"synthetic": {"mean_line_frames": 6.1, "mean_computed_values": 5.2, "mean_total": 240.0}}}
    row = rung_row("ladder-x", params, _by_split(0.9), pre, {"sft": 600.0}, base)
    assert row["params_diff"] == {"extract.synthetic.chain_steps": [5, 7]}
    assert row["val"]["explicit"] == [0.9, pytest.approx(0.8), 1.0, 10] and row["val"]["direct"] == [0.1, None, None, 10]
    assert row["test"]["explicit"][0] == pytest.approx(0.85) and row["test"]["retention"] == [0.5, 0.3, 0.7]
    assert row["test"]["compression"] == [1.6, None, None]
    assert (row["line_frames"], row["computed_values"], row["tokens"]) == (6.1, 5.2, 240.0)
    table = markdown_table([row], "test")
    assert "| ladder-x | - | 85.0% [75.0, 95.0] | 42.5% [0.0, 85.0] | 10.0% | 0.50 [0.30, 0.70] | 1.60x |" in table
    assert table.splitlines()[-1].endswith("| 6.1 | 5.2 | 240 | 600 | - |")
    beyond = rung_row("abl-x", {**params, "gamma": 20.0}, _by_split(0.9), pre, {}, base)
    assert markdown_table([beyond], "val").splitlines()[-1].endswith("| `gamma=20.0` |")


def test_plot_writes_a_png(tmp_path):
    rows = [rung_row(f"ladder-{k}", {}, _by_split(a), {}, {}, {}) for k, a in (("a", 0.9), ("b", 0.5))]
    plot(rows, tmp_path / "ladder.png")
    assert (tmp_path / "ladder.png").read_bytes()[:4] == b"\x89PNG"


def test_collect_reads_finished_experiments_from_their_git_refs(tmp_path):
    """dvc keeps each experiment as a commit under refs/exps/; collect reads the files of those commits."""
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")

    def commit(steps, acc, message):
        (tmp_path / "metrics").mkdir(exist_ok=True)
        (tmp_path / "params.yaml").write_text(yaml.safe_dump({"extract": {"synthetic": {"chain_steps": steps}}}))
        (tmp_path / "metrics/eval_by_split.json").write_text(json.dumps(_by_split(acc)))
        (tmp_path / "metrics/precompute.json").write_text(json.dumps({}))
        (tmp_path / "metrics/sft.json").write_text(json.dumps({"train_runtime_s": 100.0}))
        git("add", "-A")
        git("commit", "-qm", message)

    commit([2, 4], 0.5, "base")
    for name, steps, acc in (("ladder-b", [5, 7], 0.6), ("ladder-a", [3, 5], 0.9), ("other-c", [1, 1], 0.1)):
        commit(steps, acc, name)
        git("update-ref", f"refs/exps/ab/cdef/{name}", "HEAD")
        git("reset", "-q", "--hard", "HEAD~1")
    rungs = [Rung("five", "", {"extract.synthetic.chain_steps": [5, 7]}),
             Rung("three", "", {"extract.synthetic.chain_steps": [3, 5]})]
    rows = collect("ladder", tmp_path, rungs=rungs)
    assert [(r["experiment"], r["rung"]) for r in rows] == [("ladder-b", "five"), ("ladder-a", "three")]
    with_head = collect("ladder", tmp_path, head=True, rungs=rungs)
    assert [(r["experiment"], r["rung"]) for r in with_head] == [("ladder-b", "five"), ("ladder-a", "three"),
                                                                  ("main", None)]
    assert with_head[2]["val"]["explicit"][0] == 0.5 and with_head[2]["params_diff"] == {}
    rows = sorted(rows, key=lambda r: r["experiment"])
    assert rows[0]["params_diff"] == {"extract.synthetic.chain_steps": [3, 5]}
    assert rows[0]["val"]["explicit"][0] == 0.9 and rows[0]["seconds"] == {"sft": 100.0}


def test_rung_row_carries_the_ablation_and_probe_and_the_table_shows_them():
    from experiments.ladder import carried_table, rung_row
    lens = {"position_0": {"all": 0.1}, "position_1": {"all": 0.4}}
    evaluation = {"latent_ablation": {"test": {"ablated_accuracy": 0.12, "ablated_accuracy_ci": [0.1, 0.14],
                                               "kept_share": 0.05, "kept_share_ci": [-0.1, 0.2],
                                               "latents_carry_gain": True}},
                  "latent_probe": {"test": {"blocks": 40, "majority": {"all": 0.15}, "lens": lens,
                                            "linear": {"all": 0.5, "copy": 0.6, "computed": 0.4}}}}
    row = rung_row("r4-x", {"gamma": 0.5}, _by_split(0.8), {}, {}, {"gamma": 0.5}, evaluation)
    assert row["test"]["constant_latents"] == [0.12, 0.1, 0.14] and row["test"]["latents_carry_gain"]
    assert row["test"]["probe"] == {"blocks": 40, "majority": 0.15, "linear_all": 0.5, "linear_copy": 0.6,
                                    "linear_computed": 0.4, "lens_best": 0.4}
    assert "val" not in row or "constant_latents" not in row["val"]
    table = carried_table([row], "test")
    assert "| r4-x | 37.5% [0.0, 75.0] | 12.0% [10.0, 14.0] | 10.0% | 0.05 [-0.10, 0.20] | yes | 50.0% (60.0% / 40.0%) | 15.0% | 40.0% | - |" in table


def test_queue_set_values_read_as_dvc_reads_them(capsys):
    """`--set codi.lr=1e-3` is the float DVC would read (YAML 1.2), not the string PyYAML's 1.1 rules give, so the
    queued `-S` reads back as a float and passes the schema."""
    from codi.infra.config import yaml_value
    from experiments.ladder import main

    rung = load_rungs()[0].name
    assert main(["queue", rung, "--set", "codi.lr=1e-3", "--set", "extract.synthetic.operators=[max, min]",
                 "--dry-run"]) == 0
    words = shlex.split(capsys.readouterr().out)  # printed as a shell runs it
    sets = dict(w.split("=", 1) for w in words if w.startswith(("codi.lr=", "extract.synthetic.operators=")))
    assert yaml_value(sets["codi.lr"]) == 0.001
    assert yaml_value(sets["extract.synthetic.operators"]) == ["max", "min"]


# ------------------------------------------------------------------------------------------ seeds
def _queued(monkeypatch, argv):
    """main(argv) with `subprocess.run` recorded, not run: (exit status, the commands it would have run)."""
    import experiments.ladder as ladder

    calls = []
    monkeypatch.setattr(ladder.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    return ladder.main(argv), calls


def _named(cmds):
    return {cmd[cmd.index("-n") + 1]: dict(a.split("=", 1) for a in cmd if "=" in a) for cmd in cmds}


def test_a_seeded_queue_is_one_experiment_per_rung_and_seed(monkeypatch, capsys):
    rungs = {r.name: r for r in load_rungs()}
    a, b = list(rungs)[:2]
    status, calls = _queued(monkeypatch, ["queue", a, b, "--seeds", "0", "1", "2", "--prefix", "r5"])
    assert status == 0
    named = _named(calls)
    assert list(named) == [f"r5-{rung}-s{seed}" for rung in (a, b) for seed in (0, 1, 2)]
    for seed in (0, 1, 2):
        sets = named[f"r5-{a}-s{seed}"]
        assert sets["codi.seed"] == str(seed) and "sft.seed" not in sets  # codi's seed by default
        assert {k: yaml.safe_load(v) for k, v in sets.items() if k != "codi.seed"} == rungs[a].overrides
    assert [shlex.split(line) for line in capsys.readouterr().out.splitlines()] == calls  # printed as run
    _, calls = _queued(monkeypatch, ["queue", a, "--seeds", "4", "--seed-keys", "codi.seed", "sft.seed",
                                     "sft_direct.seed", "--dry-run"])
    assert calls == []  # --dry-run: printed only
    words = shlex.split(capsys.readouterr().out)
    assert words[:6] == ["dvc", "exp", "run", "--queue", "-n", f"ladder-{a}-s4"]
    assert words[-6:] == ["-S", "codi.seed=4", "-S", "sft.seed=4", "-S", "sft_direct.seed=4"]


def test_without_seeds_the_queue_is_as_before(monkeypatch):
    rung = load_rungs()[0]
    _, calls = _queued(monkeypatch, ["queue", rung.name, "--set", "sft.max_steps=7200", "--prefix", "budget"])
    assert calls == [queue_command(rung, {"sft.max_steps": 7200}, "budget")]
    assert calls[0][5] == f"budget-{rung.name}" and not any("seed" in a for a in calls[0])


def test_the_committed_default_queues_once_per_seed(monkeypatch):
    status, calls = _queued(monkeypatch, ["queue", "--default", "--seeds", "0", "1", "2", "3", "4", "--prefix",
                                          "r5-base", "--set", "codi.max_steps=3200"])
    assert status == 0
    assert _named(calls) == {f"r5-base-s{s}": {"codi.max_steps": "3200", "codi.seed": str(s)} for s in range(5)}
    rung = load_rungs()[0].name  # a rung named beside --default is queued too, and only it
    _, calls = _queued(monkeypatch, ["queue", "--default", rung, "--seeds", "1"])
    assert list(_named(calls)) == ["ladder-s1", f"ladder-{rung}-s1"]
    status, calls = _queued(monkeypatch, ["queue", "--default"])  # `ladder` alone: no ladder-* for collect
    assert status == 2 and calls == []


@pytest.mark.parametrize("argv,msg", [
    (["--seeds", "0", "1", "--seed-keys", "codi.seed", "codi.sed"], "--seed-keys codi.sed: not a params key"),
    (["--seeds", "0", "--seed-keys", "nope.seed"], "--seed-keys nope.seed: not a params key"),
    (["--seeds", "0", "0"], "each seed once"),
    (["--seeds", "-1"], "each seed once"),
    (["--seeds", "0", "--set", "codi.seed=3"], "--set codi.seed: a seed key"),
    (["--seed-keys", "sft.seed"], "give --seeds too"),
])
def test_a_bad_seed_fails_before_anything_is_queued(monkeypatch, capsys, argv, msg):
    status, calls = _queued(monkeypatch, ["queue", *(r.name for r in load_rungs()[:2]), *argv])
    assert status == 2 and calls == []
    assert msg in capsys.readouterr().err


def test_the_seed_keys_are_checked_as_the_rungs_overrides_are():
    from experiments.ladder import queue_commands

    with pytest.raises(ConfigError, match="codi.sed: not a params key"):
        queue_commands([None], {}, "x", [0], ["codi.sed"], ROOT / "params.yaml")
    assert queue_commands([None], {}, "x", [0], ["codi.seed"], ROOT / "params.yaml") == [
        ["dvc", "exp", "run", "--queue", "-n", "x-s0", "-S", "codi.seed=0"]]


def test_collect_gives_each_row_its_seed_group_seed_and_predictions_md5(tmp_path):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"codi": {"seed": 0}}))
    (tmp_path / "metrics/eval_by_split.json").write_text(json.dumps(_by_split(0.8)))
    (tmp_path / "metrics/precompute.json").write_text("{}")
    git("add", "-A")
    git("commit", "-qm", "base")
    for name, seed in (("r5-s10", 10), ("r5-s2", 2), ("r5-other", 0)):
        (tmp_path / "params.yaml").write_text(yaml.safe_dump({"codi": {"seed": seed}}))
        lock = {"stages": {"evaluate": {"outs": [{"path": "data/eval/predictions.parquet", "md5": f"md5{seed}"}]}}}
        (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
        git("add", "-A")
        git("commit", "-qm", name)
        git("update-ref", f"refs/exps/ab/cdef/{name}", "HEAD")
        git("reset", "-q", "--hard", "HEAD~1")
    rows = collect("r5", tmp_path, head=True, rungs=[])
    assert [(r["experiment"], r["seed_group"], r["seed"], r["predictions_md5"]) for r in rows] == [
        ("main", "main", None, None), ("r5-s2", "r5", 2, "md52"), ("r5-s10", "r5", 10, "md510"),
        ("r5-other", "r5-other", None, "md50")]  # by group, then seed as a number


def test_report_adds_the_seed_table_and_writes_the_summary(tmp_path, capsys):
    from experiments.ladder import main

    base = {"gamma": 0.5}
    rows = [rung_row(name, base, _by_split(acc), {}, {}, base) | {"rung": None, "seed_group": "g", "seed": seed}
            for name, seed, acc in (("g-s0", 0, 0.8), ("g-s1", 1, 0.9))]
    rows.append(rung_row("main", base, _by_split(0.7), {}, {}, base) | {"rung": None})  # collected before seeds
    data = tmp_path / "rows.json"
    data.write_text(json.dumps(rows))
    assert main(["report", "--data", str(data), "--seeds-json", str(tmp_path / "seeds.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(markdown_table(rows, "test"))  # the ladder table as before
    assert "| g | 2 | 40.0% ± 3.5 (37.5..42.5) | 0.50 ± 0.00 (0.50..0.50) | - | 10.0% ± 0.0 (10.0..10.0) | " \
           "unavailable |" in out
    assert "- g latent per seed: s0 37.5%, s1 42.5% (pooled interval unavailable: no predictions for g-s0, g-s1" in out
    summary = json.loads((tmp_path / "seeds.json").read_text())
    assert list(summary) == ["g", "main"] and summary["g"]["val"]["explicit"]["seeds"] == {"0": 0.8, "1": 0.9}
    single = tmp_path / "single.json"
    single.write_text(json.dumps(rows[2:]))
    assert main(["report", "--data", str(single)]) == 0
    assert capsys.readouterr().out.strip() == markdown_table(rows[2:], "test")  # one seed: nothing new


def test_every_profile_loads_and_makes_a_valid_params_file():
    """configs/profiles/*.yaml: each names a rung, sets only params keys, and passes the schema (tiny too)."""
    from experiments.profile import PROFILES_DIR, load_profile

    names = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
    assert "codi3200" in names
    for name in names:
        assert load_profile(name).name == name
