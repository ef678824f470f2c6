"""Harness for multi-process tests: forked gloo ranks, a single-process reference, comparisons.

Ranks are forked (not spawned): they inherit the already-imported torch, so a process group
starts in ~1 s instead of ~6 s on a loaded 2-core machine. Each test runs many checks in one
process group and returns {check: measured max difference}; the parent asserts and prints them.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.losses import cross_entropy
from posttrain.core.model import build_model, get_preset
from posttrain.core.model.moe import MoE
from posttrain.core.parallel.expert import reduce_moe_stats
from posttrain.core.parallel.grad_norm import grad_norm
from posttrain.core.parallel.mesh import init_distributed

TOL = 1e-5  # fp32: parallel runs differ from one process only by summation order (~1e-7 measured)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, out, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        pickle.dumps(result)  # fail here, with a traceback, rather than in the queue's feeder thread
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this text
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 150.0) -> list[Any]:
    """Run fn(*args) on `world_size` forked ranks (torchrun's environment set); returns each rank's
    result; any rank's exception fails the test with its traceback."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, out, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, payload = out.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(results))} timed out after {timeout}s")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def setup(world_size: int, model_args=None, **cfg):
    cfg = ParallelConfig(**cfg)
    mesh, device = init_distributed(cfg, model_args)
    return cfg, mesh, device


def model_args(name: str, **overrides):
    return get_preset(name, **overrides)


def reference_model(args, seed: int = 0, lora: dict | None = None):
    model = build_model(args, seed=seed)
    if lora:
        from posttrain.core.lora import apply_lora

        torch.manual_seed(seed + 1)
        apply_lora(model, **lora)
        with torch.no_grad():  # B starts at 0; make it non-zero so B's and A's grads both show
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    return model


def clone(model):
    return copy.deepcopy(model)


def batch(args, B: int = 4, T: int = 16, seed: int = 0, packed: bool = False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab_size, (B, T), generator=g)
    pos = None
    if packed:  # documents of uneven lengths, restarting positions
        pos = torch.cat([torch.arange(5), torch.arange(T - 5)])[None].repeat(B, 1)
        pos[1] = torch.cat([torch.arange(9), torch.arange(T - 9)])
    return ids, pos


def loss_of(model, ids, pos=None, labels=None, shift=True):
    logits = model(ids, position_ids=pos)
    loss = cross_entropy(logits, ids if labels is None else labels, shift=shift)
    aux = model.aux_loss() if hasattr(model, "aux_loss") else None
    return loss + aux if aux is not None else loss


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor behind a (possibly DTensor) parameter or gradient."""
    if t is None:
        return None
    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_diff(ref, par, names: list[str] | None = None) -> float:
    """Max |grad_ref - grad_par| over the trainable parameters of `ref` present in `par` (by name).
    Every rank must call it (DTensor gathers are collective)."""
    par_params = dict(par.named_parameters())
    worst = 0.0
    checked = 0
    for name, p in ref.named_parameters():
        if not p.requires_grad or (names is not None and name not in names) or name not in par_params:
            continue
        g = full(par_params[name].grad)
        assert g is not None, f"{name}: no gradient in the parallel model"
        assert p.grad is not None, f"{name}: no gradient in the reference"
        worst = max(worst, (g - p.grad).abs().max().item())
        checked += 1
    assert checked, "no gradients compared"
    return worst


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def compare_training(ref, par, ref_loss: Callable, par_loss: Callable | None = None, steps: int = 2,
                     lr: float = 0.5, step_fn: Callable | None = None, stats_group=None,
                     pp_group=None) -> dict[str, float]:
    """Train `ref` (one process) and `par` (this layout) side by side with SGD; the max loss,
    gradient and final-parameter differences. par_loss returns (loss to backward, global loss);
    step_fn(par) runs forward and backward itself and returns the global loss (pipelines).

    SGD, not AdamW: Adam divides by sqrt(v), so on weights whose gradient is ~0 (embedding rows
    of unseen tokens) a 1e-12 summation-order difference becomes an O(lr) update difference."""
    opt_r = torch.optim.SGD(trainable(ref), lr=lr, foreach=False)
    opt_p = torch.optim.SGD(trainable(par), lr=lr, foreach=False)
    out = {"loss": 0.0, "grad": 0.0, "grad_norm": 0.0}
    moe_ref = [m for m in ref.modules() if isinstance(m, MoE)]
    if moe_ref and stats_group is not None:
        out["tokens_per_expert"] = 0.0
    for _ in range(steps):
        lr_ = ref_loss(ref)
        lr_.backward()
        if step_fn is not None:
            lp_global = step_fn(par)
        else:
            lp, lp_global = par_loss(par)
            lp.backward()
        out["loss"] = max(out["loss"], abs(lr_.item() - float(lp_global)))
        out["grad"] = max(out["grad"], grad_diff(ref, par))
        ref_norm = torch.nn.utils.clip_grad_norm_(trainable(ref), float("inf"))
        out["grad_norm"] = max(out["grad_norm"], abs(ref_norm.item() - grad_norm(trainable(par), pp_group).item()))
        if "tokens_per_expert" in out:  # counts summed over ranks == the single process's counts
            reduce_moe_stats(par, stats_group)
            moe_par = [m for m in par.modules() if isinstance(m, MoE)]
            for a, b in zip(moe_ref, moe_par, strict=True):
                out["tokens_per_expert"] = max(out["tokens_per_expert"],
                                               (a.tokens_per_expert - b.tokens_per_expert).abs().max().item())
                a.tokens_per_expert.zero_()
                b.tokens_per_expert.zero_()
        opt_r.step()
        opt_p.step()
        opt_r.zero_grad()
        opt_p.zero_grad()
    out["param"] = param_diff(ref, par)
    return out


def param_diff(ref, par) -> float:
    par_params = dict(par.named_parameters())
    return max((full(par_params[n].detach()) - p.detach()).abs().max().item()
               for n, p in ref.named_parameters() if n in par_params)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.detach().clone()
    dist.all_reduce(x, op=op, group=group)
    return x


def dp_shard(t: torch.Tensor | None, mesh) -> torch.Tensor | None:
    """This rank's slice of the global batch (dim 0) over the data-parallel ranks."""
    return None if t is None else t.chunk(mesh.size("dp"))[mesh.local_rank("dp")]


def dp_reference_loss(ids, pos, dp: int) -> Callable:
    """What a data-parallel step optimizes: the mean over the dp shards of each shard's loss (for
    token-mean CE with equal shards this is the full-batch loss; MoE aux losses are per shard)."""
    return lambda m: torch.stack([loss_of(m, i, p) for i, p in
                                  zip(ids.chunk(dp), pos.chunk(dp) if pos is not None else [None] * dp)]).mean()


def par_loss_fn(mesh, ids, pos=None) -> Callable:
    """Loss of this rank's shard under `mesh` (vocab-parallel under tp), and its global value."""
    from posttrain.core.parallel.losses import vocab_parallel_cross_entropy

    def f(m):
        i, p = dp_shard(ids, mesh), dp_shard(pos, mesh)
        logits = m(i, position_ids=p)
        tp = mesh.group("tp")
        ce = vocab_parallel_cross_entropy(logits, i, tp) if mesh.size("tp") > 1 else cross_entropy(logits, i)
        aux = m.aux_loss()
        total = ce if aux is None else ce + aux
        shown = ce.detach() if aux is None else ce.detach() + all_reduce(aux, mesh.group("cp_tp"))
        return total, all_reduce(shown, mesh.group("dp")) / mesh.size("dp")

    return f
