"""The whole recipe on CPU with a 2-layer model: every stage's entry point, the files it writes, and
the contracts between stages (spans, checkpoints, resume, models loadable with one call)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codi.__main__ import main
from tests.tiny import ROOT, shipped, tiny_params, write_params


def cli(ws: Path, *args: str, params: str = "params.yaml") -> int:
    cwd = os.getcwd()
    os.chdir(ws)
    try:
        return main(["--params", params, *args])
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A workspace after extract -> precompute -> sft -> sft_direct -> codi -> evaluate."""
    ws = tmp_path_factory.mktemp("ws")
    write_params(ws / "params.yaml", tiny_params())
    for stage in (["extract"], ["precompute"], ["sft"], ["sft_direct"], ["codi"], ["evaluate"]):
        assert cli(ws, *stage) == 0, stage
    return ws


def test_extract_writes_traces_and_stats(ws):
    import pyarrow.parquet as pq

    table = pq.read_table(ws / "data/traces/synthetic.parquet").to_pylist()
    assert len(table) == 80 and all(r["status"] == "ok" for r in table)
    assert all(r["match"] is True for r in table)  # synthetic programs carry their expected value
    stats = json.loads((ws / "metrics/extract.json").read_text())
    assert stats == json.loads((ws / "data/traces/stats.json").read_text())
    assert stats["synthetic"]["status"] == {"ok": 80}


def test_extract_is_byte_identical_on_a_rerun(ws):
    """DVC hashes data/traces: the same params must give the same bytes (no wall times, no pids)."""
    again = ws / "traces_again"
    assert cli(ws, "extract", "--out", str(again), "--metrics", str(again / "metrics.json")) == 0
    for name in ("synthetic.parquet", "stats.json"):
        assert (again / name).read_bytes() == (ws / "data/traces" / name).read_bytes(), name


def test_precompute_cache_spans_and_base(ws):
    from transformers import AutoModelForCausalLM

    from codi.data.cache import CacheDataset
    from codi.tracing.format import parse_trace
    from codi.tracing.tokens import load_tokenizer, token_ids

    manifest = json.loads((ws / "data/cache/manifest.json").read_text())
    metrics = json.loads((ws / "metrics/precompute.json").read_text())  # the counts, for dvc exp show
    assert metrics["splits"]["train"] == {k: v for k, v in manifest["splits"]["train"].items() if k != "sha256"}
    assert metrics["tokens"] == manifest["tokens"] and "params" not in metrics
    tok = load_tokenizer(ws / "models/base")
    model = AutoModelForCausalLM.from_pretrained(ws / "models/base")
    assert model.get_input_embeddings().weight.shape[0] == len(tok) == manifest["vocab_size"]
    ids = token_ids(tok)
    problems = {}
    total = 0
    for split in ("train", "val", "test"):
        ds = CacheDataset(ws / f"data/cache/{split}.arrow")
        assert len(ds) == manifest["splits"][split]["examples"]
        texts = ds.column("trace_text")
        for k in range(len(ds)):
            ex = ds[k]
            frames = parse_trace(texts[k])
            line_locals = [f.locals for f in frames if f.kind == "line"]
            assert len(ex["spans"]) == len(line_locals)
            for (i, j), want in zip(ex["spans"], line_locals):  # the span invariant, on every example
                assert ex["trace_ids"][i] == ids.line_sep and ex["trace_ids"][j] == ids.action_sep
                assert tok.decode(ex["trace_ids"][i + 1:j]) == want
            assert ex["trace_ids"][-1] == ids.eos and ex["answer_ids"][-1] == ids.eos
            problems.setdefault(ex["problem_id"], set()).add(split)
            total += 1
    assert total == 80 - sum(sum(c.values()) for c in manifest["dropped"].values())
    assert all(len(s) == 1 for s in problems.values())  # no problem crosses splits
    assert 0 < manifest["tokens"]["locals_share"] < 1


