"""Parallelism for core/model/moe.py's MoE: expert parallelism and token-sharded routing.

Expert parallelism (GShard, Lepikhin et al. 2020, arXiv 2006.16668): the `ep` ranks of a group
each hold E/ep of the stacked experts (dim 0 of gate/up/down). `AllToAllDispatcher`, installed as
`moe.dispatch`, sends every (token, slot) pair to the rank owning its expert, runs the local
experts on what arrives, and sends the outputs back in the mirror-image exchange; autograd runs
the same exchanges backward. Dropless by default; with a capacity factor c each expert takes at
most ceil(c * N * k / E) pairs from each rank (in token order) and drops the rest, which then
contribute zero (the residual carries those tokens), as in GShard / Switch.

Serving (`serve-model --ep K`) is the other case: every rank of a replica holds the same tokens,
so `AllReduceDispatcher` has each rank run only its experts' pairs and sums the partial outputs
with one all-reduce (`apply_serving_expert_parallel`); same weight layout, same router.

Token-sharded routing: under tensor parallelism the MoE block is not split by columns; each tp
rank routes and computes its own sequence shard (Megatron's expert-tensor-parallel size 1), with
router and expert weights replicated over tp (grads all-reduced in the graph, tensor.py). Under
context parallelism, too, every rank routes only its chunk of the sequence. Either way the
Switch load-balancing loss must see the whole sequence's routing: `global_aux_loss` replaces each
rank's loss by its share of the global one (f all-reduced, P summed locally), so the shares add
up to exactly the single-process value, and its gradient is exact.

The router, its aux loss and the aux-loss-free bias are otherwise untouched; `reduce_moe_stats`
all-reduces tokens_per_expert before logging and before `update_bias` so every rank applies the
same bias step the single-process model would.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from posttrain.core.model.moe import GroupedExperts, MoE
from posttrain.core.parallel.mappings import all_to_all, copy_to_tp
from posttrain.core.parallel.tensor import local


def grouped_mlp(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, counts: list[int]) -> Tensor:
    """GroupedExperts.forward on explicit weights (E_local, I, H) / (E_local, H, I). Experts with no
    rows still run (on zero rows), so every weight gets a gradient, zeros included: ranks must agree
    on which gradients exist before a reduce-scatter."""
    outs = [(F.silu(rows @ gate[e].T) * (rows @ up[e].T)) @ down[e].T
            for e, rows in enumerate(torch.split(x, counts))]
    return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * ctx.scale, None


class ParallelGroupedExperts(GroupedExperts):
    """GroupedExperts whose stacked weights may be this rank's E/ep experts (Shard(0) DTensors).
    Still called as a module, so FSDP's hooks gather its weights around the call.

    The local experts' gradient sums the tokens of all `ep` data ranks of the group; data
    parallelism averages gradients, so it is scaled by 1/ep here (FSDP then averages over the
    remaining dp_shard_mod_ep ranks: data_parallel.py)."""

    tp_group: dist.ProcessGroup | None = None
    ep: int = 1

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        weights = [local(p) for p in (self.gate_proj, self.up_proj, self.down_proj)]
        if "lora" in self._modules:  # LoRA on the experts: this rank's experts' W + s B A
            from posttrain.core.lora.experts import PARAMS

            weights = list(self.lora.effective(*weights, [local(getattr(self.lora, k)) for k in PARAMS]))
        if self.tp_group is not None:  # DTensor weights are skipped by replicate_over_tp: reduce here
            weights = [copy_to_tp(w, self.tp_group) for w in weights]
        if self.ep > 1:
            weights = [_ScaleGrad.apply(w, 1.0 / self.ep) for w in weights]
        return grouped_mlp(x, *weights, counts)


def capacity_keep(sorted_ids: Tensor, counts: Tensor, capacity: int) -> Tensor:
    """For pairs sorted by expert (stable, so in token order within an expert): True for the first
    `capacity` pairs of each expert."""
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(sorted_ids.numel(), device=sorted_ids.device) - starts[sorted_ids]
    return pos < capacity


class AllToAllDispatcher:
    """`moe.dispatch` for expert parallelism over `ep_mesh` (also correct, without traffic, at ep=1)."""

    def __init__(self, ep_group: dist.ProcessGroup | None, num_experts: int, capacity_factor: float | None = None):
        self.group = ep_group
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        if num_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide num_experts={num_experts}")
        self.num_experts, self.local_experts = num_experts, num_experts // self.ep
        self.capacity_factor = capacity_factor

    def __call__(self, experts: GroupedExperts, x: Tensor, weights: Tensor, ids: Tensor, counts: Tensor) -> Tensor:
        """x (N, H), weights/ids (N, k), counts (E,) -> (N, H), as routed_experts."""
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        if self.capacity_factor is not None:
            cap = math.ceil(self.capacity_factor * flat.numel() / self.num_experts)
            keep = capacity_keep(flat[order], counts, cap)
            order, counts = order[keep], counts.clamp(max=cap)
        token_of = order // k
        routed = x[token_of]  # (M, H), grouped by expert: rank r's experts are a contiguous block

        if self.ep == 1:
            y = experts(routed, counts.tolist())
        else:
            y = self._exchange_and_run(routed, counts, experts)
        y = y * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add(0, token_of, y)

    def _exchange_and_run(self, routed: Tensor, counts: Tensor, experts: GroupedExperts) -> Tensor:
        ep, el = self.ep, self.local_experts
        # recv[s, e]: pairs rank s sends to my local expert e (counts are tiny: one exchange).
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=self.group)
        send_splits = counts.view(ep, el).sum(1).tolist()
        recv = recv.view(ep, el)
        recv_splits = recv.sum(1).tolist()
        arrived = all_to_all(routed, recv_splits, send_splits, self.group)  # ordered (source, expert)
        # Regroup (source, expert) -> (expert, source) so each local expert's rows are contiguous.
        segment = torch.repeat_interleave(torch.arange(ep * el, device=counts.device), recv.flatten())
        perm = ((segment % el) * ep + segment // el).argsort(stable=True)
        y = experts(arrived[perm], recv.sum(0).tolist())
        y = y[perm.argsort()]  # back to (source, expert) order
        return all_to_all(y, send_splits, recv_splits, self.group)


def shard_experts(moe: MoE, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's E/ep experts (dim 0 of the stacked weights) as Shard(0) DTensors."""
    n, r = ep_mesh.size(), ep_mesh.get_local_rank()
    owners = [(moe.experts, name) for name in ("gate_proj", "up_proj", "down_proj")]
    if "lora" in moe.experts._modules:  # LoRA on the experts: each adapter tensor has the expert dim first
        from posttrain.core.lora.experts import PARAMS

        owners += [(moe.experts.lora, name) for name in PARAMS]
    for owner, name in owners:
        p = getattr(owner, name)
        if isinstance(p, DTensor):
            raise ValueError("experts are already sharded")
        shard = p.detach().chunk(n, dim=0)[r].clone()
        setattr(owner, name, nn.Parameter(DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False),
                                          requires_grad=p.requires_grad))


