"""Pipeline parallelism on torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B).

The model is split by hand: a `PipelineStageModule` holds a contiguous run of the model's blocks
(under their original names, `layers.<i>`, so checkpoints and TP plans apply unchanged), plus the
embedding on the first stage and the final norm + lm_head on the last. Each stage recomputes RoPE
and masks from the positions it is given (cheap, and nothing but hidden states cross stages).
With the interleaved schedule rank r holds stages r, r + pp, r + 2 pp, ... (looped placement).

The loss runs on the last stage, per microbatch (`loss_fn(logits, target)`, a mean); the schedule
scales gradients by 1/microbatches, so a step equals one full-batch step. MoE load-balancing
losses live on whichever stage holds the layer: `_AttachAux` ties each block's aux loss to its
output, so the backward that reaches the block also adds the aux gradient (Megatron's
MoEAuxLossAutoScaler) and the trainer must not add model.aux_loss() again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from core.parallel.config import ParallelConfig
from core.model.model import Transformer, attention_masks
from core.model.moe import MoE
from core.model.rope import rope_cos_sin
from core.parallel.mesh import ParallelMesh

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class _AttachAux(torch.autograd.Function):
    """Identity on x forward; backward also seeds d(aux) = 1, so aux's gradient flows."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor) -> Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        shape, dtype, device = ctx.aux_meta
        return g, torch.ones(shape, dtype=dtype, device=device)