def test_training_stages_write_models_metrics_plots(ws):
    for stage in ("sft", "sft_direct"):
        m = json.loads((ws / f"metrics/{stage}.json").read_text())
        assert m["steps"] == (8 if stage == "sft" else 6)
        # 8 steps of a 32-wide model prove the plumbing, not learning (that is the real run's report)
        assert math.isfinite(m["val_loss"]) and m["unigram_val_loss"] > 0 and m["tokens_per_s"] > 0
        assert m["train_loss"] is not None
        assert (ws / f"models/{stage}/model.safetensors").is_file()
        assert (ws / f"plots/{stage}/loss.png").stat().st_size > 1000
        live = json.loads((ws / f"dvclive/{stage}/metrics.json").read_text())  # DVC metrics and plots, live
        assert live["step"] == m["steps"] and math.isfinite(live["train"]["loss"]) and "loss" in live["eval"]
        assert set(live["summary"]) >= {"runtime", "loss"}
        tsv = (ws / f"dvclive/{stage}/plots/metrics/train/loss.tsv").read_text().splitlines()
        assert tsv[0] == "step\tloss"
        assert [int(line.split("\t")[0]) for line in tsv[1:]] == [1, *range(2, m["steps"] + 1, 2)]  # optimizer steps
    codi = json.loads((ws / "metrics/codi.json").read_text())
    assert codi["steps"] == 4 and codi["student_loss_first"] is not None
    assert 0.0 <= codi["val_latent_accuracy"] <= 1.0
    plotted = {p.relative_to(ws / "dvclive/codi/plots/metrics").as_posix()
               for p in (ws / "dvclive/codi/plots/metrics").rglob("*.tsv")}
    assert plotted >= {"train/loss.tsv", "train/teacher_loss.tsv", "train/student_loss.tsv", "train/kd_loss.tsv",
                       "eval/student_loss.tsv", "eval/latent_accuracy.tsv"}
    assert not any(p.startswith("summary/") or p.endswith("epoch.tsv") for p in plotted)


def test_codi_model_loads_with_one_call(ws):
    from codi.modeling import load_codi_model

    loaded = load_codi_model(ws / "models/codi")
    # decoded exactly as trained: the shipped latent_steps, recorded in the model folder
    assert loaded.config.options.latent_steps == shipped("codi").latent_steps and loaded.config.extra["step"] == 4
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.get_input_embeddings().weight.data_ptr()


def test_evaluate_outputs(ws):
    import pyarrow.parquet as pq

    ev = json.loads((ws / "metrics/eval.json").read_text())
    assert set(ev) >= {"explicit", "latent", "direct"}
    for mode in ("explicit", "latent", "direct"):
        assert 0.0 <= ev[mode]["output_accuracy"] <= 1.0 and ev[mode]["n"] > 0
    rows = pq.read_table(ws / "data/eval/predictions.parquet").to_pylist()
    assert len(rows) == 3 * ev["explicit"]["n"]
    assert all(r["correct"] or r["reason"] for r in rows)  # every wrong row says why
    assert "| mode |" in (ws / "metrics/eval.md").read_text()
    diag = ev["latent_diagnostics"]  # the latent decoder again with the true action lines forced, and its latents
    assert 0.0 <= diag["forced_actions_accuracy"] <= 1.0 and diag["embedding_norm"] > 0
    assert diag["latent_norm"] is None or diag["latent_norm"] > 0  # None: the 4-step model wrote no LINE frame
    assert "Latent diagnostics" in (ws / "metrics/eval.md").read_text()
    # every graded (synthetic) example is counted under its generator level; HumanEval is ungraded
    by_level = json.loads((ws / "metrics/eval_by_difficulty.json").read_text())
    by_source = json.loads((ws / "metrics/eval_by_source.json").read_text())
    assert set(by_level) <= {"1", "2", "3"} and by_level
    assert sum(v["explicit"]["n"] for v in by_level.values()) == by_source["synthetic"]["explicit"]["n"]
    for name in ("accuracy.png", "accuracy_vs_positions.png", "accuracy.csv", "accuracy_vs_positions.csv"):
        assert (ws / "plots/eval" / name).stat().st_size > 0
    # per split: the rows of each evaluated split, apart (choose on val, report on test)
    by_split = json.loads((ws / "metrics/eval_by_split.json").read_text())
    explicit_rows = [r for r in rows if r["mode"] == "explicit"]
    assert set(by_split) == {r["split"] for r in rows}
    for split, v in by_split.items():
        in_split = [r for r in explicit_rows if r["split"] == split]
        assert v["all"]["explicit"]["n"] == len(in_split)
        assert v["all"]["explicit"]["output_accuracy"] == round(sum(r["correct"] for r in in_split) / len(in_split), 4)
    assert all("output_accuracy_lo" in v["all"]["explicit"] for v in by_split.values())
    # what the latents carry: the constant-latent ablation and the probe, per evaluated split
    ablation, probe = ev["latent_ablation"], ev["latent_probe"]
    assert set(ablation) == set(by_split)
    for split, a in ablation.items():
        assert a["n"] == by_split[split]["all"]["latent"]["n"]
        assert a["latent_accuracy"] == by_split[split]["all"]["latent"]["output_accuracy"]
        assert 0.0 <= a["ablated_accuracy"] <= 1.0 and "latents_carry_gain" in a
    assert probe["train_blocks"] > 0
    for split in (s for s in probe if isinstance(probe[s], dict)):
        p = probe[split]
        assert p["blocks"] > 0 and sum(p["kinds"].values()) == p["blocks"]
        for reader in (p["majority"], p["linear"], *p["lens"].values()):
            assert 0.0 <= reader["all"] <= 1.0 and reader["by_frame"]
    report = (ws / "metrics/eval.md").read_text()
    assert "What the latents carry" in report and "Latent probe" in report and "Diagnosis (" in report
    assert (ws / "plots/eval/latent_probe.png").stat().st_size > 0