def apply_expert_parallel(moe: MoE, ep_mesh: DeviceMesh | None, capacity_factor: float | None = None,
                          tp_group: dist.ProcessGroup | None = None) -> None:
    """Shard the experts over `ep_mesh` (None: keep all) and install the all-to-all dispatcher.
    tp_group: the experts are replicated over tp (token-sharded MoE) and their gradients partial."""
    moe.experts.__class__ = ParallelGroupedExperts
    ep = ep_mesh is not None and ep_mesh.size() > 1
    if ep:
        shard_experts(moe, ep_mesh)
        moe.experts.tp_group, moe.experts.ep = tp_group, ep_mesh.size()
    moe.dispatch = AllToAllDispatcher(ep_mesh.get_group() if ep else None, moe.args.num_experts, capacity_factor)


class AllReduceDispatcher:
    """`moe.dispatch` for expert parallelism when every rank of `ep_group` holds the *same* tokens
    (the ranks of a serving replica run in lockstep on one batch). Each rank runs its E/ep experts
    on the (token, slot) pairs routed to them and an all-reduce sums the partial outputs: every
    pair is computed once, on its expert's rank. Forward only (inference).

    AllToAllDispatcher would also give the right answer here, but each rank would receive the same
    pairs from all `ep` ranks and compute them `ep` times."""

    def __init__(self, ep_group: dist.ProcessGroup, num_experts: int):
        self.group = ep_group
        ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if num_experts % ep:
            raise ValueError(f"ep={ep} does not divide num_experts={num_experts}")
        self.local_experts = num_experts // ep
        self.first = rank * self.local_experts  # this rank's experts: first .. first + local_experts - 1

    def __call__(self, experts: GroupedExperts, x: Tensor, weights: Tensor, ids: Tensor, counts: Tensor) -> Tensor:
        """x (N, H), weights/ids (N, k), counts (E,) -> (N, H), as routed_experts."""
        k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)  # pairs grouped by expert: mine are one block
        lo, hi = self.first, self.first + self.local_experts
        start, end = int(counts[:lo].sum()), int(counts[:hi].sum())
        mine = order[start:end]
        token_of = mine // k
        y = experts(x[token_of], counts[lo:hi].tolist())
        y = y * weights.flatten()[mine, None]
        out = torch.zeros_like(x).index_add_(0, token_of, y)
        dist.all_reduce(out, group=self.group)
        return out


