"""Architecture hyper-parameters of the decoder-only transformer, and the named presets.

`ModelArgs` describes the shapes only; it knows nothing of training or parallelism. The HF
`config.json` of each supported family maps onto it in `registry/hf.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class MoEArgs:
    num_experts: int
    top_k: int
    intermediate_size: int
    """Hidden size of each routed expert's SwiGLU."""
    shared_intermediate_size: int = 0
    """Hidden size of the always-on shared expert (0: none). Qwen2-MoE has one."""
    shared_expert_gate: bool = False
    """Scale the shared expert by sigmoid(Linear(h, 1)), as Qwen2-MoE does."""
    gating: Literal["softmax", "sigmoid"] = "softmax"
    """Router score function: softmax (Mixtral, Qwen2-MoE) or sigmoid (DeepSeek-V3 style)."""
    norm_topk_prob: bool = True
    """Renormalize the top-k scores to sum to one (Mixtral always does; Qwen2-MoE is configurable)."""
    aux_loss_coef: float = 0.0
    """Weight of the Switch-style load-balancing loss the trainer adds to the LM loss."""
    bias_update_rate: float = 0.0
    """Step size of the auxiliary-loss-free balancing bias (DeepSeek-V3); 0 disables it."""
    sparse_step: int = 1
    """Every `sparse_step`-th layer is MoE (Qwen2-MoE `decoder_sparse_step`)."""
    dense_layers: list[int] = field(default_factory=list)
    """Layers that keep a dense MLP (Qwen2-MoE `mlp_only_layers`)."""


@dataclass
class ModelArgs:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    """Defaults to hidden_size // num_heads."""
    intermediate_size: int = 128
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """HF `rope_parameters` / `rope_scaling` without rope_theta: {"rope_type": "llama3", ...}."""
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    """Per-layer "full_attention" / "sliding_attention"; None: every layer slides when
    sliding_window is set (Mistral), none otherwise."""
    moe: MoEArgs | None = None
    family: str = "llama"
    """HF model_type this model exports as: llama, qwen2, mistral, mixtral, qwen2_moe."""
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoEArgs(**self.moe)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None for full causal attention."""
        if not self.sliding_window:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def is_moe_layer(self, layer: int) -> bool:
        m = self.moe
        return m is not None and layer not in m.dense_layers and (layer + 1) % m.sparse_step == 0

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count, from the shapes alone (for FLOP estimates and presets' sanity)."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += (self.num_heads + 2 * self.num_kv_heads) * hd * self.qkv_bias + h * self.o_bias
        dense_mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h) * self.mlp_bias
        total = 0
        for i in range(self.num_layers):
            if self.is_moe_layer(i):
                m = self.moe
                mlp = m.num_experts * 3 * h * m.intermediate_size + h * m.num_experts
                mlp += 3 * h * m.shared_intermediate_size + (h if m.shared_expert_gate else 0)
            else:
                mlp = dense_mlp
            total += attn + mlp + 2 * h
        total += h
        if not exclude_embeddings:
            total += self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return total

    def replace(self, **changes: Any) -> "ModelArgs":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Shapes of public checkpoints (weights are never downloaded; these are for random init,
# benchmarks and the scaling tables). `debug` is the tiny model the tests and the demo use.
PRESETS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=176, max_position_embeddings=1024, tie_embeddings=True,
    ),
    "debug-moe": ModelArgs(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=176, max_position_embeddings=1024, family="mixtral",
        moe=MoEArgs(num_experts=4, top_k=2, intermediate_size=96, aux_loss_coef=0.01),
    ),
    "smollm2-135m": ModelArgs(
        vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        intermediate_size=1536, norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_embeddings=True,
    ),
    "qwen2.5-0.5b": ModelArgs(
        vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
        intermediate_size=4864, rope_theta=1000000.0, max_position_embeddings=32768,
        qkv_bias=True, tie_embeddings=True, family="qwen2",
    ),
    "llama-3.2-1b": ModelArgs(
        vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, intermediate_size=8192, norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_embeddings=True,
    ),
    "llama-3.1-8b": ModelArgs(
        vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        intermediate_size=14336, norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072,
    ),
    "mixtral-8x7b": ModelArgs(
        vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        intermediate_size=14336, norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, family="mixtral",
        moe=MoEArgs(num_experts=8, top_k=2, intermediate_size=14336, aux_loss_coef=0.02),
    ),
    # A small Mixtral-shaped MoE that fits a laptop (for MoE benchmarks and EP tests at scale).
    "mixtral-tiny": ModelArgs(
        vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
        intermediate_size=1408, norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=4096,
        family="mixtral", moe=MoEArgs(num_experts=8, top_k=2, intermediate_size=704, aux_loss_coef=0.02),
    ),
}


def get_preset(name: str, **overrides: Any) -> ModelArgs:
    """A copy of preset `name` with `overrides` applied."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    args = dataclasses.replace(PRESETS[name])
    if args.moe is not None:
        args.moe = dataclasses.replace(args.moe)
    moe_overrides = overrides.pop("moe", None)
    if "head_dim" not in overrides and {"hidden_size", "num_heads"} & overrides.keys():
        overrides["head_dim"] = None  # re-derive from the new shapes
    args = dataclasses.replace(args, **overrides)
    if moe_overrides:
        args.moe = dataclasses.replace(args.moe, **moe_overrides)
    return args
