"""Training plumbing: loss masking, checkpoint validation and resume policy, atomic writes, wandb offline."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from codi.data.batching import IGNORE_INDEX, CausalLMCollator
from codi.infra.files import atomic_dir
from codi.training.checkpoints import CheckpointDir, CorruptCheckpoint, checkpoint_problem
from codi.training.tracking import finish_wandb, setup_wandb
from tests.tiny import shipped


def examples():
    return [{"prompt_ids": [5, 6, 7], "trace_ids": [8, 9, 2], "answer_ids": [4, 2]},
            {"prompt_ids": [5, 6, 7, 7, 7], "trace_ids": [8, 9, 9, 9, 2], "answer_ids": [3, 3, 2]}]


def tiny_lm(vocab: int = 16):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=32, pad_token_id=0)).eval()


@pytest.mark.parametrize("target", ["trace", "answer"])
def test_only_target_tokens_carry_labels(target):
    batch = CausalLMCollator(pad_id=0, target=target)(examples())
    key = "trace_ids" if target == "trace" else "answer_ids"
    for row, ex in zip(range(2), examples()):
        p, t = ex["prompt_ids"], ex[key]
        labels = batch["labels"][row].tolist()
        assert labels[:len(p)] == [IGNORE_INDEX] * len(p)           # prompt positions never contribute
        assert labels[len(p):len(p) + len(t)] == t
        assert all(x == IGNORE_INDEX for x in labels[len(p) + len(t):])  # nor padding
        assert batch["input_ids"][row, :len(p) + len(t)].tolist() == p + t


def test_loss_is_the_mean_ce_over_trace_tokens_and_needs_no_mask():
    model = tiny_lm()
    col = CausalLMCollator(pad_id=0)
    batch = col(examples())
    with torch.no_grad():
        loss = model(**batch).loss
        masked = model(**CausalLMCollator(pad_id=0, attention_mask=True)(examples())).loss
        # by hand: each trace token predicted from the position before it, nothing else
        nll, n = 0.0, 0
        for ex in examples():
            ids = torch.tensor([ex["prompt_ids"] + ex["trace_ids"]])
            logp = model(input_ids=ids).logits.log_softmax(-1)[0]
            for k in range(len(ex["prompt_ids"]), ids.shape[1]):
                nll -= logp[k - 1, ids[0, k]].item()
                n += 1
    assert loss.item() == pytest.approx(nll / n, rel=1e-5)
    assert loss.item() == pytest.approx(masked.item(), rel=1e-6)  # right padding: the mask changes nothing


def test_computed_mask_marks_what_a_frame_does_not_copy_and_the_return_value():
    from codi.data.batching import computed_mask
    from tests.codi_oracle import TOKEN_IDS as ids

    # CALL {a 1} | LINE {a 1} | LINE {a 1 , b 3} | LINE {a 2 , b 3} | RETURN
    a, b, one, two, three, comma = 20, 21, 31, 32, 33, 40
    trace = [ids.call_sep, a, one, ids.action_sep, 50, ids.frame_sep,
             ids.line_sep, a, one, ids.action_sep, 51, ids.frame_sep,
             ids.line_sep, a, one, comma, b, three, ids.action_sep, 52, ids.frame_sep,
             ids.line_sep, a, two, comma, b, three, ids.action_sep, 53, ids.frame_sep,
             ids.return_sep, ids.action_sep, 53, ids.arg_sep, three, ids.frame_sep, ids.eos]
    marked = [trace[k] for k, m in enumerate(computed_mask(trace, ids)) if m]
    assert marked == [comma, b, three, two, three]  # the new variable b = 3, a's new value, the return VALUE


def test_the_weighted_loss_weights_computed_tokens_and_validation_stays_plain_ce(tmp_path):
    from transformers import TrainingArguments

    from codi.training.grouped import LengthGroupedTrainer
    from codi.training.weights import FullWeights
    from tests.codi_oracle import TOKEN_IDS as ids

    ex = {"prompt_ids": [12, 13], "trace_ids": [ids.call_sep, 20, 31, ids.action_sep, 14, ids.frame_sep,
                                                  ids.line_sep, 20, 32, ids.action_sep, 15, ids.frame_sep, ids.eos]}
    model = tiny_lm(vocab=64)
    plain = CausalLMCollator(pad_id=0)([ex])
    weighted = CausalLMCollator(pad_id=0, computed_weight=3.0, ids=ids)([ex])
    assert weighted["loss_weights"][0].tolist().count(3.0) == 1  # the one computed token: 32
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = LengthGroupedTrainer(model=model, args=args, section=shipped("sft", group_by_length=False),
                                   weights=FullWeights(model))
    with torch.no_grad():
        logp = model(input_ids=plain["input_ids"]).logits.log_softmax(-1)[0]
        seq = ex["prompt_ids"] + ex["trace_ids"]
        nll = [-logp[k - 1, seq[k]].item() for k in range(2, len(seq))]
        w = [3.0 if seq[k] == 32 else 1.0 for k in range(2, len(seq))]
        model.train()
        loss = trainer.compute_loss(model, dict(weighted))
        assert loss.item() == pytest.approx(sum(a * b for a, b in zip(nll, w)) / sum(w), rel=1e-5)
        assert trainer.loss_is_scaled_for_ga is False     # a per-micro-batch mean: the Trainer scales it
        model.eval()
        assert trainer.compute_loss(model, dict(weighted)).item() == pytest.approx(sum(nll) / len(nll), rel=1e-5)
        assert trainer.loss_is_scaled_for_ga is None


def fake_checkpoint(root: Path, step: int, truncate: str | None = None) -> Path:
    from safetensors.torch import save_file

    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    save_file({"w": torch.zeros(64)}, str(d / "model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({"x": torch.zeros(64)}, d / name)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if truncate:
        data = (d / truncate).read_bytes()
        (d / truncate).write_bytes(data[: len(data) // 2])
    return d


def test_an_interrupted_save_is_skipped(tmp_path, capsys):
    """A kill while saving leaves no readable trainer_state.json (written last): the checkpoint before it resumes."""
    fp = {"params": 1}
    ck = CheckpointDir(tmp_path / "ck", fp)
    assert ck.prepare() is None  # fresh: writes run.json
    fake_checkpoint(ck.root, 10)
    fake_checkpoint(ck.root, 20, truncate="trainer_state.json")
    assert checkpoint_problem(ck.root / "checkpoint-20") is not None
    assert CheckpointDir(tmp_path / "ck", fp).prepare() == str(ck.root / "checkpoint-10")
    out = capsys.readouterr().out
    assert "skipping incomplete checkpoint" in out and "checkpoint-20" in out


def flip_a_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("broken, how", [("model.safetensors", "truncate"), ("optimizer.pt", "truncate"),
                                         ("rng_state.pth", "truncate"), ("optimizer.pt", "flip"),
                                         ("config.json", "delete")])
def test_a_damaged_checkpoint_is_an_error_naming_the_file(tmp_path, broken, how):
    """Saved whole (trainer_state.json present), damaged since: an error naming the file and what to delete,
    not a silent resume from an older checkpoint."""
    fp = {"stage": "sft", "params": 1}
    ck = CheckpointDir(tmp_path / "ck", fp)
    ck.prepare()
    fake_checkpoint(ck.root, 10)
    d = fake_checkpoint(ck.root, 20, truncate=broken if how == "truncate" else None)
    if how == "flip":
        flip_a_middle_byte(d / broken)  # a torch.save archive: its members' CRC no longer matches
    elif how == "delete":
        (d / broken).unlink()
    with pytest.raises(CorruptCheckpoint) as e:
        CheckpointDir(tmp_path / "ck", fp).prepare()
    msg = str(e.value)
    assert msg.startswith(str(d / broken)) and f"delete {ck.root} to restart the sft stage from step 0" in msg
    assert "\n" not in msg


def test_a_damaged_sharded_checkpoint_is_an_error_naming_the_file(tmp_path):
    """FSDP's format: torch.distributed.checkpoint shards, whose .metadata lists every byte range."""
    import torch.distributed.checkpoint as dcp

    fp = {"stage": "codi", "params": 1}
    ck = CheckpointDir(tmp_path / "ck", fp)
    ck.prepare()
    d = ck.root / "checkpoint-4"
    dcp.save({"model": {"w": torch.arange(4096.0)}}, checkpoint_id=str(d / "sharded"))  # one process: no group
    for name in ("scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        torch.save({"x": torch.zeros(8)}, d / name)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    assert checkpoint_problem(d) is None
    assert CheckpointDir(tmp_path / "ck", fp).prepare() == str(d)
    [shard] = (d / "sharded").glob("*.distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[:100])
    with pytest.raises(CorruptCheckpoint, match=f"^{shard}: sharded/{shard.name} truncated"):
        CheckpointDir(tmp_path / "ck", fp).prepare()
    shard.write_bytes(data)
    (d / "sharded/.metadata").write_bytes(b"not a pickle")
    with pytest.raises(CorruptCheckpoint, match="sharded/.metadata unreadable.*delete .* to restart the codi stage"):
        CheckpointDir(tmp_path / "ck", fp).prepare()


def test_a_different_run_never_resumes(tmp_path, capsys):
    CheckpointDir(tmp_path / "ck", {"cache": "a", "params": 1}).prepare()
    fake_checkpoint(tmp_path / "ck", 10)
    assert CheckpointDir(tmp_path / "ck", {"cache": "b", "params": 1}).prepare() is None
    out = capsys.readouterr().out
    assert "refusing to resume" in out and "cache" in out
    assert not (tmp_path / "ck" / "checkpoint-10").exists()  # the other run's checkpoints are gone
    assert json.loads((tmp_path / "ck" / "run.json").read_text())["cache"] == "b"


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "models" / "sft"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("killed mid-save")
    assert not final.exists() and not list((tmp_path / "models").iterdir())
    with atomic_dir(final) as tmp:
        (tmp / "config.json").write_text("{}")
    assert (final / "config.json").is_file()


def test_wandb_offline_writes_a_run_and_opens_no_connection(tmp_path, monkeypatch):
    """Offline wandb in this process: a run folder, and no socket to anything but this machine."""
    attempts = []
    real_connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost") and not host.startswith("/"):
            attempts.append(address)
            raise OSError("network disabled in this test")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("DVC_EXP_NAME", "exp-test")
    report = setup_wandb(shipped("wandb", mode="offline", project="codi-test", entity=""), "sft", {"sft": {"lr": 1.0}}, True)
    assert report == ["wandb"]
    import wandb
    assert wandb.run.name == "exp-test-sft" and wandb.run.group == "exp-test"
    assert wandb.run.config["sft"]["lr"] == 1.0
    wandb.log({"loss": 1.0})
    where = finish_wandb(report)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and where is not None
    assert attempts == []
    assert os.environ["WANDB_MODE"] == "offline"


def test_wandb_disabled_reports_nowhere(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the environment wins over params
    assert setup_wandb(shipped("wandb", mode="online", project="p", entity=""), "sft", {}, True) == []


def test_the_refusal_names_what_changed_in_words(tmp_path, capsys):
    fp = {"cache": "a" * 64, "params": {"lr": 0.001, "seed": 0}, "weights": [1.0, 1.0, 1.0],
          "code": {"codi/data/batching.py": "c" * 64, "codi/data/cache.py": "d" * 64},
          "start_model": {"config": "e" * 64, "weights": "f" * 64}}
    CheckpointDir(tmp_path / "ck", fp).prepare()
    fake_checkpoint(tmp_path / "ck", 10)
    new = {"cache": "b" * 64, "params": {"lr": 0.002, "seed": 0}, "weights": [1.0, 1.0, 2.0],
           "code": {"codi/data/batching.py": "0" * 64, "codi/data/cache.py": "d" * 64, "codi/infra/files.py": "1" * 64},
           "start_model": {"config": "e" * 64, "weights": "2" * 64}}
    assert CheckpointDir(tmp_path / "ck", new).prepare() is None
    out = capsys.readouterr().out
    assert "the cache (its manifest) changed;" in out
    assert "the code the stage imports changed (codi/data/batching.py modified, codi/infra/files.py added)" in out
    assert "the starting model changed (weights)" in out
    assert "the stage's params changed (lr: 0.001 -> 0.002)" in out
    assert "the loss weights alpha, beta, gamma changed ([1.0, 1.0, 1.0] -> [1.0, 1.0, 2.0])" in out
    assert "a different" not in out


def test_checkpoint_root_outside_and_inside_a_temporary_copy(tmp_path):
    from codi.training.checkpoints import checkpoint_root, dvc_temp_copy_repo

    fp = {"stage": "sft", "params": {"lr": 1.0}}
    assert checkpoint_root(Path("checkpoints/sft"), "sft", fp, cwd=tmp_path) == Path("checkpoints/sft")
    copy = tmp_path / "repo/.dvc/tmp/exps/tmpab12"
    assert dvc_temp_copy_repo(copy) == tmp_path / "repo"
    assert dvc_temp_copy_repo(tmp_path / "repo/.dvc/tmp/exps/standalone/tmp9x") == tmp_path / "repo"  # --temp
    assert dvc_temp_copy_repo(tmp_path / "repo/.dvc/tmp/exps/celery") is None
    root = checkpoint_root(Path("checkpoints/sft"), "sft", fp, cwd=copy)
    assert root.parent == tmp_path / "repo/checkpoints/exps" and root.name.startswith("sft-")
    assert root != checkpoint_root(Path("checkpoints/sft"), "sft", {**fp, "params": {"lr": 2.0}}, cwd=copy)
