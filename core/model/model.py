"""The decoder-only transformer of the Llama / Qwen2 / Mistral / Mixtral / Qwen2-MoE families.

One readable file, no parallelism: tensor, sequence, pipeline, context and expert parallelism are
applied from outside (core/parallel). Module names are our own; registry/hf.py maps HF keys.

Packed sequences: when `position_ids` are given, a position that resets to 0 starts a new
document, and attention never crosses documents (the convention of padding-free collators).
Without padding, packed attention runs document by document (`DocumentSpans`): the varlen Triton
kernel on GPUs, causal SDPA per run of equal-length documents elsewhere. Its cost is that of the
documents alone, not of the (T x T) block-diagonal mask, which the mask path materializes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.core.model.args import ModelArgs
from posttrain.core.model.layers import MLP, RMSNorm
from posttrain.core.model.moe import MoE
from posttrain.core.model.rope import rope_cos_sin, rope_frequencies
from posttrain.kernels.dispatch import use_triton
from posttrain.kernels.flash_attention import flash_attn_varlen
from posttrain.kernels.rope import apply_rope


@dataclass
class KVCache:
    """Preallocated keys/values for every layer: (layers, B, n_kv_heads, max_len, head_dim).

    All rows share one write offset `length` (prompts are left-padded), so a decode step writes
    one slot per row; the padding mask says which slots are real."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0
    slot_of: dict[int, int] | None = None  # layer -> its row in k / v, when only some layers are held

    @classmethod
    def empty(cls, args: ModelArgs, batch: int, max_len: int, device, dtype,
              kv_heads: int | None = None, layers: list[int] | None = None) -> "KVCache":
        """kv_heads: the heads this rank holds (its share under tensor parallelism); default all.
        layers: the layers this rank runs (its pipeline stages'); default all."""
        n = args.num_layers if layers is None else len(layers)
        shape = (n, batch, kv_heads or args.num_kv_heads, max_len, args.head_dim)
        slot_of = None if layers is None else {layer: i for i, layer in enumerate(layers)}
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                   slot_of=slot_of)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        i = layer if self.slot_of is None else self.slot_of[layer]
        self.k[i, :, :, self.length:end] = k
        self.v[i, :, :, self.length:end] = v
        return self.k[i, :, :, :end], self.v[i, :, :, :end]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        h = args.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=args.o_bias)

    def forward(self, x, cos, sin, mask: "torch.Tensor | DocumentSpans | None",
                cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # Projections are reshaped by their own output size so that a tensor-parallel shard
        # (fewer local heads) runs this same code.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_heads, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if isinstance(mask, DocumentSpans):
            return self.o_proj(document_attention(q, k, v, mask).view(B, T, -1))
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # GQA: each KV head serves `groups` query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = Attention(args, layer)
        self.mlp_norm = RMSNorm(args.hidden_size, args.norm_eps)
        if args.is_moe_layer(layer):
            self.mlp = MoE(args.hidden_size, args.moe)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.mlp(self.mlp_norm(x))


def build_attention_mask(
    q_slots: torch.Tensor,
    k_slots: torch.Tensor,
    key_padding: torch.Tensor | None = None,
    q_docs: torch.Tensor | None = None,
    k_docs: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Boolean (B or 1, 1, Tq, Tk) mask, True = may attend: causal over slots, same document,
    real (non-pad) key, within the sliding window. Every query may attend to its own slot, so a
    padding row never becomes all-masked (which would turn SDPA's output into NaN)."""
    q, k = q_slots[:, :, None], k_slots[:, None, :]  # (B|1, Tq, 1), (B|1, 1, Tk)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    if key_padding is not None:
        allowed = allowed & key_padding[:, None, :].bool()
    if q_docs is not None:
        allowed = allowed & (q_docs[:, :, None] == k_docs[:, None, :])
    return (allowed | (q == k))[:, None]


@dataclass(frozen=True)
class DocumentSpans:
    """Where the documents of a packed batch lie, for attention that runs per document.

    runs[b]: (start, length, count) = `count` consecutive documents of `length` tokens each from
    token `start` of row b (packers emit equal lengths side by side, so a dense batch is one run
    per row). cu_seqlens (int32, n_docs + 1) and max_len describe the same documents over the
    flattened (B * T) tokens, the varlen kernels' layout."""

    runs: tuple[tuple[tuple[int, int, int], ...], ...]
    cu_seqlens: torch.Tensor
    max_len: int

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "DocumentSpans":
        """A document starts at every position 0 and at the start of every row."""
        B, T = position_ids.shape
        starts = (position_ids == 0).clone()
        starts[:, 0] = True
        bounds = starts.reshape(-1).nonzero().squeeze(1).tolist() + [B * T]  # one host sync per forward
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        runs: list[list[tuple[int, int, int]]] = [[] for _ in range(B)]
        for s, length in zip(bounds, lengths):
            row, start = divmod(s, T)
            row_runs = runs[row]
            if row_runs and row_runs[-1][1] == length:
                first, _, count = row_runs[-1]
                row_runs[-1] = (first, length, count + 1)
            else:
                row_runs.append((start, length, 1))
        cu = torch.tensor(bounds, dtype=torch.int32, device=position_ids.device)
        return cls(tuple(tuple(r) for r in runs), cu, max(lengths))


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: DocumentSpans) -> torch.Tensor:
    """Causal attention inside each document of `spans`. q (B, H, T, hd), k/v (B, H_kv, T, hd)
    (H a multiple of H_kv) -> (B, T, H, hd), contiguous."""
    B, H, T, hd = q.shape
    if use_triton(q, k, v):
        # (B, H, T, hd) -> (B*T, H, hd): the varlen kernel's packed layout
        flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], hd) for t in (q, k, v)]
        return flash_attn_varlen(*flat, spans.cu_seqlens, spans.max_len).view(B, T, H, hd)
    parts = []
    for b, runs in enumerate(spans.runs):
        for start, length, count in runs:
            # `count` documents of `length` tokens side by side: one batched causal SDPA on views
            qs, ks, vs = (t[b, :, start:start + length * count].unflatten(1, (count, length)).transpose(0, 1)
                          for t in (q, k, v))
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=ks.shape[1] != H)
            parts.append(out.transpose(1, 2).reshape(count * length, H, hd))  # a view where SDPA allows
    # One run (a dense row): SDPA's own output, so o_proj saves the tensor SDPA saves, not a copy
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(B, T, H, hd)