def test_codi_with_every_option_beyond_the_reference(ws, tmp_path, capsys):
    """kd_norm, kd_positions, the reconstruction with its own decoder and the latent curriculum: the stage trains,
    reports the held-out reconstruction probe, records the options in models/codi, keeps the auxiliary decoder in
    its checkpoints (not in the model), and a rerun resumes the finished run."""
    from codi.modeling import load_codi_model

    other = tmp_path / "ws"
    shutil.copytree(ws, other, ignore=shutil.ignore_patterns("checkpoints", "dvclive"))
    opts = {"kd_norm": "teacher_std", "kd_positions": "action_line", "recon_weight": 0.5, "recon_decoder": "copy",
            "latent_curriculum_frac": 0.5, "mix_explicit_prob": 0.2, "latent_steps": 2,
            "projector_dropout": 0.1}
    write_params(other / "params.yaml", tiny_params(codi=opts))
    assert cli(other, "codi") == 0
    summary = json.loads((other / "metrics/codi.json").read_text())
    assert 0.0 <= summary["val_recon_exact_match"] <= 1.0 and summary["val_recon_frames"] > 0
    assert summary["recon_loss_last"] > 0
    cfg = load_codi_model(other / "models/codi").config.options
    assert {k: getattr(cfg, k) for k in opts} == opts
    assert not any("recon" in f.name for f in (other / "models/codi").iterdir())
    ckpts = sorted((other / "checkpoints/codi").glob("checkpoint-*"))
    assert ckpts and all((c / "recon_decoder.safetensors").is_file() for c in ckpts)
    shares = [h["latent_share"] for h in json.loads((ckpts[-1] / "trainer_state.json").read_text())["log_history"]
              if "latent_share" in h]
    # logged after steps 1..4 of 4: the ramp spans 2 steps, then 20% of the frames stay explicit
    assert shares == pytest.approx([0.4, 0.8, 0.8, 0.8])
    capsys.readouterr()
    assert cli(other, "codi") == 0
    assert "resuming from" in capsys.readouterr().out


def _without_times(data):
    """A metrics tree without what a clock measured (each mode's time, the wall speedup and its interval)."""
    if isinstance(data, dict):
        return {k: _without_times(v) for k, v in data.items() if "time" not in k and not k.startswith("speedup")}
    return [_without_times(v) for v in data] if isinstance(data, list) else data


