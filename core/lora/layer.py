"""LoRA adapters, written here (the runtime never imports peft).

    y = x W^T + b + s * dropout(x) A^T B^T,   A: (r, in) Kaiming-uniform, B: (out, r) zeros,
    s = alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023, arXiv 2312.03732).

DoRA (Liu et al. 2024, arXiv 2402.09353) re-normalizes the adapted weight row-wise and learns the
magnitude m (init ||W||, one value per output row, peft's convention):

    W' = m * (W + s B A) / ||W + s B A||,   the norm detached from the graph (paper, section 4.3),

computed, without forming W', as a correction to the base output:
    y = base + (m/n - 1) x W^T + (m/n) lora,   n = ||W + s B A||.

`LoRALinear` replaces an nn.Linear in place and keeps its `weight` and `bias` as direct
attributes, so state-dict keys (`layers.0.attn.q_proj.weight`) do not change. Several named
adapters live on one base: `set_adapter` picks the active one, `route_adapters` gives every
example of a batch, or every token of a packed row, its own adapter (multi-adapter training in one
pass), `disable_adapter` gives the base model (DPO's reference model). With `quantize_base` (QLoRA) the frozen base is stored
as NF4 (core/quant.py, kernels/nf4.py) and dequantized on the fly, in backward too.

The model-level API (apply_lora from a LoRAConfig, named adapters, merging) is core/lora/model.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.core.quant import NF4Weight, nf4_linear, quantize_nf4
from posttrain.kernels.dispatch import use_triton
from posttrain.kernels.lora import lora_linear, lora_linear_multi

OUTPUT_HEADS = ("lm_head", "output")  # left out of "all-linear" unless `exclude` says otherwise
# (weight, bias, A, B, scale, dropout): the arguments of posttrain.kernels.lora.lora_linear after x.
PlainLoRA = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, float, float]


def init_lora_a(a: torch.Tensor, init: str) -> torch.Tensor:
    """A (r, in) drawn in place from the global RNG of its device: Kaiming-uniform(a=sqrt(5)), or
    N(0, 1/r^2) for "gaussian" (PiSSA overwrites it afterwards). Also how an adapter built on
    the meta device gets its values once materialized (posttrain.core.parallel.materialize)."""
    if init == "gaussian":
        return nn.init.normal_(a, std=1 / a.shape[0])
    return nn.init.kaiming_uniform_(a, a=math.sqrt(5))


class LoRALinear(nn.Module):
    """A frozen nn.Linear (dense or NF4) plus named low-rank adapters."""

    def __init__(self, base: nn.Linear, quantize: bool = False, double_quant: bool = True):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        if quantize:
            self.weight = NF4Weight(quantize_nf4(base.weight, double_quant=double_quant))
        else:
            self.weight = base.weight.requires_grad_(False)  # the same Parameter: no copy
        self.register_parameter("bias", base.bias)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.lora_A = nn.ParameterDict()  # name -> (r, in)
        self.lora_B = nn.ParameterDict()  # name -> (out, r)
        self.lora_magnitude = nn.ParameterDict()  # name -> (out,), DoRA adapters only
        self.configs: dict[str, dict[str, Any]] = {}
        self.scaling: dict[str, float] = {}
        self.active_adapter: str | None = None
        self.disabled = False
        self.merged: list[str] = []  # merged adapters are part of `weight`, in merge order
        self._merged_norm: dict[str, torch.Tensor] = {}  # DoRA: the norm used at merge time
        # Local adapter index per example (B,) or per token (B, T); len(adapters) = none. See route_adapters.
        self.routing: torch.Tensor | None = None
        self.base_rewritten = False  # PiSSA moved part of W into an adapter
        # Quantization-aware training (posttrain.core.qat.prepare_qat): fake quantizers of the merged
        # weight and of the input; stateless modules, so the state dict is unchanged.
        self.qat_weight: nn.Module | None = None
        self.qat_input: nn.Module | None = None

    @property
    def quantized(self) -> bool:
        return isinstance(self.weight, NF4Weight)

    @property
    def adapters(self) -> list[str]:
        return list(self.lora_A.keys())

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense frozen weight (dequantized for an NF4 base)."""
        if self.quantized:
            return self.weight.dequantize(dtype)
        return self.weight if dtype is None else self.weight.to(dtype)

    def add_adapter(
        self, name: str, rank: int, alpha: float, dropout: float = 0.0,
        use_rslora: bool = False, use_dora: bool = False, init: str = "kaiming",
    ) -> None:
        """init: "kaiming" (A ~ Kaiming-uniform(a=sqrt(5)), as nn.Linear and peft), "gaussian"
        (A ~ N(0, 1/r^2), peft's), or "pissa" (Meng et al. 2024: A, B from the top-r singular
        triplets of W, and W := W - s B A, so the output is unchanged but the base is not)."""
        if name in self.lora_A:
            raise ValueError(f"adapter {name!r} already exists on this layer")
        if init not in ("kaiming", "gaussian", "pissa"):
            raise ValueError(f"init_lora_weights must be kaiming, gaussian or pissa, got {init!r}")
        ref = self.weight.packed if self.quantized else self.weight
        kw = dict(device=ref.device, dtype=self.weight.dtype)
        self.lora_A[name] = nn.Parameter(init_lora_a(torch.empty(rank, self.in_features, **kw), init))
        self.lora_B[name] = nn.Parameter(torch.zeros(self.out_features, rank, **kw))
        self.scaling[name] = alpha / (math.sqrt(rank) if use_rslora else rank)
        self.configs[name] = dict(rank=rank, alpha=alpha, dropout=dropout, use_rslora=use_rslora,
                                  use_dora=use_dora, init_lora_weights=init)
        if init == "pissa":
            self._init_pissa(name)
        if use_dora:  # m = ||W + s B A|| (= ||W|| unless PiSSA), so the output starts unchanged
            self.lora_magnitude[name] = nn.Parameter(self._weight_norm(name, dtype=kw["dtype"]))
        if self.active_adapter is None:
            self.active_adapter = name

    @torch.no_grad()
    def _init_pissa(self, name: str) -> None:
        if self.quantized:
            raise ValueError("PiSSA rewrites the base weight: not with an NF4 base")
        r, s = self.configs[name]["rank"], self.scaling[name]
        u, sv, vh = torch.linalg.svd(self.weight.float(), full_matrices=False)
        root = (sv[:r] / s).sqrt()  # s B A = U_r S_r V_r^T
        self.lora_A[name].copy_(root[:, None] * vh[:r])
        self.lora_B[name].copy_(u[:, :r] * root)
        delta = s * (self.lora_B[name].float() @ self.lora_A[name].float())
        self.weight.copy_(self.weight.float() - delta)
        self.base_rewritten = True

    def delete_adapter(self, name: str) -> None:
        if name in self.merged:
            raise RuntimeError(f"adapter {name!r} is merged; unmerge it before deleting")
        for params in (self.lora_A, self.lora_B, self.lora_magnitude):
            if name in params:
                del params[name]
        del self.configs[name], self.scaling[name]
        if self.active_adapter == name:
            self.active_adapter = None  # no silent switch to another adapter: set_adapter again

    # --- forward ---------------------------------------------------------------------------

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T, no bias."""
        return nf4_linear(x, self.weight) if self.quantized else F.linear(x, self.weight)

    def _weight_norm(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """||W + s B A|| per output row, detached (DoRA section 4.3), shape (out,)."""
        with torch.no_grad():
            w = self.base_weight(torch.float32)
            w = w + self.scaling[name] * (self.lora_B[name].float() @ self.lora_A[name].float())
            return w.norm(dim=1).to(dtype or self.lora_magnitude[name].dtype)

    def _dora_out(self, base, x, xd, mag, lora):
        # m/n (W + sBA) x + b == base + (m/n - 1) xd W^T + (m/n) lora  (xd: the dropped-out input)
        if xd is x:
            dense = base if self.bias is None else base - self.bias
        else:
            dense = self._dense(xd)
        return base + (mag - 1) * dense + mag * lora

    def plain_lora(self) -> PlainLoRA | None:
        """(weight, bias, A, B, scale, dropout) in the common case, one active adapter and nothing
        else (no merge, routing, quantized base or DoRA); dropout is 0 outside training. Then
        forward is posttrain.kernels.lora.lora_linear(x, *these), which a caller may fuse with what
        produces x."""
        name = self.active_adapter
        if (name is None or self.disabled or self.merged or self.routing is not None or self.quantized
                or name in self.lora_magnitude or self.qat_weight is not None):
            return None
        dropout = self.configs[name]["dropout"] if self.training else 0.0
        return self.weight, self.bias, self.lora_A[name], self.lora_B[name], self.scaling[name], dropout

    def fusable_lora(self) -> PlainLoRA | None:
        """plain_lora() when a caller may run this layer's forward itself, as
        posttrain.kernels.lora.lora_linear(x, *these) fused with what produces x (posttrain.core.model.layers.MLP
        fuses SwiGLU into it); else None. That needs the plain state plain_lora() describes, and
        the module called as is: exactly a LoRALinear (tensor-parallel and FSDP forms change the
        class) with no forward hooks or pre-hooks, which a fused call would skip."""
        if type(self) is not LoRALinear or self._forward_hooks or self._forward_pre_hooks:
            return None
        return self.plain_lora()

    def forward(self, x: torch.Tensor, adapter_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., in). adapter_ids: indices into `self.adapters`, one per example (B,) or per
        token (x.shape[:-1]); len(adapters) (or any index outside them) means no adapter."""
        if self.qat_weight is not None:
            return self._qat_forward(x)
        plain = self.plain_lora() if adapter_ids is None else None
        if plain is not None:
            # The common case: base and low-rank path in one fused op (Triton on GPUs).
            return lora_linear(x, *plain)
        ids = adapter_ids if adapter_ids is not None else self.routing
        if ids is not None and not self.disabled:
            return self._routed_forward(x, token_ids(ids, x))
        base = self._dense(x)
        if self.bias is not None:
            base = base + self.bias
        if self.disabled:
            if self.merged:
                raise RuntimeError(f"adapters {self.merged} are merged; unmerge before disabling")
            return base
        name = self.active_adapter
        if name is None or name in self.merged:
            return base
        p, s = self.configs[name]["dropout"], self.scaling[name]
        xd = F.dropout(x, p) if (self.training and p > 0) else x
        lora = F.linear(F.linear(xd, self.lora_A[name]), self.lora_B[name]) * s
        if name not in self.lora_magnitude:
            return base + lora
        mag = self.lora_magnitude[name] / self._weight_norm(name)
        return self._dora_out(base, x, xd, mag, lora)

    def _qat_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Quantization-aware training: fq_in(x) fq_w(W + s B A)^T + b, the merged weight being
        what export quantizes; the straight-through gradient reaches A and B. No LoRA dropout
        (the merged weight is one weight)."""
        if self.qat_input is not None:
            x = self.qat_input(x)
        w, name = self.weight, self.active_adapter
        if not self.disabled and name is not None and name not in self.merged:
            w = w + self.scaling[name] * (self.lora_B[name] @ self.lora_A[name]).to(w.dtype)
        return F.linear(x, self.qat_weight(w), self.bias)

    def _routed_forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Token t uses adapter ids[t] (ids: x.shape[:-1], from token_ids)."""
        if self.merged:
            raise RuntimeError(f"adapters {self.merged} are merged; unmerge before routing")
        names = self.adapters
        ids = none_outside(ids.to(x.device, torch.long), len(names))
        dropout = self.training and any(self.configs[n]["dropout"] > 0 for n in names)
        if names and not (dropout or self.quantized or self.lora_magnitude) and use_triton(x, self.weight):
            # One fused kernel: base + each row's adapter (adapters zero-padded to one rank).
            r = max(self.configs[n]["rank"] for n in names)
            a = torch.stack([F.pad(self.lora_A[n], (0, 0, 0, r - self.configs[n]["rank"])) for n in names])
            b = torch.stack([F.pad(self.lora_B[n], (0, r - self.configs[n]["rank"])) for n in names])
            scales = torch.tensor([self.scaling[n] for n in names], device=x.device)
            return lora_linear_multi(x, self.weight, self.bias, a, b, scales, ids)
        base = self._dense(x)
        if self.bias is not None:
            base = base + self.bias
        if not names:
            return base
        xd = self.routed_input(x, ids)
        lora = routed_lora(xd, ids, [(self.lora_A[n], self.lora_B[n], self.scaling[n]) for n in names])
        if not self.lora_magnitude:
            return base + lora
        ones = x.new_ones(self.out_features)
        mags = [self.lora_magnitude[n] / self._weight_norm(n) if n in self.lora_magnitude else ones for n in names]
        mag = torch.stack(mags + [ones])[ids]  # (..., out)
        return self._dora_out(base, x, xd, mag, lora)

    def routed_input(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The low-rank path's input: in training, each token dropped out at its adapter's rate."""
        rates = [self.configs[n]["dropout"] for n in self.adapters]
        if not (self.training and any(rates)):
            return x
        p = x.new_tensor(rates + [0.0])[none_outside(ids.to(x.device, torch.long), len(rates))]
        keep = (torch.rand_like(x) >= p[..., None]).to(x.dtype)
        return x * keep / (1 - p)[..., None]

    # --- merge -----------------------------------------------------------------------------

    @torch.no_grad()
    def merge(self, name: str) -> None:
        if self.quantized:
            raise RuntimeError("cannot merge a LoRA adapter into an NF4-quantized base weight; "
                               "load the base dense (quantize_base=False) to merge")
        if name in self.merged:
            raise RuntimeError(f"adapter {name!r} is already merged")
        w = self.weight.float()  # aliases an fp32 weight: then updated in place, fine
        w += self.scaling[name] * (self.lora_B[name].float() @ self.lora_A[name].float())
        if name in self.lora_magnitude:
            norm = self._merged_norm[name] = w.norm(dim=1)
            w *= (self.lora_magnitude[name].float() / norm)[:, None]
        self.weight.copy_(w)
        self.merged.append(name)

    @torch.no_grad()
    def merged_weight(self, name: str | None) -> torch.Tensor:
        """The dense weight with adapter `name` folded in (the base if None), leaving the layer
        as it is; works on NF4 bases too (dequantized), which is how QLoRA exports."""
        w = self.base_weight().float()
        if name is None or name in self.merged:
            return w.to(self.lora_A[name].dtype if name else w.dtype)
        w = w + self.scaling[name] * (self.lora_B[name].float() @ self.lora_A[name].float())
        if name in self.lora_magnitude:
            w = w * (self.lora_magnitude[name].float() / w.norm(dim=1))[:, None]
        return w.to(self.lora_A[name].dtype)

    @torch.no_grad()
    def unmerge(self, name: str) -> None:
        if name not in self.merged:
            raise RuntimeError(f"adapter {name!r} is not merged")
        later = self.merged[self.merged.index(name):]
        if len(later) > 1 and any(n in self.lora_magnitude for n in later):
            raise RuntimeError(f"DoRA merges do not commute: unmerge {later[::-1]} in that order")
        w = self.weight.float()
        if name in self.lora_magnitude:
            w /= (self.lora_magnitude[name].float() / self._merged_norm.pop(name))[:, None]
        w -= self.scaling[name] * (self.lora_B[name].float() @ self.lora_A[name].float())
        self.weight.copy_(w)
        self.merged.remove(name)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, adapters={self.adapters}, "
                f"active={self.active_adapter!r}, quantized={self.quantized}")


def token_ids(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Routing ids for every token of x (..., in): per-token ids (x.shape[:-1]) as they are, per-
    example ids (B,) repeated over each example's tokens."""
    tokens = x.shape[:-1]
    if ids.shape == tokens:
        return ids
    if ids.dim() == 1 and len(tokens) > 1 and ids.shape[0] == tokens[0]:
        return ids.view(-1, *[1] * (len(tokens) - 1)).expand(tokens)
    raise ValueError(f"adapter_ids must have shape ({tokens[0]},) (one per example) or {tuple(tokens)} "
                     f"(one per token), got {tuple(ids.shape)}")


def none_outside(ids: torch.Tensor, n: int) -> torch.Tensor:
    """ids with every index outside [0, n) (e.g. -1 on padding) set to n, "no adapter"."""
    return torch.where((ids >= 0) & (ids < n), ids, n)


def routed_lora(x: torch.Tensor, ids: torch.Tensor, factors: list[tuple[torch.Tensor, torch.Tensor, float]]
                ) -> torch.Tensor:
    """sum_i [ids == i] * s_i * (x A_i^T) B_i^T: each token through its adapter's low-rank path only.

    x (..., in); ids (x.shape[:-1]) index `factors` [(A (r, in), B (out, r), s)], any other index
    meaning none (0). The tokens are grouped by adapter (one sort, one host sync for the group
    sizes), so the cost is one adapter's whatever the mix, and every adapter is in the graph: one
    that no token uses gets a zero gradient (not None), so data-parallel ranks reduce the same
    gradients whatever their tokens."""
    n, out = len(factors), factors[0][1].shape[0]
    flat, fid = x.reshape(-1, x.shape[-1]), none_outside(ids.reshape(-1), n)
    order = torch.argsort(fid, stable=True)
    counts = torch.bincount(fid, minlength=n + 1).tolist()
    groups = flat.index_select(0, order).split(counts)
    parts = [F.linear(F.linear(g, a), b) * s for g, (a, b, s) in zip(groups, factors)]
    parts.append(parts[0].new_zeros(counts[n], out))
    y = torch.cat(parts).index_select(0, torch.argsort(order))  # back in token order
    return y.view(*x.shape[:-1], out)
