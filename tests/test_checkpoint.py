"""Checkpoints: atomic writes survive a crash mid-save, RNG round trips, and a run interrupted and resumed ends
bit-identical to one never stopped (parameters, optimizer state, and every logged loss)."""

from __future__ import annotations

import os
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from pretrain_helpers import Crash, crash_at, eval_losses, fast_config, killed_and_resumed, train_losses

import slimopt
from slimopt.catalog import known_methods
from slimopt.cli import main
from slimopt.optim.distributed import distcheckpoint
from slimopt.train import checkpoint as ckpt
from slimopt.train.loop import train

# ------------------------------------------------------------------------------------------------ atomic writes

def test_save_and_load_weights_only(tmp_path):
    obj = {"w": torch.arange(6.0).reshape(2, 3), "step": 3, "codes": torch.tensor([1, 2], dtype=torch.uint8),
           "nested": {"lr": 0.1, "names": ["a", "b"]}}
    path = ckpt.save_atomic(obj, tmp_path / "checkpoint.pt")
    back = ckpt.load_checkpoint(path)  # weights_only=True inside
    assert torch.equal(back["w"], obj["w"]) and back["codes"].dtype == torch.uint8
    assert back["nested"] == obj["nested"] and back["step"] == 3
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt"]  # no temporary file left behind


def test_crash_between_write_and_replace_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    ckpt.save_atomic({"step": 1, "w": torch.ones(4)}, path)

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.save_atomic({"step": 2, "w": torch.zeros(4)}, path)
    monkeypatch.undo()
    back = ckpt.load_checkpoint(path)
    assert back["step"] == 1 and torch.equal(back["w"], torch.ones(4))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt"]


def test_a_torn_temporary_file_from_a_killed_process_is_ignored(tmp_path):
    path = tmp_path / "checkpoint.pt"
    ckpt.save_atomic({"step": 5}, path)
    (tmp_path / ".checkpoint.pt.abc123.tmp").write_bytes(b"PK\x03\x04 half a zip")  # what a SIGKILL leaves
    assert ckpt.find_checkpoint(tmp_path) == path
    assert ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path))["step"] == 5
    ckpt.save_atomic({"step": 6}, path)  # the next save is unaffected
    assert ckpt.load_checkpoint(path)["step"] == 6


def test_python_objects_are_reported_before_they_break_a_resume():
    class Projector:
        pass

    assert ckpt.check_weights_only_safe({"state": {0: {"exp_avg": torch.zeros(2), "step": 3}}}) is None
    bad = ckpt.check_weights_only_safe({"state": {0: {"projector": Projector()}}}, "optimizer state")
    assert "Projector" in bad and "projector" in bad


def test_rng_state_round_trip():
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    torch.rand(3), random.random(), np.random.rand()
    state = ckpt.rng_state()
    ref = (torch.rand(5), random.random(), np.random.rand(4))
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    ckpt.set_rng_state(ckpt.load_checkpoint(ckpt.save_atomic(state, "/tmp/_slimopt_rng_test.pt")))
    os.unlink("/tmp/_slimopt_rng_test.pt")
    again = (torch.rand(5), random.random(), np.random.rand(4))
    assert torch.equal(ref[0], again[0]) and ref[1] == again[1] and np.array_equal(ref[2], again[2])


# ------------------------------------------------------------------------------------------------ damaged checkpoints

class Projector:
    """What galore-torch keeps in its optimizer state: a Python object (module level, so that it pickles)."""


CLI_RUN = ["--model", "tiny", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8", "--max-steps", "4",
           "--save-every", "2", "--threads", "1", "--no-progress", "--no-save-model", "--eval-every", "0",
           "--eval-tokens", "1024", "--method", "adamw8bit"]


@pytest.fixture(scope="module")
def written(data, tmp_path_factory):
    """A run stopped at its step-2 checkpoint (written by the training loop), to damage copies of."""
    corpus, cache = data
    out = tmp_path_factory.mktemp("written") / "run"
    with pytest.raises(Crash):
        train(fast_config(corpus, cache, method="adamw8bit", max_steps=4, save_every=2, out=str(out)),
              callback=crash_at(3))
    return out