def test_evaluate_in_two_processes_gives_the_same_figures(ws, tmp_path, capfd):
    """evaluate.processes 2: the units run in spawned processes, and every figure, prediction and the probe equal
    the in-process run's (the shipped value, 1); only what a clock measured may differ."""
    import pyarrow.parquet as pq

    other = tmp_path / "ws"
    shutil.copytree(ws, other, ignore=shutil.ignore_patterns("traces_again", "checkpoints", "dvclive"))
    write_params(other / "params.yaml", tiny_params(evaluate={"processes": 2}))
    capfd.readouterr()
    assert cli(other, "evaluate") == 0
    assert "evaluate latent with constant latents" in capfd.readouterr().out  # the workers' prints reach the stage's output
    for name in ("eval.json", "eval_by_split.json", "eval_by_source.json", "eval_by_difficulty.json"):
        one, two = (json.loads((w / "metrics" / name).read_text()) for w in (ws, other))
        assert _without_times(two) == _without_times(one), name
    assert "latent_probe" in json.loads((other / "metrics/eval.json").read_text())
    one, two = (pq.read_table(w / "data/eval/predictions.parquet").to_pandas() for w in (ws, other))
    kept = [c for c in one.columns if "time" not in c]
    assert two[kept].equals(one[kept])
    # a missing model is said at once, naming the folder, before any process starts
    shutil.rmtree(other / "models/sft_direct")
    assert cli(other, "evaluate") == 2
    err = capfd.readouterr().err
    assert "error: " in err and "models/sft_direct holds no model" in err and "Traceback" not in err


def test_codi_with_the_value_levers_trains_and_evaluates(ws, tmp_path, capsys):
    """Research IV's levers (value CE with hard feedback, value KD, CODI's answer anchor, the stage curriculum) and
    research V's ramp of the value terms: the stage trains on each frame's assigned value and logs the value terms
    and the ramp's factor, resets the optimizer at the stage switch, the saved model records the options, and
    evaluate decodes it with the same feedback (ablation and probe too)."""
    from codi.modeling import load_codi_model

    other = tmp_path / "ws"
    shutil.copytree(ws, other, ignore=shutil.ignore_patterns("checkpoints", "dvclive"))
    opts = {"latent_steps": 2, "value_weight": 1.0, "value_feedback": "hard", "value_kd_weight": 0.5,
            "kd_positions": "answer", "stage_steps": 2, "stage_reset_optimizer": True, "stage_smoothing": 0.5,
            "stage_mix_prob": 0.5}
    write_params(other / "params.yaml", tiny_params(codi={**opts, "value_ramp_frac": 0.5}))
    capsys.readouterr()
    assert cli(other, "codi") == 0
    out = capsys.readouterr().out
    assert "value slots (train)" in out and "stage 2 from step 2: optimizer state reset" in out
    state = json.loads(sorted((other / "checkpoints/codi").glob("checkpoint-*"))[-1].joinpath("trainer_state.json")
                       .read_text())
    logged = [h for h in state["log_history"] if "value_loss" in h]
    # stage 1 makes only the first LINE frame latent, which follows `def` and so often carries no value: 0 there
    assert logged and all(h["value_loss"] >= 0 and h["value_kd_loss"] >= 0 for h in logged)
    assert any(h["value_loss"] > 0 for h in logged) and any(h["value_kd_loss"] > 0 for h in logged)
    assert [h["latent_frames"] for h in logged if "latent_frames" in h]  # the stage curriculum's frames, logged
    # the value terms' ramp (research V) over 2 of the 4 steps, logged after each step: its factor during that step
    assert [h["value_scale"] for h in logged] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    cfg = load_codi_model(other / "models/codi").config.options
    assert {k: getattr(cfg, k) for k in opts} == opts
    assert cli(other, "evaluate") == 0
    assert "latent_ablation" in json.loads((other / "metrics/eval.json").read_text())


