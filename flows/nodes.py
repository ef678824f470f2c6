"""The nodes a pipeline is made of: a stage of one `kind` with that kind's settings (stages/config.py)
plus the node-only fields `kind`, `sweep` and (DPO) `rounds`."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, ValidationError

from posttrain.core.config import ConfigModel
from posttrain.stages.config import DataPrepConfig, DistillConfig, DPOConfig, EvalConfig, GRPOConfig, SFTConfig, StageConfig

NODE_NAME = r"^[A-Za-z][A-Za-z0-9_-]*$"
_NODE_FIELDS = ("kind", "sweep", "rounds")


class _NodeOptions(ConfigModel):
    sweep: dict[str, list[Any]] = Field(
        {}, description="Expand over the grid of these dotted keys' values, e.g. {lora.rank: [8, 16, 32]}.")


class DataPrepNode(DataPrepConfig, _NodeOptions):
    kind: Literal["data_prep"] = Field("data_prep", description="Tokenizer, data import or synthetic suite, splits.")


class SFTNode(SFTConfig, _NodeOptions):
    kind: Literal["sft"] = Field("sft", description="Supervised fine-tuning.")


class DistillNode(DistillConfig, _NodeOptions):
    kind: Literal["distill"] = Field("distill", description="Teacher -> student distillation.")


class DPONode(DPOConfig, _NodeOptions):
    kind: Literal["dpo"] = Field("dpo", description="Preference optimization.")
    rounds: int = Field(1, ge=1, le=100, description="Iterative DPO: K rounds, round k starting from (and, "
                                                     "on-policy, sampling with) round k-1's policy.")


class GRPONode(GRPOConfig, _NodeOptions):
    kind: Literal["grpo"] = Field("grpo", description="Reinforcement learning on the policy's own samples, rewarded "
                                                      "by a verifier (GRPO).")


class EvalNode(EvalConfig, _NodeOptions):
    kind: Literal["evaluate"] = Field("evaluate", description="Evaluate models side by side (and pick the best).")


NODE_CLASSES: dict[str, type[StageConfig]] = {
    "data_prep": DataPrepNode, "sft": SFTNode, "distill": DistillNode, "dpo": DPONode, "grpo": GRPONode,
    "evaluate": EvalNode}
Node = Annotated[Union[DataPrepNode, SFTNode, DistillNode, DPONode, GRPONode, EvalNode], Field(discriminator="kind")]


def stage_spec(node: StageConfig) -> StageConfig:
    """The stage config a node runs: the node minus its node-only fields (kind, sweep, rounds)."""
    from posttrain.stages.config import STAGE_CONFIGS

    data = node.model_dump(exclude=set(_NODE_FIELDS))
    return STAGE_CONFIGS[node.kind].model_validate(data)  # type: ignore[attr-defined]


def node_error(name: str, cls: type, e: ValidationError) -> str:
    """The node's validation errors with `nodes.<name>` in front of each key path (a check of the
    node as a whole: `nodes.<name>: problem`)."""
    from posttrain.core.config import _format

    return _format(cls, e, "", [], prefix=f"nodes.{name}")


def with_defaults(cls: type[StageConfig], node: dict[str, Any]) -> dict[str, Any]:
    """A node's settings merged key by key onto its kind's defaults, as load_config merges a file
    onto a schema's defaults: `lora: {rank: 8}` in a DPO node keeps DPO's `lora.enabled: true` (a
    partial section would otherwise start from the section's plain defaults), `data: prep` keeps
    the kind's data format. Shorthands (`model: student`) are written out first."""
    from posttrain.core.config import _expand_shorthand, _merge

    try:
        defaults = cls().model_dump(mode="json")
    except ValidationError:
        return node
    return _merge(defaults, {k: _expand_shorthand(cls, k, v) for k, v in node.items()})
