"""Token-by-token decoding of a pipeline-parallel model: the stages one after the other.

posttrain.core.model.generate drives the loop; this module is its forward under pipeline parallelism.
Every decode step (and the prefill before them) runs stage 0 on its rank, sends the hidden
states to the rank of stage 1, and so on to the last stage, whose rank computes the next-token
logits. Each rank keeps a KV cache for its own stages' layers only. The ranks of a pipeline all
decode the same rows, so the last stage's rank broadcasts the tokens it drew (and their
log-probs) to the others, which feed them to stage 0 next. No microbatches overlap: a stage is
idle while the others run, which is what "a stage-by-stage decode loop" costs; a generation
engine with continuous batching is the place for more.

`StagedModel.forward` is the same walk for a whole forward (no cache): what Transformer.forward
runs on a model split by keep_own_stages, so inference that calls the model (evaluation's
scoring, a judge) runs under pipeline parallelism unchanged; the last stage's result (the logits,
or what `head` makes of the hidden states) is broadcast to the pipeline's other ranks.

Under tensor parallelism inside the pipeline each rank runs its shard of the stage (heads split,
no sequence split while decoding: parallel.tensor's decode mode) and sends to the rank with the
same tp coordinate in the next stage; the last stage gathers its vocab-split logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.core.model.model import KVCache, Transformer, attention_masks
from posttrain.core.model.rope import rope_cos_sin

if TYPE_CHECKING:
    from posttrain.core.parallel.pipeline import Pipeline, PipelineStageModule


class StagedModel:
    """The forward generate() calls on a rank of a pipeline: its part of every step."""

    def __init__(self, model: Transformer, pipe: Pipeline):
        self.model = model
        self.group = pipe.stages[0].group
        self.pp = dist.get_world_size(self.group)
        self.n = pipe.stages[0].num_stages
        self.mine = {st.stage_index: mod for st, mod in zip(pipe.stages, pipe.modules)}
        self.layers = sorted(int(i) for mod in pipe.modules for i in mod.layers)
        # the activations' dtype and device: the first stage's parameters (it may hold no embedding)
        first = next(pipe.modules[0].parameters())
        self.device, self.dtype = first.device, first.dtype

    def owner(self, stage: int) -> int:
        """Global rank holding `stage` (looped placement: stage s on pp rank s % pp)."""
        return dist.get_global_rank(self.group, stage % self.pp)

    def cache(self, batch: int, max_len: int) -> KVCache:
        attn = self.model.layers[self.layers[0]].attn
        kv_heads = attn.k_proj.out_features // self.model.args.head_dim
        return KVCache.empty(self.model.args, batch, max_len, self.device, self.dtype, kv_heads=kv_heads,
                             layers=self.layers)

    def _walk(self, ids: Tensor, run) -> Tensor | None:
        """This rank's stages in order: each takes the previous stage's hidden states (from its
        rank; stage 0 the ids), runs `run(stage module, input)`, and sends its output on. The
        last stage's output on its rank, None on the others."""
        B, T = ids.shape
        out = None
        for s in range(self.n):
            if s not in self.mine:
                continue
            x = ids
            if s > 0:
                x = torch.empty(B, T, self.model.args.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(x, self.owner(s - 1), group=self.group)
            out = run(self.mine[s], x)
            if s < self.n - 1:
                dist.send(out.contiguous(), self.owner(s + 1), group=self.group)
                out = None
        return out

    def last_logits(self, ids: Tensor, positions: Tensor, mask: Tensor, cache: KVCache) -> Tensor | None:
        """(B, V) fp32 next-token logits on the last stage's rank; None on the others."""
        start = cache.length
        logits = self._walk(ids, lambda mod, x: _run(mod, x, positions, mask, cache, start))
        cache.length = start + ids.shape[1]
        return logits

    def forward(self, ids: Tensor, positions: Tensor | None = None, mask: Tensor | None = None,
                head=None) -> Tensor:
        """Transformer.forward through the stages: the logits (B, T, V), or head(hidden, weight),
        on every rank of the pipeline (computed on the last stage, broadcast). Positions mark
        packed documents as in Transformer.hidden_states; mask (B, T) the real tokens."""
        out = self._walk(ids, lambda mod, x: _run(mod, x, positions, mask, None, 0, head=head, whole=True))
        last = self.owner(self.n - 1)
        single = isinstance(out, Tensor)
        parts = (out,) if single else out  # a head may give a tuple of tensors
        meta = [(single, [(tuple(t.shape), t.dtype) for t in parts]) if out is not None else None]
        dist.broadcast_object_list(meta, last, group=self.group)
        single, shapes = meta[0]
        if out is None:
            parts = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes]
        for t in parts:
            dist.broadcast(t, last, group=self.group)
        return parts[0] if single else tuple(parts)

    def share(self, token: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
        """Every rank of the pipeline takes the last stage's tokens and their log-probs."""
        src = self.owner(self.n - 1)
        dist.broadcast(token, src, group=self.group)
        dist.broadcast(logp, src, group=self.group)
        return token, logp


def _run(mod: PipelineStageModule, x: Tensor, positions: Tensor | None, mask: Tensor | None,
         cache: KVCache | None, start: int, head=None, whole: bool = False) -> Tensor:
    """One stage on T new positions from cache slot `start`: its hidden states out; on the last
    stage the (B, V) fp32 logits of the last position (gathered over tp), or with `whole` the
    logits of every position (B, T, V/tp), or head(hidden, weight)."""
    args = mod.args
    if mod.embed is not None:
        x = mod.embed(x)
    B, T = x.shape[:2]
    packed = positions is not None and cache is None
    slots = torch.arange(start, start + T, device=x.device)[None].expand(B, T)
    cos, sin = rope_cos_sin(mod.inv_freq, positions if positions is not None else slots, mod.rope_scale, x.dtype)
    ids = [int(name) for name in mod.layers]
    masks = attention_masks(args, ids, positions if packed else None, T, start, mask, x.device)
    for name, layer in mod.layers.items():
        x = layer(x, cos, sin, masks[args.window_of(int(name))], cache)
    if mod.lm_head is None:
        return x
    if whole:
        h = mod.norm(x)
        return mod.lm_head(h) if head is None else head(h, mod.lm_head.weight)
    logits = mod.lm_head(mod.norm(x[:, -1])).float()
    group = getattr(mod.lm_head, "tp_group", None)
    if group is not None:
        from posttrain.core.parallel.mappings import all_gather

        logits = all_gather(logits, -1, group)
    return logits