class PipelineStageModule(nn.Module):
    """Blocks `layer_ids` of `model` (shared, not copied), with the embedding if first and the
    norm + lm_head if last. forward(input_ids | hidden, position_ids=None)."""

    def __init__(self, model: Transformer, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.args = model.args
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("inv_freq", model.inv_freq.detach().clone(), persistent=False)
        self.rope_scale = model.rope_scale
        self.sequence_split = 1  # tp under sequence parallelism: hidden states arrive split by sequence
        self.cp_state: dict | None = None
        self.cp_group = None
        self.aux_loss_sum = torch.zeros(())  # detached, summed over this step's microbatches (logging)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, x: Tensor, position_ids: Tensor | None = None):
        if self.embed is not None:
            T = x.shape[1]
            x = self.embed(x)
        else:
            T = x.shape[1] * self.sequence_split
        B = x.shape[0]
        slots = torch.arange(T, device=x.device)[None]
        packed = position_ids is not None
        cos, sin = rope_cos_sin(self.inv_freq, position_ids if packed else slots.expand(B, T), self.rope_scale,
                                x.dtype)
        if self.cp_state is not None:
            from core.parallel.context import cp_batch

            self.cp_state["batch"] = cp_batch(position_ids, T, self.cp_group)
        masks = attention_masks(self.args, [int(name) for name in self.layers], position_ids, T, device=x.device)
        for name, layer in self.layers.items():
            x = layer(x, cos, sin, masks[self.args.window_of(int(name))])
            aux = [m.aux_loss * m.args.aux_loss_coef for m in layer.modules()
                   if isinstance(m, MoE) and m.aux_loss is not None and m.aux_loss.requires_grad]
            if aux and torch.is_grad_enabled():
                aux = torch.stack(aux).sum()
                self.aux_loss_sum = self.aux_loss_sum + aux.detach()
                x = _AttachAux.apply(x, aux)
        if self.lm_head is not None:
            return self.lm_head(self.norm(x))
        x = x.contiguous()  # sent as is to the next stage (a sequence-split x may be a strided view)
        return (x, position_ids) if packed else x


def split_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous, as even as possible; earlier stages take the remainder (the last one also
    holds the lm_head)."""
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


@dataclass
class Pipeline:
    schedule: object
    stages: list[PipelineStage]
    modules: list[PipelineStageModule]
    is_first: bool
    is_last: bool

    microbatches: int = 1

    def step(self, *inputs: Tensor, target: Tensor | None = None) -> Tensor | None:
        """One forward + backward over all microbatches. inputs go in on the first stage (input_ids
        [, position_ids]), target on the last; returns the mean microbatch loss on the last stage
        (without MoE aux losses: see `aux_loss`)."""
        for m in self.modules:
            m.aux_loss_sum = torch.zeros(())
        losses: list[Tensor] = []
        self.schedule.step(*(inputs if self.is_first else ()), target=target if self.is_last else None,
                           losses=losses)
        return torch.stack(losses).mean() if self.is_last else None

    def aux_loss(self) -> Tensor:
        """This rank's stages' share of the last step's MoE aux loss (microbatch mean, detached);
        summed over the pp ranks it is what model.aux_loss() adds to the loss without pipelining."""
        return sum(m.aux_loss_sum for m in self.modules) / self.microbatches


def _stage_metas(mod: PipelineStageModule, mb: int, seq: int, packed: bool, dtype: torch.dtype, tp: int, dev):
    """Example (meta) inputs and outputs of a stage, so PipelineStage skips its shape-inference
    forward: that would run the blocks once more (on uninitialized tensors for later stages),
    bumping MoE token counts and aux-loss sums with garbage."""
    args = mod.args
    # requires_grad marks what carries gradients between stages (received activations included).
    hidden = torch.empty(mb, seq // mod.sequence_split, args.hidden_size, dtype=dtype, device=dev,
                         requires_grad=True)
    pos = (torch.empty(mb, seq, dtype=torch.long, device=dev),) if packed else ()
    first = torch.empty(mb, seq, dtype=torch.long, device=dev) if mod.embed is not None else hidden
    out = (torch.empty(mb, seq, args.vocab_size // tp, dtype=dtype, device=dev, requires_grad=True),) \
        if mod.lm_head is not None \
        else (hidden,) + pos
    return (first,) + pos, out


def build_pipeline(model: Transformer, cfg: ParallelConfig, mesh: ParallelMesh, loss_fn: Callable,
                   device: torch.device, microbatch_size: int, seq_len: int, packed: bool = False,
                   parallelize_stage: Callable[[nn.Module], nn.Module] | None = None) -> Pipeline:
    """Split `model` into this rank's stages, parallelize each (TP/EP/CP/FSDP via
    `parallelize_stage`), and wrap them in the configured schedule. Every step must feed
    microbatches of `microbatch_size` sequences of `seq_len` tokens (this rank's context-parallel
    shard), with position_ids iff `packed`."""
    pp, rank = mesh.size("pp"), mesh.local_rank("pp")
    if model.args.tie_embeddings and pp > 1:
        raise ValueError("tie_embeddings with pp > 1 puts one weight on the first and last stages; "
                         "not supported yet: untie it (tie_embeddings=False) or use pp=1")
    v = cfg.pp_stages_per_rank
    n = pp * v
    parts = split_layers(model.args.num_layers, n)
    ids = [rank + i * pp for i in range(v)]
    modules = [PipelineStageModule(model, parts[s], s == 0, s == n - 1) for s in ids]
    if parallelize_stage is not None:
        modules = [parallelize_stage(m) for m in modules]
    dtype = next(model.parameters()).dtype
    stages = []
    for m, s in zip(modules, ids):
        inputs, outputs = _stage_metas(m, microbatch_size, seq_len, packed, dtype, mesh.size("tp"), device)
        grads = lambda ts: tuple(t if t.is_floating_point() else None for t in ts)  # noqa: E731
        stages.append(PipelineStage(m, s, n, device, input_args=inputs, output_args=outputs,
                                    input_grads=grads(inputs), output_grads=grads(outputs), group=mesh.group("pp")))
    microbatches = cfg.pp_microbatches or pp
    cls = SCHEDULES[cfg.pp_schedule]
    schedule = cls(stages if cfg.pp_schedule == "interleaved_1f1b" else stages[0], microbatches, loss_fn=loss_fn)
    return Pipeline(schedule, stages, modules, is_first=0 in ids, is_last=n - 1 in ids, microbatches=microbatches)