def test_codi_with_whole_frame_latents_trains_and_evaluates(ws, tmp_path, capsys):
    """Research VI's frame unit with multi-frame blocks and the latent call frame, reached by the unit curriculum: a
    latent block stands for up to 2 consecutive frames, locals and lines, the entry call's frame first. The stage
    trains the locals unit at step 0, whole frames one a block at step 1 and the configured unit from step 2,
    resetting the optimizer at each switch, with the value terms and the reconstruction of the whole block; the saved
    model records the configured unit, and evaluate decodes with it: latent frames carry no line, so the latent mode
    has no action accuracy."""
    from codi.modeling import load_codi_model

    other = tmp_path / "ws"
    shutil.copytree(ws, other, ignore=shutil.ignore_patterns("checkpoints", "dvclive"))
    opts = {"latent_unit": "frame", "frames_per_block": 2, "latent_steps": 3, "value_weight": 1.0,
            "value_kd_weight": 0.5, "value_feedback": "soft", "recon_weight": 0.5, "latent_call": True,
            "unit_stage_steps": 1, "stage_reset_optimizer": True}
    write_params(other / "params.yaml", tiny_params(codi=opts))
    capsys.readouterr()
    assert cli(other, "codi") == 0
    out = capsys.readouterr().out
    assert "stage 2 from step 1: optimizer state reset" in out and "stage 3 from step 2: optimizer state reset" in out
    state = json.loads(sorted((other / "checkpoints/codi").glob("checkpoint-*"))[-1].joinpath("trainer_state.json")
                       .read_text())
    assert [h["unit_stage"] for h in state["log_history"] if "unit_stage" in h] == [0.0, 1.0, 2.0, 2.0]
    options = load_codi_model(other / "models/codi").config.options
    assert (options.latent_unit, options.frames_per_block, options.latent_call, options.unit_stage_steps) == (
        "frame", 2, True, 1)
    assert cli(other, "evaluate") == 0
    import pyarrow.parquet as pq

    rows = pq.read_table(other / "data/eval/predictions.parquet").to_pylist()
    latent = [r for r in rows if r["mode"] == "latent"]
    assert latent and all(r["action_accuracy"] is None and r["trace_exact"] is None for r in latent)
    assert all(r["action_accuracy"] is not None for r in rows if r["mode"] == "explicit")
    texts = json.loads((other / "metrics/eval.json").read_text())
    assert "latent_ablation" in texts


def test_rerun_resumes_the_finished_run(ws, capsys):
    """Same params, same data: the checkpoint folder belongs to this run; nothing is retrained."""
    before = (ws / "models/sft/model.safetensors").read_bytes()
    assert cli(ws, "sft") == 0
    assert "resuming from" in capsys.readouterr().out
    assert (ws / "models/sft/model.safetensors").read_bytes() == before


def test_changed_data_refuses_to_resume(ws, capsys, tmp_path):
    other = tmp_path / "ws"
    shutil.copytree(ws, other)
    manifest = other / "data/cache/manifest.json"
    manifest.write_text(manifest.read_text().replace('"format_version"', '"edited": 1, "format_version"'))
    assert cli(other, "sft_direct") == 0
    out = capsys.readouterr().out
    assert "refusing to resume" in out and "cache" in out
    assert "resuming from" not in out


