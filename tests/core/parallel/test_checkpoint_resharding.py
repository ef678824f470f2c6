"""Checkpoints across layouts on 2 ranks: DCP save under one layout, load under another (tp=2 <->
FSDP=2, ep=2 -> tp=2, pp=2 -> FSDP=2), each load compared with the saved weights; and the full
state dict / HF export gathered on rank 0.

The layouts' state dicts (DTensor pieces under the model's own names) are what core/checkpoint
hands to DCP; the round trips here use DCP directly, so that pipeline stages take part too."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.losses import cross_entropy
from posttrain.core.model import build_model
from posttrain.core.parallel import parallelize, parallelize_pipeline
from posttrain.core.parallel.checkpoint import full_state_dict
from posttrain.core.parallel.mesh import ParallelDims, ParallelMesh
from tests.core.parallel._dist import clone, model_args, param_diff, reference_model, run_ranks, setup

TOL = 0.0  # a checkpoint round trip moves bytes, it does no arithmetic


def _modules(model: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _pieces(model: nn.Module | Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's pieces of the model (or of its pipeline stages), keyed by the model's names."""
    return {k: v for m in _modules(model) for k, v in get_model_state_dict(m).items()}


def save_sharded(model: nn.Module | Iterable[nn.Module], path: str) -> None:
    dcp.save(_pieces(model), checkpoint_id=path)  # collective: every rank writes its pieces


def load_sharded(model: nn.Module | Iterable[nn.Module], path: str) -> None:
    """Fill the model in place with the pieces its layout asks for, whatever layout saved them."""
    state = _pieces(model)
    dcp.load(state, checkpoint_id=path)
    for m in _modules(model):
        set_model_state_dict(m, {k: state[k] for k in get_model_state_dict(m)})


def _mesh(**fields):
    cfg = ParallelConfig(**fields)
    return cfg, ParallelMesh(ParallelDims.from_config(cfg, 2), "cpu")


def _roundtrips(tmp: str) -> dict[str, float]:
    setup(2, tp=2)
    out = {}
    cases = [  # (name, preset, save layout, load layout)
        ("tp2->fsdp2", "debug", dict(tp=2), dict(dp_shard=2)),
        ("fsdp2->tp2", "debug", dict(dp_shard=2), dict(tp=2)),
        ("ep2->tp2", "debug-moe", dict(dp_shard=2, ep=2), dict(tp=2, sequence_parallel=False)),
        ("ddp->ep2", "debug-moe", dict(dp_replicate=2, dp_shard=1), dict(dp_shard=2, ep=2)),
    ]
    for name, preset, src, dst in cases:
        args = model_args(preset)
        ref = reference_model(args, seed=0)
        cfg, mesh = _mesh(**src)
        saved = parallelize(clone(ref), cfg, mesh)
        save_sharded(saved, f"{tmp}/{name}")
        cfg, mesh = _mesh(**dst)
        loaded = parallelize(build_model(args, seed=1), cfg, mesh)  # other weights, other layout
        assert param_diff(ref, loaded) > 1e-3
        load_sharded(loaded, f"{tmp}/{name}")
        out[name] = param_diff(ref, loaded)
        full = full_state_dict(loaded)
        if full is not None:
            out[f"{name}/full_state_dict"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
            assert full.keys() == ref.state_dict().keys()

    # pipeline stages (untied model) -> FSDP, and the stages' full state dict meeting on rank 0
    args = model_args("debug", num_layers=4, tie_embeddings=False)
    ref = reference_model(args)
    cfg, mesh = _mesh(pp=2, pp_schedule="gpipe")
    pipe = parallelize_pipeline(clone(ref), cfg, mesh, cross_entropy, torch.device("cpu"), microbatch_size=1,
                                seq_len=8)
    save_sharded(pipe.modules, f"{tmp}/pp2")
    full = full_state_dict(pipe.modules, mesh.group("pp"))
    if full is not None:
        assert full.keys() == ref.state_dict().keys()
        out["pp2/full_state_dict"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    cfg, mesh = _mesh(dp_shard=2)
    loaded = parallelize(build_model(args, seed=1), cfg, mesh)
    load_sharded(loaded, f"{tmp}/pp2")
    out["pp2->fsdp2"] = param_diff(ref, loaded)

    # HF export of a tp=2 LoRA model, as the stages do it: gather (LoRA layers included) into a
    # plain copy on rank 0, then write the merged state dict
    from posttrain.core.lora import merge_lora, merged_state_dict
    from posttrain.registry.hf import load_pretrained, save_pretrained

    args = model_args("debug")
    lora = dict(rank=4, alpha=8.0, targets="all-linear")
    ref = reference_model(args, lora=lora)
    cfg, mesh = _mesh(tp=2)
    par = parallelize(clone(ref), cfg, mesh)
    state = full_state_dict(par)
    if state is not None:
        gathered = reference_model(args, seed=3, lora=lora)  # other weights, every one overwritten
        gathered.load_state_dict(state)
        path = save_pretrained(gathered, f"{tmp}/hf", state=merged_state_dict(gathered))
        merge_lora(ref)
        back = load_pretrained(path)
        ref_sd = ref.state_dict()
        out["hf_export_lora_merged"] = max((t - ref_sd[k]).abs().max().item() for k, t in back.state_dict().items())
    return out


@pytest.mark.slow
def test_checkpoints_reshard_across_layouts(tmp_path):
    res = run_ranks(_roundtrips, 2, str(tmp_path), timeout=240)
    assert {"tp2->fsdp2", "fsdp2->tp2", "ep2->tp2", "ddp->ep2", "pp2->fsdp2"} <= res[0].keys()
    assert {"tp2->fsdp2/full_state_dict", "pp2/full_state_dict", "hf_export_lora_merged"} <= res[0].keys()
    for rank_res in res:
        bad = {k: v for k, v in rank_res.items() if not v <= (1e-6 if k == "hf_export_lora_merged" else TOL)}
        assert not bad, f"checkpoint round trips changed weights: {bad}"
    print("\n".join(f"{k}: {v:.2e}" for k, v in sorted(res[0].items())))
