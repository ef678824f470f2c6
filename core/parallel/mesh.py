"""The device mesh, from the torchrun environment.

World ranks are laid out as (pp, dp_replicate, dp_shard, cp, tp), outermost first: tp is
innermost so its heavy, latency-bound collectives stay inside a node, pp outermost so only its
point-to-point traffic crosses the slowest links (torchtitan's and Megatron's order).

Expert parallelism borrows ranks instead of adding a dimension: the dp_shard * cp ranks that hold
the same non-expert weights are split into groups of `ep` consecutive ranks, and each group shares
out the experts (torchtitan's `dp_shard_in_ep`). That gives a second mesh over the same ranks,
(dp_replicate, dp_shard_mod_ep, ep) within each (pp, tp) slice, on which expert weights live.

Every layout is validated (ParallelConfig.resolve / validate_for_model plus the shape checks
below) before any process group exists, so a bad config fails with one clear message instead of
a hang or a shape error deep inside a collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.model.args import ModelArgs

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Concrete, validated sizes of every mesh dimension."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, model: ModelArgs | None = None) -> ParallelDims:
        """Sizes for `world_size` ranks; ValueError naming the problem if the layout cannot work
        (for `model`, when given)."""
        sizes = cfg.resolve(world_size)
        dims = cls(**sizes)
        if model is not None:
            n_experts = model.moe.num_experts if model.moe is not None else 0
            cfg.validate_for_model(model.num_heads, model.num_kv_heads, n_experts)
            dims._validate_shapes(model, cfg.pp_stages_per_rank)
        if dims.dp_replicate > 1 and dims.dp_shard * dims.cp == 1 and (dims.tp > 1 or dims.ep > 1):
            raise ValueError(f"dp_replicate={dims.dp_replicate} alone is DDP, which does not compose with "
                             "tp/ep here; shard instead (dp_shard > 1), or use HSDP (dp_replicate and dp_shard)")
        return dims

    def _validate_shapes(self, m: ModelArgs, stages_per_rank: int) -> None:
        """Divisibility the parallel layers need, beyond heads (checked by the config)."""
        tp = self.tp
        checks = [("vocab_size", m.vocab_size, tp, "the embedding and lm_head are split by vocab over tp"),
                  ("intermediate_size", m.intermediate_size, tp, "the MLP is split over tp")]
        stages = self.pp * stages_per_rank
        if self.pp > 1 and m.num_layers < stages:
            raise ValueError(f"pp={self.pp} x pp_stages_per_rank={stages_per_rank} = {stages} stages, "
                             f"but the model has only num_layers={m.num_layers}")
        for name, value, n, why in checks:
            if value % n:
                raise ValueError(f"tp={n} does not divide the model's {name}={value}: {why}")
        if self.cp > 1 and m.sliding_window:
            raise ValueError(f"cp={self.cp}: ring attention does not support sliding_window="
                             f"{m.sliding_window} yet; use cp=1 for this model")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different batches of data (cp ranks share one batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """Parameters are sharded over dp_shard * cp (cp ranks hold the same weights)."""
        return self.dp_shard * self.cp > 1

    @property
    def ddp(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard * self.cp // self.ep

    def describe(self) -> str:
        return ", ".join(f"{k}={getattr(self, k)}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"))


class ParallelMesh:
    """The world DeviceMesh with named 1-D (and flattened) sub-meshes, plus the expert mesh.

    mesh["tp"], mesh["pp"], ... are 1-D meshes; derived ones: "dp" (dp_replicate x dp_shard: data
    loading), "dp_shard_cp" (FSDP sharding), "dp_cp" (ranks with distinct tokens before tp),
    "cp_tp" (ranks holding pieces of the same sequences), "dp_cp_tp" (every rank of a pipeline
    stage), "hsdp" (dp_replicate x dp_shard_cp), and, with experts, "ep" and "dp_shard_mod_ep"
    from the expert mesh.
    """

    def __init__(self, dims: ParallelDims, device_type: str):
        self.dims, self.device_type = dims, device_type
        shape = tuple(getattr(dims, d) for d in MESH_DIMS)
        self.world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        self._sub: dict[str, DeviceMesh] = {d: self.world[d] for d in MESH_DIMS}
        self._sub["dp"] = self.world["dp_replicate", "dp_shard"]._flatten("dp")
        self._sub["dp_shard_cp"] = self.world["dp_shard", "cp"]._flatten("dp_shard_cp")
        self._sub["dp_cp"] = self.world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        self._sub["cp_tp"] = self.world["cp", "tp"]._flatten("cp_tp")
        self._sub["dp_cp_tp"] = self.world["dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp")
        self.expert: DeviceMesh | None = None
        if dims.ep > 1:
            # The dp_replicate x dp_shard x cp ranks, regrouped with ep consecutive ranks innermost.
            self.expert = self["dp_cp"]._unflatten(
                0, (dims.dp_replicate, dims.dp_shard_mod_ep, dims.ep), ("dp_replicate", "dp_shard_mod_ep", "ep"))
            self._sub["ep"] = self.expert["ep"]
            self._sub["dp_shard_mod_ep"] = self.expert["dp_shard_mod_ep"]
        if dims.dp_replicate > 1:  # built now: creating groups is collective, so never lazily
            self._sub["hsdp"] = self["dp_cp"]._unflatten(
                0, (dims.dp_replicate, dims.dp_shard * dims.cp), ("dp_replicate", "dp_shard_cp"))

    def __getitem__(self, name: str) -> DeviceMesh:
        if name not in self._sub:
            raise KeyError(f"no mesh dimension {name!r}; have {sorted(self._sub)}")
        return self._sub[name]

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()

    def fsdp_mesh(self) -> DeviceMesh:
        """Where non-expert weights are sharded: 1-D (dp_shard_cp) for FSDP, 2-D
        (dp_replicate, dp_shard_cp) for HSDP (replicate across groups, shard within one)."""
        return self["hsdp"] if self.dims.dp_replicate > 1 else self["dp_shard_cp"]

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """Where expert weights (already split over ep) are sharded: dp_shard_mod_ep, with
        dp_replicate in front for HSDP."""
        assert self.expert is not None
        if self.dims.dp_replicate == 1:
            return self.expert["dp_shard_mod_ep"]
        return self.expert["dp_replicate", "dp_shard_mod_ep"]

    def __repr__(self) -> str:
        return f"ParallelMesh({self.dims.describe()}, device={self.device_type})"


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def read(cls) -> TorchrunEnv:
        """RANK / WORLD_SIZE / LOCAL_RANK as torchrun sets them; a plain `python` run is rank 0 of 1."""
        try:
            env = cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                      int(os.environ.get("LOCAL_RANK", 0)))
        except ValueError as e:
            raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {e}") from None
        if not 0 <= env.rank < env.world_size:
            raise ValueError(f"RANK={env.rank} is outside WORLD_SIZE={env.world_size}")
        return env


def pick_device(cfg: ParallelConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(cfg: ParallelConfig, timeout_s: float | None = None,
                       always: bool = False) -> tuple[TorchrunEnv, torch.device]:
    """Join torchrun's process group: the one place posttrain makes one. The backend is
    `cfg.backend` ('auto': nccl on CUDA, gloo elsewhere), on `cfg.device`; `timeout_s` is the
    collective timeout (ReliabilityConfig.collective_timeout_s), and torch's flight recorder is
    on (posttrain.core.reliability.prepare_process_group). A single process gets no group unless `always`."""
    from posttrain.core.reliability import prepare_process_group

    env = TorchrunEnv.read()
    device = pick_device(cfg, env.local_rank)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("backend='nccl' needs CUDA devices; use gloo on CPU")
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks but WORLD_SIZE={env.world_size}")
    elif env.world_size > 1 or always:
        if "MASTER_ADDR" not in os.environ and env.world_size == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                **prepare_process_group(timeout_s))
    return env, device


def init_distributed(cfg: ParallelConfig, model: ModelArgs | None = None,
                     timeout_s: float | None = None) -> tuple[ParallelMesh, torch.device]:
    """Validate the layout for this world (against `model` when given), then join the process
    group (init_process_group; also for one process) and build the mesh."""
    dims = ParallelDims.from_config(cfg, TorchrunEnv.read().world_size, model)  # raises before any group
    _, device = init_process_group(cfg, timeout_s, always=True)
    return ParallelMesh(dims, device.type), device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