def apply_serving_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[tuple[int, int]]:
    """Split every MoE layer of `model` (whole on each rank, every rank to see the same tokens) over
    `ep_mesh`: keep this rank's E/ep experts (Shard(0) DTensors, as for training) and install the
    all-reduce dispatcher. Returns each MoE layer's experts on this rank, as (first, count)."""
    held = []
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        shard_experts(moe, ep_mesh)
        moe.experts.__class__ = ParallelGroupedExperts  # reads the local shards; ep stays 1: no grad scaling
        moe.dispatch = AllReduceDispatcher(ep_mesh.get_group(), moe.args.num_experts)
        held.append((moe.dispatch.first, moe.dispatch.local_experts))
    return held


# --------------------------------------------------------------------------- token-sharded routing


def global_aux_loss(moe: MoE, group: dist.ProcessGroup, grad_scale: float = 1.0) -> None:
    """After each forward, moe.aux_loss becomes this rank's share of the load-balancing loss of
    all tokens routed across `group` (ranks holding pieces of the same sequences):

        L = E sum_e f_e P_e,   share_r = E sum_e f_e (1/N) sum_{t on r} p_te,   sum_r share_r = L

    with f_e = (all-reduced counts) / N treated as a constant, as it is in the unsplit loss (ids
    come from a top-k). `grad_scale` undoes a data-parallel average over the group (cp: the
    gradient averaging over cp ranks would otherwise divide this sum by cp)."""
    E = moe.args.num_experts

    def capture(router, args, out):
        _, scores, _, ids = out
        moe._routing = (scores, ids)

    def share(mod, args, out):
        scores, ids = mod._routing
        mod._routing = None
        if mod.aux_loss is None:
            return out
        # Also during a checkpoint recompute: it must save the same tensors as the first forward,
        # and it runs on every rank of the group in the same order, like the block's TP collectives.
        if mod.last_valid is not None:  # padding a layout added: not part of the balance
            scores, ids = scores[mod.last_valid], ids[mod.last_valid]
        counts = F.one_hot(ids, E).sum((0, 1)).to(scores.dtype)
        stats = torch.cat([counts, scores.new_tensor([ids.shape[0]])]).detach()
        dist.all_reduce(stats, group=group)
        counts, n = stats[:E], stats[E]
        mod.aux_loss = E * ((counts / n) * (scores.sum(0) / n)).sum() * grad_scale
        return out

    moe.router.register_forward_hook(capture)
    moe.register_forward_hook(share)


def shard_moe_tokens(moe: MoE, tp_group: dist.ProcessGroup, sequence_parallel: bool) -> None:
    """Run `moe` on this tp rank's sequence shard with replicated weights. Under sequence
    parallelism the block input is already split; otherwise split it on entry and all-gather the
    output (the gather's backward takes this rank's slice of the replicated gradient)."""
    from posttrain.core.parallel.mappings import gather_from_sp_replicated, scatter_to_sp
    from posttrain.core.parallel.tensor import replicate_over_tp

    replicate_over_tp(moe, tp_group)
    moe.tp_group = tp_group  # its token_mask is sliced like the sequence
    moe.tp_split_tokens = not sequence_parallel  # read per call: decoding (one token a step) runs all of them
    moe.register_forward_pre_hook(
        lambda mod, args: ((scatter_to_sp(args[0], tp_group),) + args[1:]) if mod.tp_split_tokens else args)
    moe.register_forward_hook(
        lambda mod, args, out: gather_from_sp_replicated(out, tp_group) if mod.tp_split_tokens else out)


@torch.no_grad()
def reduce_moe_stats(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum every MoE layer's tokens_per_expert over `group` (all ranks holding distinct tokens), in
    one collective: what to log, and what `update_bias` must see to match a single process."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([m.tokens_per_expert.float() for m in layers])
    dist.all_reduce(flat, group=group)
    for m, c in zip(layers, flat.split([m.tokens_per_expert.numel() for m in layers])):
        m.tokens_per_expert.copy_(c)