def run_eagerly_under_compile() -> None:
    """Before blocks are compiled: document_attention runs eagerly inside them (traced, each new
    packing layout, a Python object, would become a guard and a recompile). Marked here rather than
    at import, since marking imports torch._dynamo (1.2 s of every process's start-up, which a run
    that does not compile would pay for nothing); Attention looks the name up at each call."""
    global document_attention
    if not getattr(document_attention, "_torchdynamo_disable", False):
        document_attention = torch.compiler.disable(document_attention)


def attention_masks(
    args: ModelArgs,
    layers: list[int],
    position_ids: torch.Tensor | None,
    T: int,
    start: int = 0,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> dict[int | None, torch.Tensor | DocumentSpans | None]:
    """What Attention gets, per distinct sliding window among `layers`, for T queries from slot
    `start` (a KV cache's length): None (plain causal, SDPA's fused path); DocumentSpans when
    `position_ids` mark packed documents and nothing is padded; else a boolean mask.
    position_ids here only for packed inputs (None when decoding)."""
    packed = position_ids is not None
    spans = DocumentSpans.from_position_ids(position_ids) if packed and attention_mask is None else None
    masks: dict[int | None, torch.Tensor | DocumentSpans | None] = {}
    mask_inputs = None
    for window in {args.window_of(i) for i in layers}:
        if window is None and attention_mask is None and start == 0 and not packed:
            masks[window] = None
        elif spans is not None and (window is None or spans.max_len <= window):
            masks[window] = spans  # a window no document reaches does not bite
        else:
            if mask_inputs is None:
                # Without a cache the queries are the keys, so one document-id tensor serves both.
                docs = torch.cumsum(position_ids == 0, dim=1) if packed else None
                mask_inputs = (torch.arange(start, start + T, device=device)[None],
                               torch.arange(start + T, device=device)[None], attention_mask, docs, docs)
            masks[window] = build_attention_mask(*mask_inputs, window)
    return masks


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # No init here (values come from init_weights or a checkpoint): nn.Embedding's own, a normal_
        # on the meta device every model is built on, would import torch._dynamo (1 s of start-up)
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size,
                                  _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()
        inv_freq, self.rope_scale = self._rope_frequencies()
        self.register_buffer("inv_freq", inv_freq.to(self.embed.weight.device), persistent=False)

    def _rope_frequencies(self) -> tuple[torch.Tensor, float]:
        """(inv_freq (head_dim // 2,) fp32, the attention scale of cos/sin) for self.args: the one
        place they are computed (at construction, and again whenever inv_freq must be rebuilt)."""
        a = self.args
        return rope_frequencies(a.head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings)

    def tie_weights(self) -> None:
        """Share the embedding with the output head when configured. Call again after anything
        that re-creates parameters (`to_empty`, `load_state_dict(assign=True)`): they untie."""
        if self.args.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random init (normal(0, initializer_range), norms at one): for models built on `meta`
        and materialized with `to_empty`, or trained from scratch."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            p.copy_(self.initial_value(name, p.shape, gen))
        self.init_buffers()

    def initial_value(self, name: str, shape: torch.Size, gen: torch.Generator | None) -> torch.Tensor:
        """Parameter `name`'s whole initial value (fp32, on CPU), drawn from `gen` for weights
        only: init_weights takes them in named_parameters order; a sharded model built on `meta`
        takes the same ones and keeps its part of each (posttrain.core.parallel.materialize)."""
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        return torch.randn(shape, generator=gen) * self.args.initializer_range

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute non-parameter state: RoPE frequencies (fp32) and MoE routing buffers."""
        device = next(self.parameters()).device  # (a pipeline stage's part may have no embedding)
        self.inv_freq = self._rope_frequencies()[0].to(device)
        for m in self.moe_layers():
            m.router.expert_bias = torch.zeros(m.args.num_experts, device=device)
            m.tokens_per_expert = torch.zeros(m.args.num_experts, device=device)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states (B, T, hidden).

        input_ids (B, T). position_ids (B, T): positions; a reset to 0 starts a new packed
        document (ignored for that purpose when decoding with a cache). attention_mask (B, S):
        1 for real tokens, 0 for padding, over every slot the keys will cover (S = cache length +
        T with a cache, else T)."""
        B, T = input_ids.shape
        device = input_ids.device
        start = cache.length if cache is not None else 0
        slots = torch.arange(start, start + T, device=device)[None]
        packed = position_ids is not None and cache is None
        if position_ids is None:
            position_ids = slots.expand(B, T)
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, self.rope_scale, x.dtype)

        masks = attention_masks(self.args, list(range(len(self.layers))), position_ids if packed else None, T,
                                start, attention_mask, device)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, masks[self.args.window_of(i)], cache)
        if cache is not None:
            cache.length += T
        return self.norm(x)

    def _apply(self, fn, recurse=True):
        # Keep the RoPE frequencies in fp32 whatever dtype the weights are cast to.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and not self.inv_freq.is_meta:
            self.inv_freq = self._rope_frequencies()[0].to(self.inv_freq.device)
        # expert_bias must stay fp32 too: a bf16 bias cannot represent small balancing steps.
        for m in self.moe_layers():
            if m.router.expert_bias.is_floating_point() and m.router.expert_bias.dtype != torch.float32:
                m.router.expert_bias = m.router.expert_bias.float()
        return self

    @property
    def output_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def forward(self, input_ids, position_ids=None, attention_mask=None, cache=None, head=None):
        """Logits (B, T, vocab); or, given `head`, head(hidden_states, output_weight).

        `head` runs the loss inside forward (fused/chunked cross entropy, log-probs, KL), so the
        full logits never exist and parallel wrappers (FSDP, TP) see one forward call. A model
        split into pipeline stages (posttrain.core.parallel.pipeline.keep_own_stages) runs its stages in
        turn with the pipeline's other ranks (posttrain.core.parallel.pipeline_decode), no cache."""
        staged = getattr(self, "staged_forward", None)  # set by keep_own_stages
        if staged is not None:
            if cache is not None:
                raise ValueError("a pipeline-parallel model decodes through posttrain.core.model.generate")
            return staged(input_ids, position_ids, attention_mask, head)
        hidden = self.hidden_states(input_ids, position_ids, attention_mask, cache)
        if head is not None:
            return head(hidden, self.lm_head.weight)
        return self.lm_head(hidden)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def aux_loss(self) -> torch.Tensor | None:
        """Sum over MoE layers of coef * load-balancing loss from the last forward."""
        losses = [m.aux_loss * m.args.aux_loss_coef for m in self.moe_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None


def build_model(args: ModelArgs, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = 0) -> Transformer:
    """Build on the meta device, then materialize and initialize (cheap for large shapes)."""
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model.to(dtype)
