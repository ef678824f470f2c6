"""Pipeline parallelism on torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B).

The model is split by hand: a `PipelineStageModule` holds a contiguous run of the model's blocks
(under their original names, `layers.<i>`, so checkpoints and TP plans apply unchanged), plus the
embedding on the first stage and the final norm + lm_head on the last. Each stage recomputes RoPE
and masks from the positions it is given (cheap, and nothing but hidden states cross stages).
With the interleaved schedule rank r holds stages r, r + pp, r + 2 pp, ... (looped placement).

The loss runs on the last stage, per microbatch (`loss_fn(logits, target)`): a mean, which the
schedule scales by 1/microbatches so a step equals one full-batch step; or, with
`scale_grads=False`, a token *sum* the trainer normalizes once per step (the training stages:
posttrain.core.pipeline_objectives.pipelined_sft). MoE load-balancing losses live on whichever stage holds the
layer: `_AttachAux` ties each block's aux loss to its output, so the backward that reaches the
block also adds the aux gradient (Megatron's MoEAuxLossAutoScaler), weighted per microbatch
(`aux_weights`: 1, or its token count when the loss is a sum), and the trainer must not add
model.aux_loss() again.

A training stage builds the whole model on the meta device, splits it here, and keeps only this
rank's part (`keep_own_stages`): the model object then holds its stages' modules under their
own names, so checkpoints, optimizers and exports see this rank's share of the one model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.model.model import Transformer, attention_masks
from posttrain.core.model.moe import MoE, routed_tokens
from posttrain.core.model.rope import rope_cos_sin, rope_frequencies
from posttrain.core.parallel.mesh import ParallelMesh

if TYPE_CHECKING:
    from posttrain.core.parallel.pipeline_stage import AccumulatingStage


class _AttachAux(torch.autograd.Function):
    """Identity on x forward; backward also seeds d(aux) = weight, so aux's gradient flows."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor, weight: float) -> Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device, weight)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        shape, dtype, device, weight = ctx.aux_meta
        return g, torch.full(shape, weight, dtype=dtype, device=device), None


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
        self.aux_weights: list[float] | None = None  # per microbatch of the step (None: 1 each)
        self.token_masks: tuple[Tensor, ...] | None = None  # per microbatch: its real tokens (MoE balancing)
        self.routes: tuple[Tensor, ...] | None = None  # per microbatch: each token's adapter (several adapters)
        self.adapter_names: list[str] | None = None
        self.forwards = 0  # this step's forwards so far: the schedules run a stage's microbatches in order

    @torch.no_grad()
    def init_buffers(self, device: torch.device) -> None:
        """RoPE frequencies again (a stage split from a model on `meta` copied meta ones)."""
        a = self.args
        self.inv_freq = rope_frequencies(a.head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings)[0].to(
            device)

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
            from posttrain.core.parallel.context import cp_batch

            self.cp_state["batch"] = cp_batch(position_ids, T, self.cp_group)
        masks = attention_masks(self.args, [int(name) for name in self.layers], position_ids, T, device=x.device)
        weight = 1.0 if self.aux_weights is None else self.aux_weights[self.forwards]
        real = None if self.token_masks is None else self.token_masks[self.forwards].to(x.device)
        route = contextlib.nullcontext()
        if self.routes is not None:  # several adapters: this microbatch's tokens each through its own
            from posttrain.core.lora.model import route_adapters

            route = route_adapters(self, self.routes[self.forwards].to(x.device), self.adapter_names)
        self.forwards += 1
        with routed_tokens(self, real), route:  # MoE balancing and counts see only this microbatch's real tokens
            x = self._blocks(x, cos, sin, masks, weight)
        if self.lm_head is not None:
            return self.lm_head(self.norm(x))
        x = x.contiguous()  # sent as is to the next stage (a sequence-split x may be a strided view)
        return (x, position_ids) if packed else x

    def _blocks(self, x: Tensor, cos: Tensor, sin: Tensor, masks: dict, weight: float) -> Tensor:
        for name, layer in self.layers.items():
            x = layer(x, cos, sin, masks[self.args.window_of(int(name))])
            aux = [m.aux_loss * m.args.aux_loss_coef for m in layer.modules()
                   if isinstance(m, MoE) and m.aux_loss is not None and m.aux_loss.requires_grad]
            if aux and torch.is_grad_enabled():
                aux = torch.stack(aux).sum()
                self.aux_loss_sum = self.aux_loss_sum + aux.detach()
                x = _AttachAux.apply(x, aux, weight)
        return x


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
    stages: list[AccumulatingStage]
    modules: list[PipelineStageModule]
    is_first: bool
    is_last: bool

    microbatches: int = 1
    microbatch_size: int = 1  # rows of a microbatch (the fixed shape every step runs on)
    seq_len: int = 0
    tied_group: object = None  # tied embeddings: the first and last pipeline ranks, whose copies' gradients are summed
    adapter_names: list[str] | None = None  # several adapters trained at once, while `routing` them

    @contextlib.contextmanager
    def routing(self, names: list[str]):
        """Within it, steps route each token to its adapter (`step(adapter_ids=...)`, indices into names)."""
        prev, self.adapter_names = self.adapter_names, list(names)
        try:
            yield
        finally:
            self.adapter_names = prev

    @property
    def tied(self) -> list:
        """This rank's copies of tied embeddings (the embedding and/or the head), looked up now:
        materializing a model built on meta replaces its parameters."""
        if self.tied_group is None:
            return []
        return [m.embed.weight for m in self.modules if m.embed is not None] + \
            [m.lm_head.weight for m in self.modules if m.lm_head is not None]

    def reduce_tied_grads(self) -> None:
        """Tied embeddings: sum the embedding's and the head copy's gradients (first and last
        stage), as the one shared weight gets on one process; then both take the same step.
        Once per optimizer step, after the last micro-batch's backward. Collective over the ends."""
        import torch.distributed as dist

        if self.tied_group is None or not self.tied:  # middle stages hold neither end
            return
        (w,) = self.tied  # looped placement: the ends are on different ranks
        if not w.requires_grad:  # frozen (LoRA): nothing to keep equal
            return
        g = w.grad if w.grad is not None else torch.zeros_like(w)
        w.grad = g
        dist.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=self.tied_group)

    @property
    def duplicates(self) -> list:
        """Parameters whose gradient another rank also holds (the last stage's head copy of tied
        embeddings): counted once in the global gradient norm."""
        return [m.lm_head.weight for m in self.modules if m.lm_head is not None] if self.tied_group is not None \
            else []

    def step(self, *inputs: Tensor, target: Tensor | None = None, aux_weights: list[float] | None = None,
             token_mask: Tensor | None = None, adapter_ids: Tensor | None = None,
             backward: bool = True) -> Tensor | None:
        """One forward + backward over all microbatches (forward only: backward=False). inputs go
        in on the first stage (input_ids [, position_ids]), target on the last; returns the
        microbatch losses (M,) on the last stage, None elsewhere (without MoE aux losses: see
        `aux_loss`). aux_weights: what each microbatch's aux-loss gradient is scaled by;
        token_mask: (rows, seq) True at the real tokens, the only ones MoE balancing counts (every
        stage has it: nothing but hidden states crosses stages, and each stage runs its
        microbatches in order); adapter_ids: (rows, seq) each token's adapter, an index into
        `adapter_names` (-1: none), inside `routing`."""
        masks = None if token_mask is None else token_mask.chunk(self.microbatches)
        if adapter_ids is not None and self.adapter_names is None:
            raise ValueError("Pipeline.step(adapter_ids=...) outside Pipeline.routing(names)")
        routes = None if adapter_ids is None else adapter_ids.chunk(self.microbatches)
        for m in self.modules:
            m.aux_loss_sum = torch.zeros(())
            m.aux_weights, m.token_masks, m.forwards = aux_weights, masks, 0
            m.routes, m.adapter_names = routes, self.adapter_names
        losses: list[Tensor] = []
        run = self.schedule.step if backward else self.schedule.eval
        run(*(inputs if self.is_first else ()), target=target if self.is_last else None, losses=losses)
        return torch.stack([loss.detach() for loss in losses]) if self.is_last else None

    def aux_loss(self) -> Tensor:
        """This rank's stages' share of the last step's MoE aux loss (microbatch mean, detached);
        summed over the pp ranks it is what model.aux_loss() adds to the loss without pipelining."""
        return sum(m.aux_loss_sum for m in self.modules) / self.microbatches

    def init_buffers(self, device: torch.device) -> None:
        for m in self.modules:
            m.init_buffers(device)

    def claim_fsdp_roots(self) -> None:
        """Make each FSDP-wrapped stage of this rank its FSDP root now. FSDP takes the first module
        to run forward for the root, and code that calls a stage's parts directly (the stage walk
        of posttrain.core.parallel.pipeline_decode) would make a block the root, after which a forward
        through the stage fails. Idempotent."""
        for m in self.modules:
            if isinstance(m, FSDPModule):
                fully_shard.state(m)._lazy_init()


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
                   parallelize_stage: Callable[[nn.Module], nn.Module] | None = None,
                   scale_grads: bool = True) -> Pipeline:
    """Split `model` into this rank's stages, parallelize each (TP/EP/CP/FSDP via
    `parallelize_stage`), and wrap them in the configured schedule. Every step must feed
    microbatches of `microbatch_size` sequences of `seq_len` tokens (this rank's context-parallel
    shard), with position_ids iff `packed`. scale_grads=False: the loss is a sum the caller
    normalizes (the schedule then leaves gradients as the microbatches' sum). A model with tied
    embeddings gets an lm_head copy of the embedding on the last stage, which the caller keeps
    equal: Pipeline.reduce_tied_grads before every optimizer step, and the head copy left out of
    the gradient norm (Pipeline.duplicates; posttrain.core.trainer.Trainer does both)."""
    from posttrain.core.parallel.pipeline_stage import SCHEDULES, AccumulatingStage  # torch's pipelining: 0.7 s to import

    pp, rank = mesh.size("pp"), mesh.local_rank("pp")
    tied = model.args.tie_embeddings and pp > 1
    if tied:  # a copy on each end, kept equal: their gradients are summed (Pipeline.reduce_tied_grads)
        model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone(),
                                            requires_grad=model.embed.weight.requires_grad)
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
        stages.append(AccumulatingStage(m, s, n, device, input_args=inputs, output_args=outputs,
                                    input_grads=grads(inputs), output_grads=grads(outputs), group=mesh.group("pp")))
    microbatches = cfg.pp_microbatches or pp
    cls = SCHEDULES[cfg.pp_schedule]
    schedule = cls(stages if cfg.pp_schedule == "interleaved_1f1b" else stages[0], microbatches, loss_fn=loss_fn,
                   scale_grads=scale_grads)
    pipe = Pipeline(schedule, stages, modules, is_first=0 in ids, is_last=n - 1 in ids, microbatches=microbatches,
                    microbatch_size=microbatch_size, seq_len=seq_len)
    if tied:
        pipe.tied_group = _ends_group(mesh)
    return pipe


