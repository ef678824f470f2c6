"""Mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE; DeepSeek-V3-style options).

Routed experts are stored stacked, (num_experts, ...), so expert parallelism can shard the first
dim and a grouped GEMM can replace the per-expert loop without changing the checkpoint layout.

Padding that parallel layouts add to a packed row (sequence parallelism and context parallelism
need lengths divisible by their sizes) is routed like any token, but `routed_tokens` keeps it out
of the load-balancing loss and the token counts, so they stay those of the real tokens.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from posttrain.core.model.args import MoEArgs
from posttrain.core.model.layers import MLP
from posttrain.kernels.swiglu import swiglu


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs with stacked weights: gate/up (E, I, H), down (E, H, I)."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (N, H) sorted by expert, `counts[e]` rows for local expert e; returns (N, H)."""
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if "lora" in self._modules:  # LoRA on the experts (posttrain.core.lora.experts): W + s B A
            gate, up, down = self.lora.effective(gate, up, down)
        outs = []
        for e, rows in enumerate(torch.split(x, counts)):
            if rows.shape[0] == 0:
                continue
            h = swiglu(rows @ gate[e].T, rows @ up[e].T)
            outs.append(h @ down[e].T)
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


class Router(nn.Module):
    """Top-k router. Scores are softmax or sigmoid of a linear map; an optional per-expert bias,
    updated outside autograd, shifts which experts are *selected* but not their weights
    (auxiliary-loss-free balancing, DeepSeek-V3, arXiv 2412.19437)."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, H) -> (logits (N, E), scores (N, E) fp32, top-k weights (N, k) fp32, ids (N, k))."""
        logits = self.gate(x)
        scores = logits.float().softmax(-1) if self.args.gating == "softmax" else logits.float().sigmoid()
        select = scores + self.expert_bias if self.args.bias_update_rate > 0 else scores
        _, ids = select.topk(self.args.top_k, dim=-1)
        weights = scores.gather(-1, ids)
        if self.args.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, scores, weights, ids


def load_balancing_loss(scores: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss (Fedus et al. 2021, arXiv 2101.03961), top-k form:

        L = E * sum_e f_e * P_e,  f_e = (1/N) sum_t sum_k [ids_tk = e],  P_e = (1/N) sum_t p_te

    f_e sums to k (the form HF's Mixtral uses), so a perfectly balanced router gives L = k."""
    f = F.one_hot(ids, num_experts).float().sum(1).mean(0)  # (E,)
    return num_experts * (f * scores.mean(0)).sum()


class MoE(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args.intermediate_size, args.num_experts)
        self.shared_expert = None
        self.shared_expert_gate = None
        if args.shared_intermediate_size:
            self.shared_expert = MLP(dim, args.shared_intermediate_size)
            if args.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
        # Routing statistics of the last forward, and tokens per expert accumulated since the last
        # bias update / reset: what the trainer logs and the balancing step reads.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.last_router_logits: torch.Tensor | None = None
        # (B, T) bool over the model's input tokens, False for padding (routed_tokens); and the
        # tp group whose ranks each route a slice of the sequence (token-sharded routing).
        self.token_mask: torch.Tensor | None = None
        self.tp_group: dist.ProcessGroup | None = None
        self.last_valid: torch.Tensor | None = None  # the last forward's real tokens (flat), None: all
        # Expert parallelism replaces this with an all-to-all dispatch (core/parallel/expert.py).
        self.dispatch = None

    def _valid(self, T: int) -> torch.Tensor | None:
        """This forward's real tokens, flat (None: all are): token_mask, sliced like the sequence
        when each tp rank routes its own part of it."""
        m = self.token_mask
        if m is None:
            return None
        if m.shape[1] != T:
            m = m.chunk(dist.get_world_size(self.tp_group), dim=1)[dist.get_rank(self.tp_group)]
        m = m.reshape(-1)
        return None if bool(m.all()) else m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        logits, scores, weights, ids = self.router(flat)
        self.last_router_logits = logits
        valid = self.last_valid = self._valid(T)
        real_scores, real_ids = (scores, ids) if valid is None else (scores[valid], ids[valid])
        if self.training or self.args.aux_loss_coef:
            self.aux_loss = load_balancing_loss(real_scores, real_ids, self.args.num_experts)
        counts = torch.bincount(ids.flatten(), minlength=self.args.num_experts)
        seen = counts if valid is None else torch.bincount(real_ids.flatten(), minlength=self.args.num_experts)
        self.tokens_per_expert += seen.detach().to(self.tokens_per_expert.dtype)

        if self.dispatch is not None:
            out = self.dispatch(self.experts, flat, weights.to(x.dtype), ids, counts)
        else:
            out = routed_experts(self.experts, flat, weights.to(x.dtype), ids, counts)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(flat))
            out = out + shared
        return out.view(B, T, H)

    @torch.no_grad()
    def update_bias(self) -> None:
        """One auxiliary-loss-free balancing step: raise the bias of under-loaded experts and
        lower over-loaded ones by `bias_update_rate` (sign of the load error), then reset counts.
        Called by the trainer after the optimizer step; a no-op when the rate is 0."""
        if self.args.bias_update_rate > 0 and self.tokens_per_expert.sum() > 0:
            load = self.tokens_per_expert
            self.router.expert_bias += self.args.bias_update_rate * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()


def routed_experts(experts: GroupedExperts, x, weights, ids, counts) -> torch.Tensor:
    """Sort the (token, slot) pairs by expert, run each expert on its rows, weight, and scatter
    back. x (N, H), weights/ids (N, k), counts (E,) -> (N, H)."""
    k = ids.shape[1]
    order = ids.flatten().argsort(stable=True)
    token_of = order // k  # which token each sorted row came from
    y = experts(x[token_of], counts.tolist())
    y = y * weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, token_of, y)


@contextlib.contextmanager
def routed_tokens(model: nn.Module, mask: torch.Tensor | None):
    """Within it, the MoE layers of `model` count only the tokens where `mask` (B, T) over the
    model's input is True in their balancing loss and token counts (all of them: mask None)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)] if mask is not None else []
    for m in layers:
        m.token_mask = mask
    try:
        yield
    finally:
        for m in layers:
            m.token_mask = None
