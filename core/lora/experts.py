"""LoRA on a mixture-of-experts layer's stacked experts (posttrain.core.model.moe.GroupedExperts).

Every expert e gets its own low-rank update of its gate+up weights, stacked as HF stores them
(gate rows first, then up: (2I, H)), and of its down weights (H, I):

    W_gate_up[e] += s * B_gu[e] @ A_gu[e]     A_gu (E, r, H), B_gu (E, 2I, r)
    W_down[e]    += s * B_d[e] @ A_d[e]       A_d (E, r, I),  B_d (E, H, r)

with s = alpha / r (alpha / sqrt(r) with rsLoRA), B zero at the start. This is what peft's
`target_parameters=["experts.gate_up_proj", "experts.down_proj"]` trains on a transformers
Mixtral / Qwen2-MoE (registry/adapters.py writes and reads that layout). The experts run on
their effective weights, W + s B A, built once per forward for the experts this rank holds (as
peft folds the update into the base weight): every parameter keeps a leading expert dimension,
so expert parallelism shards the adapters with the experts (posttrain.core.parallel.expert.shard_experts)
and FSDP shards them like any other weight.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from posttrain.core.lora.layer import init_lora_a

PARAMS = ("gate_up_A", "gate_up_B", "down_A", "down_B")


class ExpertLoRA(nn.Module):
    """Adapter `name` of one GroupedExperts (E experts of (I, H) gate / up and (H, I) down)."""

    def __init__(self, experts: nn.Module, name: str, rank: int, alpha: float, dropout: float = 0.0,
                 use_rslora: bool = False, init_lora_weights: str = "kaiming"):
        super().__init__()
        E, I, H = experts.gate_proj.shape
        dev, dtype = experts.gate_proj.device, experts.gate_proj.dtype
        self.name = name
        self.config = dict(rank=rank, alpha=alpha, dropout=dropout, use_rslora=use_rslora, use_dora=False,
                           init_lora_weights=init_lora_weights)
        self.scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
        if dropout:
            raise ValueError("lora.dropout with lora.experts: the experts' update is folded into their weights, "
                             "so there is no adapter input to drop; set dropout=0")
        self.gate_up_A = nn.Parameter(torch.empty(E, rank, H, device=dev, dtype=dtype))
        self.gate_up_B = nn.Parameter(torch.zeros(E, 2 * I, rank, device=dev, dtype=dtype))
        self.down_A = nn.Parameter(torch.empty(E, rank, I, device=dev, dtype=dtype))
        self.down_B = nn.Parameter(torch.zeros(E, H, rank, device=dev, dtype=dtype))
        self.disabled = False
        if dev.type != "meta":
            self.reset_a()

    @torch.no_grad()
    def reset_a(self, a: dict[str, Tensor] | None = None) -> None:
        """Draw A as peft draws its (E * r, in) lora_A (Kaiming-uniform over fan-in `in`, or
        gaussian), into `a` (name -> tensor, default this module's parameters)."""
        a = a or {"gate_up_A": self.gate_up_A, "down_A": self.down_A}
        for key in ("gate_up_A", "down_A"):
            t = a[key]
            t.copy_(init_lora_a(torch.empty(t.shape[0] * t.shape[1], t.shape[2], dtype=t.dtype, device=t.device),
                                self.config["init_lora_weights"]).view(t.shape))

    def effective(self, gate: Tensor, up: Tensor, down: Tensor, params: list[Tensor] | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
        """The experts' weights with the update added; `params` (A_gu, B_gu, A_d, B_d) are the
        local tensors of this rank's experts (default the parameters themselves)."""
        if self.disabled:
            return gate, up, down
        a_gu, b_gu, a_d, b_d = params if params is not None else [getattr(self, k) for k in PARAMS]
        d_gu = torch.bmm(b_gu, a_gu) * self.scaling
        I = gate.shape[1]
        return gate + d_gu[:, :I], up + d_gu[:, I:], down + torch.bmm(b_d, a_d) * self.scaling

    @torch.no_grad()
    def merged(self, gate: Tensor, up: Tensor, down: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Whole (unsharded) weights with the update folded in, for export."""
        was, self.disabled = self.disabled, False
        try:
            return self.effective(gate, up, down)
        finally:
            self.disabled = was


def expert_loras(model: nn.Module):
    """(module name, ExpertLoRA) of every adapted MoE layer."""
    for name, mod in model.named_modules():
        if isinstance(mod, ExpertLoRA):
            yield name, mod


def apply_expert_lora(model: nn.Module, name: str, rank: int, alpha: float, dropout: float, use_rslora: bool,
                      init_lora_weights: str) -> list[str]:
    """Give every GroupedExperts of `model` adapter `name` (as its child `lora`); the names of
    the adapted experts modules."""
    from posttrain.core.model.moe import GroupedExperts

    done = []
    for mname, mod in list(model.named_modules()):
        if isinstance(mod, GroupedExperts):
            if "lora" in mod._modules:
                raise ValueError(f"{mname}: the experts already have an adapter ({mod.lora.name!r}); one only")
            mod.lora = ExpertLoRA(mod, name, rank, alpha, dropout, use_rslora, init_lora_weights)
            done.append(mname)
    if not done:
        raise ValueError("lora.experts: the model has no mixture-of-experts layer")
    return done