def _ends_group(mesh: ParallelMesh):
    """The group of this rank's first and last pipeline ranks (same dp / cp / tp coordinates):
    every rank takes part in making every such group, as torch.distributed requires."""
    import torch.distributed as dist

    pp = mesh.size("pp")
    if pp == 2:
        return mesh.group("pp")
    grid = mesh.world.mesh.reshape(pp, -1)  # (pp, every other coordinate)
    mine = None
    for column in grid.t().tolist():
        group = dist.new_group([column[0], column[-1]])
        if dist.get_rank() in (column[0], column[-1]):
            mine = group
    return mine


def keep_own_stages(model: Transformer, pipe: Pipeline) -> None:
    """Drop from `model`, in place, every part this rank's stages do not hold: the other stages'
    blocks become empty modules (the kept ones keep their index, so their names are the whole
    model's), the embedding / final norm / head go where their stage is not this rank's. The
    model's parameters, state dict and optimizer are then exactly this rank's share. The whole
    model's parameter order is kept in `model.whole_parameters` ((name, shape), adapters apart)
    and `model.whole_adapters` ((module name, adapter, A's shape, init)), so a random init draws
    the same values as on one process (posttrain.core.parallel.materialize)."""
    from posttrain.core.lora.model import lora_modules, lora_parameters

    adapters = {id(p) for p in lora_parameters(model)}
    tied = model.args.tie_embeddings  # the head is a copy of the embedding (build_pipeline), not drawn
    model.whole_parameters = [(n, p.shape) for n, p in model.named_parameters()
                              if id(p) not in adapters and not (tied and n == "lm_head.weight")]
    model.whole_adapters = [(name, a, mod.lora_A[a].shape, mod.configs[a]["init_lora_weights"])
                            for name, mod in lora_modules(model) for a in mod.adapters]
    kept = {id(m) for stage in pipe.modules for m in stage.modules()}
    for i, layer in enumerate(model.layers):
        if id(layer) not in kept:
            model.layers[i] = nn.Module()
    for name in ("embed", "norm", "lm_head"):
        if id(getattr(model, name)) not in kept:
            setattr(model, name, None)
    model.pipeline = pipe
    from posttrain.core.parallel.pipeline_decode import StagedModel

    # model(...) for inference: the stages in turn with the pipeline's other ranks (Transformer.forward)
    model.staged_forward = lambda *args: StagedModel(model, pipe).forward(*args)
