"""ParallelConfig: the mesh posttrain.core.parallel builds (sizes resolved against the world and the model)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.core.config import ConfigModel, Dtype


class ParallelConfig(ConfigModel):
    dp_replicate: int = Field(1, ge=1, description="Data-parallel replicas (DDP / HSDP replicate).")
    dp_shard: int = Field(-1, description="FSDP shard size; -1 = whatever the other sizes leave.")
    tp: int = Field(1, ge=1, description="Tensor-parallel size; must divide the attention and KV heads.")
    pp: int = Field(1, ge=1, description="Pipeline-parallel stages.")
    cp: int = Field(1, ge=1, description="Context-parallel size (ring attention over the sequence).")
    ep: int = Field(1, ge=1, description="Expert-parallel size, carved out of dp_shard*cp ranks.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field("1f1b", description="Schedule.")
    pp_microbatches: int | None = Field(None, gt=0, description="Microbatches per pipeline step; None = pp.")
    pp_stages_per_rank: int = Field(1, ge=1, description="Virtual stages per rank (interleaved_1f1b: >= 2).")
    sequence_parallel: bool = Field(True, description="With tp > 1, shard norm activations by sequence.")
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = Field(
        "default", description="Free gathered params after forward; 'default' = yes unless pp > 1.")
    mixed_precision_param: Dtype | None = Field(None, description="FSDP param dtype; None = model.dtype.")
    mixed_precision_reduce: Dtype | None = Field("float32", description="Grad reduce dtype; None = param.")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="'auto': nccl on CUDA, else gloo.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto': CUDA when available.")

    @field_validator("dp_shard")
    @classmethod
    def _dp_shard(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("dp_shard must be -1 (fill the world) or >= 1")
        return v

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.pp > 1 and (self.pp_schedule == "interleaved_1f1b") != (self.pp_stages_per_rank > 1):
            raise ValueError("pp_stages_per_rank > 1 goes with pp_schedule='interleaved_1f1b', and only it")
        return self

    def resolve(self, world_size: int) -> dict[str, int]:
        """Concrete mesh sizes for `world_size` ranks; ValueError naming the mismatch."""
        fixed = self.dp_replicate * self.cp * self.tp * self.pp
        layout = f"dp_replicate={self.dp_replicate} * cp={self.cp} * tp={self.tp} * pp={self.pp}"
        if self.dp_shard == -1:
            if world_size % fixed:
                raise ValueError(f"world size {world_size} is not divisible by {layout} = {fixed}")
            dp_shard = world_size // fixed
        else:
            dp_shard = self.dp_shard
            if dp_shard * fixed != world_size:
                raise ValueError(f"{layout} * dp_shard={dp_shard} = {dp_shard * fixed} ranks, but the "
                                 f"world size is {world_size}; set dp_shard=-1 to fill it")
        if (dp_shard * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp_shard*cp = {dp_shard}*{self.cp}: expert "
                             "parallelism reuses the data/context-parallel ranks")
        mb = self.pp_microbatches or self.pp
        if self.pp > 1 and self.pp_schedule != "gpipe" and mb < self.pp:
            raise ValueError(f"pp_schedule={self.pp_schedule!r} needs pp_microbatches >= pp={self.pp}")
        if self.pp > 1 and self.pp_schedule == "interleaved_1f1b" and mb % self.pp:
            raise ValueError(f"interleaved_1f1b needs pp_microbatches ({mb}) divisible by pp={self.pp}")
        return {"dp_replicate": self.dp_replicate, "dp_shard": dp_shard, "cp": self.cp,
                "tp": self.tp, "pp": self.pp, "ep": self.ep}

    def validate_for_model(self, n_heads: int, n_kv_heads: int, n_experts: int = 0) -> None:
        """ValueError when the model cannot be split this way (heads over tp, experts over ep)."""
        for what, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if n % self.tp:
                ok = [d for d in range(1, n_kv_heads + 1) if n_heads % d == 0 and n_kv_heads % d == 0]
                raise ValueError(f"tp={self.tp} does not divide the model's {what}={n} "
                                 f"(n_heads={n_heads}, n_kv_heads={n_kv_heads}); valid tp: {ok}")
        if self.ep > 1 and not n_experts:
            raise ValueError(f"ep={self.ep} but the model is dense (no experts); set ep=1")
        if n_experts and n_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the model's n_experts={n_experts}")

