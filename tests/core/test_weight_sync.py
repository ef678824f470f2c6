"""Weight sync (posttrain.core.generation.weights) on forked gloo ranks: a trainer under FSDP (2 ranks) sends
its weights to a generator process after an optimizer step, full and LoRA-only, and the
generator's tensors equal the gathered trainer's bit for bit, its greedy tokens the trainer's
model's; a tensor-parallel generator (2 ranks) keeps its slices of what a single-process trainer
sends; versions advance; a mismatched model is refused by name; the staleness policy."""

from __future__ import annotations

import os

import pytest
import torch

from tests.core.parallel._dist import model_args, reference_model, run_ranks

LORA = dict(rank=4, alpha=8.0, targets="all-linear")


def _fsdp_trainer_to_generator(lora: bool, transport: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from posttrain.core.generation.weights import WeightPublisher, WeightSubscriber, sync_group
    from posttrain.core.model.generate import SamplingParams, generate
    from posttrain.core.parallel.checkpoint import full_state_dict

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args = model_args("debug")
    model = reference_model(args, seed=0, lora=LORA if lora else None)
    group = sync_group(0, [2])
    mesh = DeviceMesh("cpu", torch.tensor([0, 1]))  # the trainer's FSDP mesh (every rank builds it)
    out: dict = {}
    if rank < 2:  # trainer: FSDP over ranks 0 and 1, one optimizer step on its own batch
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ids = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(rank))
        model(ids).float().logsumexp(-1).mean().backward()
        opt.step()
        pub = WeightPublisher(model, group, lora_only=lora, bucket_mb=0.004, transport=transport)  # several buckets
        stats = [pub.publish(), pub.publish()]
        pub.close()
        ring_removed = pub.ring is None or not any(os.path.exists(p) for p in pub.ring.paths)
        whole = {k: v for k, v in (full_state_dict(model) or {}).items()}  # after: rank 0 only
        dist.barrier(group=dist.new_group([0, 1]))
        if rank == 0:
            out = {"stats": [(s.version, s.bytes, s.buckets, s.transport) for s in stats], "state": _numpy(whole),
                   "ring_removed": ring_removed,
                   "tokens": [g.tokens for g in generate(_plain(model, whole, args, lora), [[3, 4, 5], [9]],
                                                         SamplingParams(max_new_tokens=6, temperature=0))]}
    else:  # generator: the starting model (an old copy), brought up to date by the syncs
        dist.new_group([0, 1])
        sub = WeightSubscriber(model, group, source=0)
        versions = [sub.receive(), sub.receive(), sub.receive()]
        out = {"versions": versions, "state": _numpy(model.state_dict()), "transport": sub.transport,
               "tokens": [g.tokens for g in generate(model, [[3, 4, 5], [9]],
                                                     SamplingParams(max_new_tokens=6, temperature=0))]}
    return out


