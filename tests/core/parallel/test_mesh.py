"""Layout validation: every bad layout is refused with a message naming the problem, before any
process group exists (single process, plus one 2-rank check of init_distributed)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.model import get_preset
from posttrain.core.parallel.mesh import ParallelDims, TorchrunEnv, init_distributed
from tests.core.parallel._dist import run_ranks

DENSE, MOE = get_preset("debug"), get_preset("debug-moe")


@pytest.mark.parametrize("fields, world, model, match", [
    (dict(tp=3), 7, None, "world size 7 is not divisible"),
    (dict(tp=2, dp_shard=3), 8, None, "dp_shard=3 = 6 ranks, but the world size is 8"),
    (dict(tp=8), 8, DENSE, "tp=8 does not divide the model's n_heads=4"),
    (dict(tp=4), 4, DENSE, "n_kv_heads=2"),
    (dict(ep=2), 4, DENSE, "the model is dense"),
    (dict(ep=8), 8, MOE, "does not divide the model's n_experts=4"),
    (dict(ep=4, tp=2), 4, MOE, "ep=4 must divide dp_shard\\*cp"),
    (dict(pp=4), 4, DENSE, "only num_layers=2"),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2), 2, get_preset("debug", num_layers=3),
     "4 stages"),
    (dict(tp=2), 2, get_preset("debug", vocab_size=511), "vocab_size=511"),
    (dict(tp=2), 2, get_preset("debug", intermediate_size=175), "intermediate_size=175"),
    (dict(cp=2), 2, get_preset("debug", sliding_window=8), "sliding_window"),
    (dict(dp_replicate=2, dp_shard=1, tp=2), 4, DENSE, "DDP, which does not compose"),
    (dict(pp=2, pp_schedule="1f1b", pp_microbatches=1), 2, None, "pp_microbatches >= pp=2"),
])
def test_invalid_layouts_are_rejected(fields, world, model, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.from_config(ParallelConfig(**fields), world, model)


def test_valid_layout_sizes():
    d = ParallelDims.from_config(ParallelConfig(dp_replicate=2, tp=2, cp=2, ep=2), 16, MOE)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp, d.ep) == (2, 2, 2, 2, 1, 2)
    assert d.world_size == 16 and d.dp == 4 and d.fsdp and not d.ddp and d.dp_shard_mod_ep == 2
    assert ParallelDims.from_config(ParallelConfig(dp_replicate=4, dp_shard=1), 4).ddp


def test_bad_torchrun_env_is_rejected(monkeypatch):
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="outside WORLD_SIZE"):
        TorchrunEnv.read()


def _init_with_bad_layout():
    try:
        init_distributed(ParallelConfig(tp=4), get_preset("debug"))
    except ValueError as e:
        return str(e), dist.is_initialized()
    return "no error", dist.is_initialized()


@pytest.mark.slow
def test_init_distributed_validates_before_any_process_group():
    """Two torchrun ranks with tp=4: refused on each rank, and no process group was started (a
    started group would wait for 4 ranks, or hang in the first collective)."""
    for msg, initialized in run_ranks(_init_with_bad_layout, 2, timeout=60):
        assert "world size 2 is not divisible" in msg and not initialized