def test_an_edit_to_the_code_the_stage_imports_retrains_from_step_0(ws, tmp_path):
    """The fingerprint holds the digest of the stage's import closure: after an edit to codi/data/batching.py
    (which DVC reruns sft for), the finished checkpoint is not resumed; training starts again at step 0."""
    other = tmp_path / "ws"
    shutil.copytree(ws, other, ignore=shutil.ignore_patterns("traces_again"))
    shutil.copytree(ROOT / "codi", other / "codi", ignore=shutil.ignore_patterns("__pycache__"))

    def sft() -> str:  # `python -m codi` in `other` imports the package copy there (cwd comes first)
        proc = subprocess.run([sys.executable, "-m", "codi", "sft"], cwd=other, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "WANDB_MODE": "disabled"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    assert "resuming from" in sft()  # the same code (a copy of it): the finished run is resumed, nothing retrains
    loss_tsv = other / "dvclive/sft/plots/metrics/train/loss.tsv"
    loss_tsv.write_text("step\tloss\n")  # a resumed run would add no row; a fresh one logs every step again
    (other / "codi/data/batching.py").write_text((other / "codi/data/batching.py").read_text() + "\n# an edit\n")
    out = sft()
    assert "refusing to resume" in out and "the code the stage imports changed (codi/data/batching.py modified)" in out
    assert "resuming from" not in out
    steps = [int(line.split("\t")[0]) for line in loss_tsv.read_text().splitlines()[1:]]
    assert steps == [1, 2, 4, 6, 8]
    run = json.loads((other / "checkpoints/sft/run.json").read_text())
    assert run["code"]["codi/data/batching.py"] != json.loads((ws / "checkpoints/sft/run.json").read_text())["code"]["codi/data/batching.py"]


def test_dvclive_metrics_are_on_disk_while_the_stage_runs(ws, tmp_path):
    """`dvc exp show` / `dvc plots show` of a running stage read these files: they must grow during training."""
    import time

    other = tmp_path / "ws"
    shutil.copytree(ws, other, ignore=shutil.ignore_patterns("traces_again", "checkpoints", "dvclive"))
    write_params(other / "params.yaml", tiny_params(sft={"max_steps": 150, "logging_steps": 1, "eval_steps": 150,
                                                         "save_steps": 150}))
    proc = subprocess.Popen([sys.executable, "-m", "codi", "sft"], cwd=other, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    live, seen = other / "dvclive/sft/metrics.json", []
    try:
        while proc.poll() is None:
            try:
                seen.append(json.loads(live.read_text())["step"])
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
    finally:
        proc.kill()
    assert proc.wait() == 0, proc.stderr.read()[-2000:]
    assert seen and 1 <= seen[0] < 150, seen[:5]  # a step was on disk while the stage was still running
    assert json.loads(live.read_text())["step"] == 150


def test_a_model_whose_tokenizer_did_not_make_the_cache_is_refused(ws, tmp_path, capsys):
    other = tmp_path / "ws"
    shutil.copytree(ws, other, ignore=shutil.ignore_patterns("traces_again", "checkpoints", "dvclive"))
    manifest = other / "data/cache/manifest.json"
    data = json.loads(manifest.read_text())
    data["tokenizer_sha256"] = "0" * 64
    manifest.write_text(json.dumps(data))
    for stage in ("sft", "codi", "evaluate"):
        assert cli(other, stage) == 2, stage
        err = capsys.readouterr().err
        assert "error: " in err and "its tokenizer is not the one that made" in err and "Traceback" not in err


def test_a_model_folder_that_is_not_a_causal_lm_is_refused(ws, tmp_path, capsys):
    from transformers import ViTConfig

    other = tmp_path / "ws"
    shutil.copytree(ws, other, ignore=shutil.ignore_patterns("traces_again", "checkpoints", "dvclive"))
    (other / "models/sft/config.json").unlink()
    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8).save_pretrained(other / "models/sft")
    for stage in ("codi", "evaluate"):
        assert cli(other, stage) == 2, stage
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if line.startswith("error: ")] == [
            "error: models/sft: not a causal LM that transformers can load " + err.split("can load ", 1)[1].splitlines()[0]]
        assert "ViTConfig" in err and "Traceback" not in err