def _numpy(state: dict) -> dict:
    """Tensors as numpy arrays (tensors through the result queue would be shared by a file
    descriptor of a process that has exited)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def _plain(model, whole: dict, args, lora: bool):
    """A one-process model holding the gathered state (to decode with)."""
    plain = reference_model(args, seed=0, lora=LORA if lora else None)
    plain.load_state_dict(whole)
    return plain


@pytest.mark.parametrize("lora,transport", [(False, "auto"), (True, "auto"), (False, "dist")],
                         ids=["full-shm", "lora_only-shm", "full-gloo"])
@pytest.mark.slow
def test_fsdp_trainer_syncs_a_generator_exactly(lora, transport):
    """"auto" on one host takes the shared-memory ring (2 slots, more buckets than slots: slots are
    reused, each only after the generator acknowledged it); "dist" broadcasts over gloo."""
    trainer, _, generator = run_ranks(_fsdp_trainer_to_generator, 3, lora, transport)
    assert generator["versions"] == [1, 2, None]
    (v1, bytes1, buckets, t1), (v2, bytes2, _, _) = trainer["stats"]
    assert (v1, v2) == (1, 2) and bytes1 == bytes2 > 0 and buckets > 2
    want_transport = "shm" if transport == "auto" else "dist"
    assert t1 == generator["transport"] == want_transport and trainer["ring_removed"]
    want, got = trainer["state"], generator["state"]
    assert want.keys() == got.keys()
    assert [k for k in want if not (want[k] == got[k]).all()] == []
    assert generator["tokens"] == trainer["tokens"]
    if lora:  # only the adapters moved: the bytes are theirs (fp32)
        adapters = sum(v.size * 4 for k, v in want.items() if "lora_" in k)
        assert bytes1 == adapters


def _trainer_to_tp_generator() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain.core.generation.weights import WeightPublisher, WeightSubscriber, sync_group
    from posttrain.core.model.generate import SamplingParams, generate
    from posttrain.core.parallel.plans import apply_plan, transformer_tp_plan

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args = model_args("debug")
    model = reference_model(args, seed=0)
    group = sync_group(0, [1, 2])
    tp = DeviceMesh("cpu", torch.tensor([1, 2]))
    prompts, params = [[3, 4, 5], [9, 10]], SamplingParams(max_new_tokens=6, temperature=0)
    if rank == 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)  # what training changed
        WeightPublisher(model, group).publish(7)
        return {"tokens": [g.tokens for g in generate(model, prompts, params)]}
    apply_plan(model, transformer_tp_plan(args, sequence_parallel=False), tp)  # each rank its slices
    sub = WeightSubscriber(model, group, source=0)
    version = sub.receive()
    return {"version": version, "transport": sub.transport, "tokens": [g.tokens for g in generate(model, prompts, params)]}


@pytest.mark.slow
def test_a_tensor_parallel_generator_keeps_its_slices():
    trainer, *generators = run_ranks(_trainer_to_tp_generator, 3)
    for g in generators:  # both read their slices out of the same shared-memory slots
        assert g["version"] == 7 and g["transport"] == "shm" and g["tokens"] == trainer["tokens"]


def _mismatch() -> str:
    import torch.distributed as dist

    from posttrain.core.generation.weights import WeightPublisher, WeightSubscriber, sync_group

    dist.init_process_group("gloo")
    group = sync_group(0, [1])
    if dist.get_rank() == 0:
        WeightPublisher(reference_model(model_args("debug")), group)
        return ""
    try:
        WeightSubscriber(reference_model(model_args("debug", intermediate_size=96)), group)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_a_generator_of_another_shape_is_refused_by_name():
    _, message = run_ranks(_mismatch, 2)
    assert message.startswith("weight sync: the trainer sends layers.0.mlp.gate_proj.weight (") and "96" in message


def _shm_refused() -> str:
    import torch.distributed as dist

    import posttrain.core.generation.weights as weights

    dist.init_process_group("gloo")
    group = weights.sync_group(0, [1])
    if dist.get_rank() == 0:
        try:
            weights.WeightPublisher(reference_model(model_args("debug")), group, transport="shm")
        except ValueError as e:
            return str(e)
        return "no error"
    weights._open_slots = lambda offer: None  # a generator on another host: the slots' files are not there
    assert weights.WeightSubscriber(reference_model(model_args("debug")), group).transport == "dist"
    return ""


@pytest.mark.slow
def test_shm_transport_refuses_a_generator_that_cannot_open_the_slots():
    message, _ = run_ranks(_shm_refused, 2)
    assert message.startswith("weight sync transport='shm': a generator of this group cannot open the shared-memory")


def test_default_buckets_split_a_lora_sync_in_about_four():
    """Default bucket sizes: 64 MiB for a full sync; a LoRA-only sync cut in about four buckets (at
    least 1 MiB each), so the generators copy one out while the source packs the next."""
    from posttrain.core.generation.weights import WeightPublisher
    from posttrain.core.model.args import ModelArgs

    args = ModelArgs(vocab_size=256, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=512)
    model = reference_model(args, seed=0, lora=dict(rank=64, alpha=8.0, targets="all-linear"))  # 4.7 MB of adapters
    lora = WeightPublisher(model, None, lora_only=True)
    assert 4 <= len(lora.buckets) <= 5 and lora.bucket_bytes == -(-sum(lora.nbytes) // 4)
    full = WeightPublisher(model, None)
    assert full.bucket_bytes == 64 * 2**20 and len(full.buckets) == 1
    tiny = WeightPublisher(reference_model(args, seed=0, lora=LORA), None, lora_only=True)
    assert tiny.bucket_bytes == 2**20 and len(tiny.buckets) == 1


def test_staleness_policy():
    from posttrain.core.generation.weights import Staleness

    strict, keep2, soft = Staleness(max_behind=0), Staleness(max_behind=2), Staleness(1, "reweight", 0.5)
    assert strict.weight(5, 5) == 1.0 and strict.weight(4, 5) is None
    assert keep2.weight(3, 5) == 1.0 and keep2.weight(2, 5) is None
    assert soft.weight(4, 5) == 1.0 and soft.weight(3, 5) == 0.5 and soft.weight(1, 5) == 0.125
    with pytest.raises(ValueError, match="newer than the weights"):
        strict.weight(6, 5)
    with pytest.raises(ValueError, match="max_behind >= 0"):
        Staleness(policy="keep")


@pytest.mark.slow
def test_the_benchmark_reports_both_modes_against_the_floor(tmp_path):
    """posttrain.benchmarks.weight_sync at its smallest: the JSON it promises (figures never compared)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "sync.json"
    proc = subprocess.run([sys.executable, "-m", "posttrain.flows.cli", "bench", "weight_sync", "--models", "debug", "--reps",
                           "1", "--out", str(out)], cwd=root, env=os.environ,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = json.loads(out.read_text())["models"]["debug"]
    for transport in ("shm", "gloo"):
        m = model[transport]
        assert m["lora_only"]["bytes"] < m["full"]["bytes"] and m["full"]["bytes"] >= 4 * model["parameters"] * 0.99
        for mode in ("full", "lora_only"):
            assert m[mode]["sync_s"] > 0 and m[mode]["floor_s"] > 0
            assert m[mode]["ratio_to_floor"] == m[mode]["sync_s"] / m[mode]["floor_s"]
        assert m["lora_share"] == m["lora_only"]["sync_s"] / m["full"]["sync_s"]
