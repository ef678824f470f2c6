"""Rotary position embeddings (Su et al. 2021, arXiv 2104.09864) with the scaling variants
found in HF checkpoints: linear (position interpolation), llama3 and YaRN (arXiv 2309.00071)."""

from __future__ import annotations

import math
from typing import Any

import torch

# The rotation itself (x (B, n_heads, T, head_dim) by cos/sin, the half-split convention HF
# checkpoints use) is the torch reference of the RoPE kernel and lives beside it.
from posttrain.kernels.rope import rotate_reference as apply_rope  # noqa: F401

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim // 2,) on the CPU, whatever the default device (math on the
    meta device would import torch._dynamo), and the attention scaling applied to cos/sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, blended, scaled)


def _yarn(head_dim: int, theta: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    old_len = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolate = 1 - ramp  # 1 where the dimension keeps its original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn)


def rope_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (B, T, head_dim) for integer positions (B, T); computed in fp32."""
    freqs = position_ids[..., None].float() * inv_freq.float().to(position_ids.device)  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