@pytest.mark.parametrize("stage, dotted, value, expected", [
    ("codi", ("codi", "kd_layers"), [7], "codi.kd_layers = [7]: 7 is out of range"),
    ("codi", ("codi", "frozen_teacher"), "/nonexistent/teacher", "codi.frozen_teacher = '/nonexistent/teacher'"),
    ("codi", ("codi", "latent_steps"), -1, "codi.latent_steps = -1: expected an integer >= 0"),
    ("codi", ("codi", "kd_target"), "cosine", "codi.kd_target = 'cosine': expected one of"),
    ("sft", ("sft", "optimizer"), "lion", "sft.optimizer = 'lion': expected one of"),
    ("sft", ("sft", "keep"), "best", "save_steps = 4 with keep = 'best'"),
    ("precompute", ("precompute", "max_seq_len"), 0, "precompute.max_seq_len = 0: expected an integer >= 1"),
    ("precompute", ("model", "base"), "./no/such/model", "model.base = './no/such/model': no such model folder"),
    ("precompute", ("model", "base"), "Qwen/Qwen2.5-0.5B", "a hub id, but the hub cannot be reached"),
    ("precompute", ("model", "tiny"), {"vocab_size": 100}, "model.tiny.vocab_size = 100: expected an integer >= 300"),
])
def test_bad_params_fail_before_work_with_the_key_named(ws, capsys, tmp_path, stage, dotted, value, expected):
    section, key = dotted
    override = {section: {key: value}}
    if stage == "sft" and key == "keep":
        override = {"sft": {"keep": "best", "eval_steps": 3}}
    write_params(tmp_path / "bad.yaml", tiny_params(**override))
    args = {"codi": ["codi", "--out", str(tmp_path / "codi"), "--checkpoints", str(tmp_path / "ck")],
            "sft": ["sft", "--out", str(tmp_path / "sft"), "--checkpoints", str(tmp_path / "ck")],
            "precompute": ["precompute", "--cache", str(tmp_path / "cache"), "--base-out", str(tmp_path / "base")]}[stage]
    assert cli(ws, *args, params=str(tmp_path / "bad.yaml")) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "cache").exists()  # no work was done


def test_trace_command_on_a_dataset_file(tmp_path):
    out = tmp_path / "crux.parquet"
    code = main(["--params", str(write_params(tmp_path / "p.yaml", tiny_params())), "trace", "--source",
                 "cruxeval", "--path", str(ROOT / "tests/fixtures/sources/cruxeval.jsonl"), "--out", str(out)])
    assert code == 0
    import pyarrow.parquet as pq
    rows = pq.read_table(out).to_pylist()
    assert rows and {r["source"] for r in rows} == {"cruxeval"}
    assert any(r["status"] == "ok" and r["match"] for r in rows)


def test_console_script_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "codi", "--params", str(ROOT / "params.yaml"), "params"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and f"codi.latent_steps = {shipped('codi').latent_steps}" in proc.stdout


def test_fresh_seed_evaluates_the_committed_models_on_new_programs(ws, tmp_path):
    """experiments.fresh_seed: programs of another generator seed, none of them in the committed cache, traced and
    encoded with the committed tokenizer, evaluated by the evaluate stage; each mode's accuracy set beside
    the committed synthetic-test interval."""
    import pandas as pd

    from codi.infra.config import load_params
    from experiments.fresh_seed import MODES, committed_programs, fresh_samples, run

    params = load_params(ws / "params.yaml")
    seen = committed_programs(ws / "data/cache")
    samples = fresh_samples(params, params.extract.synthetic.seed + 1, 30, seen)
    assert samples and not {s.program for s in samples} & seen
    models = {m: ws / "models" / m for m in ("sft", "codi", "sft_direct")}
    report = run(ws / "params.yaml", params.extract.synthetic.seed + 1, 30, tmp_path / "fresh", ws / "data/cache",
                 models, ws / "metrics/eval_by_split.json")
    committed = json.loads((ws / "metrics/eval_by_split.json").read_text())["test"]["synthetic"]
    for mode in ("explicit", "latent", "direct"):
        r = report[mode]
        assert 0.0 <= r["fresh"] <= 1.0 and r["committed"] == committed[mode]["output_accuracy"]
        assert r["within_interval"] == (r["committed_lo"] <= r["fresh"] <= r["committed_hi"])
        assert r["fresh_lo"] <= r["fresh"] <= r["fresh_hi"]
    assert report["examples"] == json.loads((tmp_path / "fresh/eval.json").read_text())["explicit"]["n"] > 0
    assert json.loads((tmp_path / "fresh/fresh_seed.json").read_text()) == report
    predictions = pd.read_parquet(tmp_path / "fresh/predictions.parquet")  # kept: the per-example answers
    assert set(predictions["split"]) == {"test"} and len(predictions) == report["examples"] * len(MODES)
