"""posttrain.core.checkpoint: exact resume, atomic saves under failure, verified loads, keep-last, async, DCP
across processes (FSDP2 on gloo, resharded to one process)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import posttrain.core.checkpoint as ckpt
import posttrain.core.checkpoint.state as ckpt_state
import posttrain.core.checkpoint.writer as ckpt_writer
from posttrain.core.checkpoint import CheckpointError, CheckpointManager
from posttrain.core.manifest import file_sha256
from posttrain.core.model import build_model, get_preset

VOCAB = get_preset("debug").vocab_size


class Sampler:
    """A stand-in data sampler: Stateful, with a position that advances per batch."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = sd["position"]


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(get_preset("debug"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def train_step(model, opt, sched, sampler: Sampler) -> torch.Tensor:
    # Data comes from all three RNGs, so resume must restore every one of them.
    T = 8 + random.randrange(8)
    x = (torch.randint(0, VOCAB, (2, T)) + int(np.random.randint(VOCAB))) % VOCAB
    sampler.position += x.numel()
    loss = F.cross_entropy(model(x)[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_exact_resume(tmp_path):
    model, opt, sched = make()
    sampler = Sampler()
    seed_all(1)
    ref_losses = [train_step(model, opt, sched, sampler) for _ in range(6)]
    ref = params(model)

    model, opt, sched = make()
    sampler = Sampler()
    seed_all(1)
    for _ in range(3):
        train_step(model, opt, sched, sampler)
    mgr = CheckpointManager(tmp_path, interval_steps=3)
    assert mgr.maybe_save(2, model, opt, sched) is False  # not on the interval
    assert mgr.maybe_save(3, model, opt, sched, extra={"sampler": sampler, "tokens_seen": sampler.position})
    pos_at_save = sampler.position

    # A fresh process: other init, other RNG state; everything must come from the checkpoint.
    model, opt, sched = make(seed=123)
    sampler = Sampler()
    seed_all(99)
    state = CheckpointManager(tmp_path).load_latest(model, opt, sched, extra={"sampler": sampler}, required=True)
    assert state["step"] == 3 and state["tokens_seen"] == pos_at_save == sampler.position
    assert sched.last_epoch == 3
    losses = [train_step(model, opt, sched, sampler) for _ in range(3)]
    assert [l.item() for l in losses] == [l.item() for l in ref_losses[3:]]
    assert_same(params(model), ref)


def test_layout_and_manifest(tmp_path):
    model, opt, sched = make()
    mgr = CheckpointManager(tmp_path, config={"lr": 0.01})
    assert mgr.save(5, model, opt, sched)
    assert mgr.save(5, model, opt, sched) is False  # already saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000005"]
    assert (tmp_path / "latest").read_text().strip() == "step-000005"
    step_dir = tmp_path / "step-000005"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["world_size"] == 1 and manifest["config_hash"]
    on_disk = {p.name for p in step_dir.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and {".metadata", "common.json", "rank-00000.json"} <= on_disk
    for name, meta in manifest["files"].items():
        assert (step_dir / name).stat().st_size == meta["size"]
    # Only tensors go through DCP; the rest is plain JSON.
    md = ckpt.read_metadata(step_dir)
    assert all(k.startswith(("model.", "optim.")) for k in md.state_dict_metadata)
    assert json.loads((step_dir / "common.json").read_text())["scheduler"]["last_epoch"] == 0
    assert mgr.list_complete() == [5] and mgr.latest_step() == 5


class _FullDiskWriter(ckpt_writer.FileSystemWriter):
    """Writes the shards, then fails before DCP's metadata lands: a save dying midway."""

    def finish(self, metadata, results):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("where", ["shards", "manifest"])
@pytest.mark.parametrize("mode", ["fail", "continue"])
def test_failed_save_leaves_previous_intact(tmp_path, monkeypatch, caplog, where, mode):
    model, opt, sched = make()
    mgr = CheckpointManager(tmp_path, on_save_error=mode)
    mgr.save(1, model, opt, sched, extra={"tokens_seen": 1})
    saved = params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    if where == "shards":
        monkeypatch.setattr(ckpt_writer, "FileSystemWriter", _FullDiskWriter)
    else:
        real_write_json = ckpt_writer._write_json

        def failing(path, obj):
            if Path(path).name == "manifest.json":
                raise OSError(28, "No space left on device")
            real_write_json(path, obj)
        monkeypatch.setattr(ckpt_writer, "_write_json", failing)

    if mode == "fail":
        with pytest.raises(CheckpointError, match="No space left on device"):
            mgr.save(2, model, opt, sched)
    else:
        with caplog.at_level(logging.WARNING, logger="posttrain.core.checkpoint"):
            assert mgr.save(2, model, opt, sched) is False
        assert "No space left on device" in caplog.text and mgr.save_failures == 1

    # Nothing partial under a final name, no tmp dir left, `latest` still the previous save.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]
    assert (tmp_path / "latest").read_text().strip() == "step-000001"
    if mode == "continue":  # training goes on and the next save works
        monkeypatch.undo()
        assert mgr.save(3, model, opt, sched)
        assert mgr.list_complete() == [1, 3]
    else:
        fresh, fopt, fsched = make(seed=7)
        assert CheckpointManager(tmp_path).load_latest(fresh, fopt, fsched)["step"] == 1
        assert_same(params(fresh), saved)


def _shard(d: Path) -> Path:
    return next(d.glob("*.distcp"))


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped byte": (_flip, "sha256 mismatch"),
    "deleted shard": (lambda p: p.unlink(), "missing"),
    "truncated": (lambda p: os.truncate(p, p.stat().st_size // 2), "bytes, manifest says"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_checkpoint_falls_back_and_reports(tmp_path, caplog, kind):
    corrupt, reason = CORRUPTIONS[kind]
    model, opt, sched = make()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model, opt, sched, extra={"tokens_seen": 10})
    at_step_1 = params(model)
    train_step(model, opt, sched, Sampler())
    mgr.save(2, model, opt, sched, extra={"tokens_seen": 20})
    corrupt(_shard(tmp_path / "step-000002"))

    fresh, fopt, fsched = make(seed=3)
    with caplog.at_level(logging.WARNING, logger="posttrain.core.checkpoint"):
        state = CheckpointManager(tmp_path).load_latest(fresh, fopt, fsched)
    assert state["step"] == 1 and state["tokens_seen"] == 10
    (skipped_step, why), = state["load_report"].skipped
    assert skipped_step == 2 and reason in why
    assert "step-000002 is unusable" in caplog.text
    assert_same(params(fresh), at_step_1)


def test_missing_manifest_and_nothing_usable(tmp_path):
    model, opt, sched = make()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model, opt, sched)
    (tmp_path / "step-000001" / "manifest.json").unlink()
    assert mgr.load_latest(model, opt, sched) is None
    assert mgr.last_report.skipped == [(1, "manifest.json missing")]
    with pytest.raises(CheckpointError, match="no usable checkpoint.*manifest.json missing"):
        mgr.load_latest(model, opt, sched, required=True)
    with pytest.raises(CheckpointError, match="none saved"):
        CheckpointManager(tmp_path / "empty").load_latest(model, required=True)


def test_keep_last(tmp_path):
    model, opt, sched = make()
    stale = tmp_path / ".tmp-step-000009-deadbeef"  # a save killed by a crash
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"partial")
    mgr = CheckpointManager(tmp_path, keep_last=2)
    assert mgr.list_complete() == [] and mgr.load_latest(model) is None and stale.exists()
    for step in range(1, 5):
        mgr.save(step, model, opt, sched)
    assert mgr.list_complete() == [3, 4] and mgr.latest_step() == 4
    assert not stale.exists()
    # Resumed from 3 and saving 4 again replaces it, keeping 3 (the last good one before it).
    mgr.load(3, model, opt, sched)
    mgr.save(4, model, opt, sched, extra={"again": True})
    assert mgr.list_complete() == [3, 4]
    assert mgr.load_latest(model, opt, sched)["again"] is True
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_latest_is_the_commit_point(tmp_path):
    """A crash between renaming step-2 into place and updating `latest`: step 1 is what resumes."""
    model, opt, sched = make()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model, opt, sched, extra={"n": 1})
    mgr.save(2, model, opt, sched, extra={"n": 2})
    (tmp_path / "latest").write_text("step-000001\n")
    assert mgr.latest_step() == 1 and mgr.load_latest(model, opt, sched)["n"] == 1
    assert mgr.load(2, model, opt, sched)["n"] == 2  # still loadable by name
    (tmp_path / "latest").unlink()  # no pointer at all: the newest that verifies
    assert mgr.latest_step() == 2 and mgr.load_latest(model, opt, sched)["n"] == 2


class _GatedWriter(ckpt_writer.FileSystemWriter):
    gate = threading.Event()

    def write_data(self, plan, planner):
        assert self.gate.wait(timeout=30)
        return super().write_data(plan, planner)


def test_async_save_matches_sync(tmp_path, monkeypatch):
    model, opt, sched = make()
    train_step(model, opt, sched, Sampler())
    snapshot = params(model)
    CheckpointManager(tmp_path / "sync").save(1, model, opt, sched, extra={"n": 1})

    _GatedWriter.gate.clear()
    monkeypatch.setattr(ckpt_writer, "FileSystemWriter", _GatedWriter)
    amgr = CheckpointManager(tmp_path / "async", async_save=True)
    assert amgr.save(1, model, opt, sched, extra={"n": 1})
    with torch.no_grad():  # training goes on while the writer is blocked: the save is a snapshot
        for p in model.parameters():
            p.add_(1.0)
    assert amgr.list_complete() == [] and amgr.latest_step() is None  # renamed only when done
    _GatedWriter.gate.set()
    assert amgr.wait()
    amgr.close()
    assert amgr.list_complete() == [1] and amgr.latest_step() == 1

    loaded = {}
    for kind in ("sync", "async"):
        m, o, s = make(seed=5)
        assert CheckpointManager(tmp_path / kind).load_latest(m, o, s)["n"] == 1
        loaded[kind] = (params(m), o.state_dict())
    assert_same(loaded["async"][0], snapshot)
    assert_same(loaded["sync"][0], loaded["async"][0])
    sync_opt, async_opt = loaded["sync"][1], loaded["async"][1]
    assert sync_opt["param_groups"] == async_opt["param_groups"]
    for i, st in sync_opt["state"].items():
        assert_same(st, async_opt["state"][i])
    files = [json.loads((tmp_path / k / "step-000001" / "manifest.json").read_text())["files"] for k in ("sync", "async")]
    assert files[0].keys() == files[1].keys()


def test_async_failure_surfaces_at_wait(tmp_path, monkeypatch):
    model, opt, sched = make()
    monkeypatch.setattr(ckpt_writer, "FileSystemWriter", _FullDiskWriter)
    mgr = CheckpointManager(tmp_path, async_save=True)
    assert mgr.save(1, model, opt, sched)  # handed to the writer thread
    with pytest.raises(CheckpointError, match="No space left on device"):
        mgr.wait()
    assert mgr.list_complete() == [] and not (tmp_path / "latest").exists()
    mgr.close()


def test_trainable_only(tmp_path):
    model, _, _ = make()
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("norm.weight"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mgr = CheckpointManager(tmp_path, trainable_only=True)
    mgr.save(1, model, opt)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    saved = {k[len("model."):] for k in ckpt.read_metadata(tmp_path / "step-000001").state_dict_metadata
             if k.startswith("model.")}
    assert saved == trainable

    fresh, _, _ = make(seed=11)
    for name, p in fresh.named_parameters():
        p.requires_grad_(name in trainable)
    before = params(fresh)
    fopt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    mgr.load_latest(fresh, fopt, required=True)
    for name, value in params(fresh).items():
        expected = model.state_dict()[name] if name in trainable else before[name]
        assert torch.equal(value, expected), name


def test_trainable_only_leaves_out_the_nf4_base(tmp_path):
    """A QLoRA checkpoint holds the adapters, not the NF4 base (loaded again from the base
    model on resume): half a byte per base weight less in every checkpoint."""
    from posttrain.core.lora import apply_lora

    model, _, _ = make()
    apply_lora(model, rank=4, alpha=8, targets="all-linear", quantize_base="nf4", double_quant=True)
    assert any(k.endswith(".weight.packed") for k in model.state_dict())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    CheckpointManager(tmp_path, trainable_only=True).save(1, model, opt)
    saved = {k[len("model."):] for k in ckpt.read_metadata(tmp_path / "step-000001").state_dict_metadata
             if k.startswith("model.")}
    assert saved == {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any("packed" in k or "absmax" in k for k in saved)


def test_json_codec_round_trips_types():
    value = {"bf16": torch.randn(3, 2).to(torch.bfloat16), "empty": torch.zeros(0, 4), "flag": torch.tensor(True),
             "tup": (1, 2.5, None), "by_int": {0: "a", 7: [1, 2]}, "arr": np.arange(5, dtype=np.uint32),
             "nan": float("nan"), "dunder": {"__tensor__": 1}}
    back = ckpt_state.decode(json.loads(json.dumps(ckpt_state.encode(value, "v"))))
    for k in ("bf16", "empty", "flag"):
        assert back[k].dtype == value[k].dtype and torch.equal(back[k], value[k])
    assert back["tup"] == (1, 2.5, None) and back["by_int"] == {0: "a", 7: [1, 2]}
    assert back["arr"].dtype == np.uint32 and (back["arr"] == value["arr"]).all()
    assert back["nan"] != back["nan"] and back["dunder"] == {"__tensor__": 1}


def test_no_pickle_anywhere(tmp_path):
    model, opt, _ = make()
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"extra\.fn: function is neither JSON-able nor a tensor"):
        mgr.save(1, model, opt, extra={"fn": lambda: 0})
    mgr.save(1, model, opt)

    # A .metadata that would run code when unpickled, with the manifest rewritten to match.
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    step_dir = tmp_path / "step-000001"
    (step_dir / ".metadata").write_bytes(pickle.dumps(Evil()))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"size": (step_dir / ".metadata").stat().st_size,
                                      "sha256": file_sha256(step_dir / ".metadata")}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    assert mgr.load_latest(model, opt) is None
    assert "posix.system is not allowed" in mgr.last_report.skipped[0][1] or \
        "os.system is not allowed" in mgr.last_report.skipped[0][1]
    assert not marker.exists()


# ---------------------------------------------------------------------------------- two processes

def _two_rank_worker(rank: int, world: int, init_file: str, ckpt_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from posttrain.core.parallel import full_state_dict

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = build_model(get_preset("debug"))
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))
        F.cross_entropy(model(x).reshape(-1, VOCAB), x.reshape(-1)).backward()
        opt.step()
        mgr = CheckpointManager(ckpt_dir)
        mgr.save(1, model, opt, extra={"rank": rank})
        full = full_state_dict(model)  # the unsharded weights, on rank 0
        if rank == 0:
            torch.save(full, Path(ckpt_dir) / "full.pt")
        # Back into a fresh sharded model on the same two ranks.
        torch.manual_seed(1)
        fresh = build_model(get_preset("debug"))
        for layer in fresh.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(fresh, mesh=mesh)
        state = mgr.load_latest(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), required=True)
        assert state["rank"] == rank
        for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
            assert torch.equal(a.to_local(), b.to_local()), name
        mgr.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_fsdp2_save_then_reshard_to_one_process(tmp_path):
    import torch.multiprocessing as mp

    ckpt_dir = tmp_path / "ckpt"
    mp.spawn(_two_rank_worker, args=(2, str(tmp_path / "init"), str(ckpt_dir)), nprocs=2)
    manifest = json.loads((ckpt_dir / "step-000001" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", "rank-00000.json", "rank-00001.json"} <= set(manifest["files"])

    # One process, no process group, a plain model: DCP reassembles the two shards.
    full = torch.load(ckpt_dir / "full.pt", weights_only=True)
    model, opt, _ = make(seed=9)  # its LambdaLR put `initial_lr` into the param groups
    with pytest.raises(CheckpointError, match="initial_lr"):
        CheckpointManager(ckpt_dir).load_latest(model, opt, required=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = CheckpointManager(ckpt_dir).load_latest(model, opt, required=True)
    assert state["rank"] == 0  # trainer state of rank 0 when the world size changes
    assert_same(params(model), full)
    assert all(len(s) == 3 for s in opt.state.values())  # step, exp_avg, exp_avg_sq restored