def _damage(path, how):
    whole = path.read_bytes()
    if how == "first half":
        path.write_bytes(whole[: len(whole) // 2])
    elif how == "last bytes cut":
        path.write_bytes(whole[:-10])
    elif how == "garbage":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "overwritten header":
        path.write_bytes(whole[:64] + bytes(b ^ 0xFF for b in whole[64:512]) + whole[512:])


DAMAGE = ["first half", "last bytes cut", "garbage", "empty", "overwritten header"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_checkpoint_is_named_as_damaged_with_what_to_do(written, tmp_path, how):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes((written / "checkpoint.pt").read_bytes())
    assert ckpt.load_checkpoint(path)["step"] == 2
    _damage(path, how)
    with pytest.raises(ckpt.CheckpointError) as caught:
        ckpt.load_checkpoint(path)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError) and "\n" not in message
    assert str(path) in message and "damaged or incomplete" in message
    assert "--overwrite" in message and "copy" in message
    assert "Python objects" not in message and "galore" not in message


def test_a_checkpoint_that_holds_python_objects_says_so(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"optimizer": {"state": {0: {"projector": Projector(), "step": torch.tensor(3.0)}}}}, path)
    with pytest.raises(ckpt.CheckpointError, match="holds Python objects") as caught:
        ckpt.load_checkpoint(path)
    assert "Projector" in str(caught.value) and str(path) in str(caught.value)
    assert "damaged" not in str(caught.value)


def test_a_whole_checkpoint_that_fails_for_another_reason_keeps_torchs_error(tmp_path, monkeypatch):
    # out of memory, an unknown device: the file is fine, so the error must not call it damaged
    path = ckpt.save_atomic({"w": torch.ones(3)}, tmp_path / "checkpoint.pt")

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(ckpt.torch, "load", out_of_memory)
    with pytest.raises(RuntimeError, match="allocate memory") as caught:
        ckpt.load_checkpoint(path)
    assert not isinstance(caught.value, ckpt.CheckpointError)


def test_resume_from_a_cut_short_checkpoint_prints_one_line(data, written, tmp_path, capsys):
    corpus, cache = data
    out = tmp_path / "run"
    out.mkdir()
    for name in os.listdir(written):
        if os.path.isfile(written / name):
            (out / name).write_bytes((written / name).read_bytes())
    _damage(out / "checkpoint.pt", "first half")
    rc = main(["train", *CLI_RUN, "--data", str(corpus), "--cache-dir", str(cache), "--out", str(out), "--resume"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith(f"slimopt train: error: checkpoint {out / 'checkpoint.pt'} is damaged or incomplete")
    assert "--overwrite" in err


@pytest.mark.parametrize("how", ["metadata cut", "metadata empty", "shard cut", "shard missing", "no metadata"])
def test_a_damaged_dcp_folder_is_named_as_damaged_before_loading(tmp_path, how):
    def made():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 64))
        return model, slimopt.SlimOptimizer(model.parameters(), lr=1e-2, state_bits=8)

    model, opt = made()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    folder = tmp_path / "checkpoint"
    distcheckpoint.save(folder, model, opt)
    shard = next(folder.glob("*.distcp"))
    if how == "metadata cut":
        _damage(folder / ".metadata", "first half")
    elif how == "metadata empty":
        _damage(folder / ".metadata", "empty")
    elif how == "shard cut":
        _damage(shard, "first half")
    elif how == "shard missing":
        shard.unlink()
    else:
        (folder / ".metadata").unlink()
    fresh, fresh_opt = made()
    with pytest.raises(ValueError) as caught:
        distcheckpoint.load(folder, fresh, fresh_opt)
    message = str(caught.value)
    assert str(folder) in message and "damaged or incomplete" in message and "--overwrite" in message
    assert "\n" not in message
    assert not fresh_opt.state or all(int(st["step"]) == 0 for st in fresh_opt.state.values())  # nothing loaded


@pytest.fixture(scope="module")
def written_fsdp(data, tmp_path_factory):
    """A one-process `--fsdp` run stopped at its step-2 checkpoint folder (DCP shards, train_state.pt, RNG)."""
    corpus, cache = data
    out = tmp_path_factory.mktemp("written_fsdp") / "run"
    with pytest.raises(Crash):
        train(fast_config(corpus, cache, method="adamw8bit", max_steps=4, save_every=2, out=str(out), fsdp=True),
              callback=crash_at(3))
    return out


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _copy(files, out):
    for relative, content in files.items():
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        (out / relative).write_bytes(content)


def test_fsdp_resume_from_a_whole_copy_finishes_the_run(data, written_fsdp, tmp_path):
    # the copy the damage tests start from resumes: what they refuse is the damage alone
    corpus, cache = data
    out = tmp_path / "run"
    _copy(_files(written_fsdp), out)
    res = train(fast_config(corpus, cache, method="adamw8bit", max_steps=4, save_every=2, out=str(out), fsdp=True,
                            resume=True))
    assert res["steps"] == 4 and [s for s, _ in train_losses(out)] == [1, 2, 3, 4]


@pytest.mark.parametrize("name", ["train_state.pt", "rng_rank0.pt"])
def test_fsdp_resume_from_a_cut_short_file_prints_one_line_and_changes_nothing(data, written_fsdp, tmp_path, capsys,
                                                                              name):
    corpus, cache = data
    out = tmp_path / "run"
    _copy(_files(written_fsdp), out)
    damaged = out / "checkpoint.dcp" / name
    _damage(damaged, "first half")
    before = _files(out)
    rc = main(["train", "--fsdp", *CLI_RUN, "--data", str(corpus), "--cache-dir", str(cache), "--out", str(out),
               "--resume"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith(f"slimopt train: error: checkpoint {damaged} is damaged or incomplete")
    assert "--overwrite" in err and "copy" in err
    assert _files(out) == before  # the log, the checkpoint and the damaged file itself are as they were


# ------------------------------------------------------------------------------------------------ exact resume



def _assert_same_checkpoint(a, b):
    ca, cb = ckpt.load_checkpoint(a / "checkpoint.pt"), ckpt.load_checkpoint(b / "checkpoint.pt")
    assert ca["step"] == cb["step"] and ca["tokens"] == cb["tokens"]
    assert ca["model"].keys() == cb["model"].keys()
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k, v in sa[i].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, sb[i][k]), (i, k)
            else:
                assert v == sb[i][k], (i, k)
    assert ca["scheduler"] == cb["scheduler"] and ca["sampler"] == cb["sampler"]


RESUME_CASES = {
    "adamw": {},
    "galore": {"update_gap": 3},            # crosses subspace refreshes on both sides of the interruption
    "frugal": {"update_gap": 3},            # random block choice must continue the same way
    "adamw8bit": {},                        # uint8 codes and fp32 scales survive the round trip
    "relora": {"restart_every": 4, "restart_warmup": 1},
}


@pytest.mark.parametrize("method", list(RESUME_CASES))
def test_interrupted_and_resumed_equals_uninterrupted(data, tmp_path, method):
    if method not in known_methods():
        pytest.skip(f"{method} not available")
    corpus, cache = data
    cfg = fast_config(corpus, cache, method=method, opt=RESUME_CASES[method], max_steps=10, save_every=3,
                      eval_every=4)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    ref = train(replace(cfg, out=str(whole)))

    with pytest.raises(Crash):
        train(replace(cfg, out=str(broken)), callback=crash_at(5))  # last checkpoint: step 3
    assert ckpt.load_checkpoint(broken / "checkpoint.pt")["step"] == 3
    res = train(replace(cfg, out=str(broken), resume=True))

    _assert_same_checkpoint(whole, broken)
    assert train_losses(whole) == train_losses(broken)  # exact floats, steps 1..10, no duplicates
    assert [s for s, _ in train_losses(broken)] == list(range(1, 11))
    assert eval_losses(whole) == eval_losses(broken)
    assert res["val_loss"] == ref["val_loss"]


def test_resume_with_changed_settings_is_refused(data, tmp_path):
    corpus, cache = data
    out = tmp_path / "run"
    cfg = fast_config(corpus, cache, max_steps=4, save_every=2, out=str(out))
    with pytest.raises(Crash):
        train(cfg, callback=crash_at(3))
    with pytest.raises(ValueError, match="batch_size"):
        train(replace(cfg, batch_size=16, resume=True))


def test_resume_without_a_checkpoint_starts_fresh_and_a_finished_run_stays_finished(data, tmp_path):
    corpus, cache = data
    out = tmp_path / "run"
    cfg = fast_config(corpus, cache, max_steps=3, out=str(out), resume=True)
    first = train(cfg)
    assert first["steps"] == 3
    again = train(cfg)  # resumes at the final checkpoint: no further step, the same model
    assert again["steps"] == 3 and again["val_loss"] == first["val_loss"]
    assert [s for s, _ in train_losses(out)] == [1, 2, 3]


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume(data, tmp_path):
    """A real kill -9 of `slimopt train` mid-run; the resumed run must match an unbroken one."""
    corpus, cache = data
    args = ["--model", "tiny", "--data", str(corpus), "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8",
            "--max-steps", "40", "--save-every", "2", "--method", "frugal", "--update-gap", "3", "--threads", "1",
            "--cache-dir", str(cache), "--no-progress", "--no-save-model", "--eval-every", "0", "--eval-tokens",
            "1024"]
    whole, broken = killed_and_resumed(args, tmp_path)
    _assert_same_checkpoint(whole, broken)
    assert train_losses(whole) == train_losses(broken)
