"""The deployments' run form and description, built from the config they serve.

Prefect renders a deployment's parameter schema (JSON schema) as its run form (the V2 UI's schema
form: each property a field, `position` orders them, an object with `properties` is a section, one
without is a JSON editor, `anyOf` is a set of tabs, a property not in its parent's `required`
gets "(Optional)" after its title) and validates a run's parameters against that schema when the
run is created (`enforce_parameter_schema`, on by default). The flow's own schema
(parameter_schema(post_training)) is generic: `nodes` is a mapping of any names, which the form can
only show as one JSON editor. A deployment serves one config, so its schema here is that config's:

  - `nodes` has one section per node of the served DAG (titled `teacher (SFT)`), with that kind's
    fields; more nodes can still be sent through the API (additionalProperties keeps the generic
    node schema);
  - in every section the everyday knobs come first (EVERYDAY: model, data, steps, learning rate,
    LoRA rank, the parallel layout), the rest after them in declaration order, and the sections
    only a few runs change (ADVANCED: checkpoint, reliability, a node's own launcher/tracking, ...)
    are JSON editors titled "Advanced: ...", one box each instead of a field per setting;
  - every field the form always fills (a scalar or a section with a default) is `required`, so
    "(Optional)" is left only on lists and mappings, which may be left empty;
  - `anyOf` tabs are titled ("None", "Text", ...) instead of the bare JSON types;
  - the serve-time settings (SERVE_ONLY: the cron schedule and its timezone) are neither in the
    schema nor in the parameters: a run never reads them.

Cross-field rules (val + test fractions <= 1, a layout the ranks can take, references between
nodes) are not JSON schema: the flow validates the whole PipelineConfig when the run starts and
fails in its first second naming the key path (posttrain.flows.pipeline, posttrain.core.config._format).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from posttrain.core.config import dump_config
from posttrain.core.titles import field_title
from posttrain.flows.config import PipelineConfig

SERVE_ONLY = ("schedule", "schedule_timezone")

# Per schema (definition name, or "*Node" for every node kind): the properties shown first, in order.
_NODE_FIRST = ["kind", "model", "teacher", "models", "data", "sources", "synthetic_size", "max_steps", "epochs",
               "optim", "lora", "parallel", "rounds", "pairs", "divergence", "metrics", "select"]
EVERYDAY: dict[str, list[str]] = {
    "PipelineConfig": ["name", "nodes", "workspace", "launcher", "tracking", "registry", "resources"],
    "*Node": _NODE_FIRST,
    "ModelConfig": ["name_or_path", "dtype"],
    "TeacherConfig": ["name_or_path", "dtype"],
    "DataConfig": ["sources", "max_seq_len", "micro_batch_size", "batch_tokens"],
    "OptimConfig": ["lr", "warmup_steps", "schedule", "weight_decay"],
    "LoRAConfig": ["enabled", "rank", "alpha", "dropout", "targets"],
    "ParallelConfig": ["dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"],
    "LauncherConfig": ["kind", "nproc_per_node", "nnodes"],
}
# Sections of a node (or of the pipeline) few runs change: a JSON editor each, after the rest.
ADVANCED: dict[str, list[str]] = {
    "*Node": ["checkpoint", "reliability", "launcher", "tracking", "sweep"],
    "LauncherConfig": ["slurm", "kubernetes", "env"],
}
_TAB = {"null": "None", "string": "Text", "integer": "Integer", "number": "Number", "boolean": "Yes / no",
        "array": "List", "object": "Mapping"}


def run_parameters(cfg: PipelineConfig) -> dict[str, Any]:
    """The deployments' parameters: the config as JSON, without the serve-time settings."""
    return {"config": {k: v for k, v in dump_config(cfg).items() if k not in SERVE_ONLY}}


def _rules(table: dict[str, list[str]], name: str) -> list[str]:
    return table.get(name) or (table["*Node"] if name.endswith("Node") and "*Node" in table else [])


def _resolve(prop: dict, defs: dict) -> dict:
    ref = prop.get("$ref")
    return defs[ref.rsplit("/", 1)[-1]] if isinstance(ref, str) else prop


def _always_filled(prop: dict, defs: dict) -> bool:
    """Whether the form always submits a value for `prop`, starting from the deployment's parameters
    (the whole config): a scalar, a nullable one (the None tab submits null) or a section. Lists and
    free-form mappings are not: the form drops an empty one."""
    variants = prop.get("anyOf") or [prop]
    for v in variants:
        v = _resolve(v, defs)
        if v.get("type") == "array" or (v.get("type") == "object" and not v.get("properties")):
            return False
    return True


def _titled(name: str, prop: dict, defs: dict) -> dict:
    prop = dict(prop)
    prop.setdefault("title", field_title(name))
    if "anyOf" in prop:
        tabs = []
        for v in prop["anyOf"]:
            v = dict(v)
            if "$ref" not in v and "title" not in v:
                v["title"] = _TAB.get(str(v.get("type")), str(v.get("type")))
            tabs.append(v)
        prop["anyOf"] = tabs
    return prop


def _advanced(prop: dict) -> dict:
    """An advanced section, titled so. A section with a default is shown as one JSON editor (an
    object without `properties`; its value is still checked when the run starts, by the section's
    own schema, naming the key path). A nullable one stays a pair of tabs, "None" showing nothing."""
    title = prop["title"]
    prop = {**prop, "title": f"Advanced: {title[:1].lower() + title[1:] if title[1:2].islower() else title}"}
    if "anyOf" in prop or "$ref" not in prop:
        return prop
    return {"title": prop["title"], "description": f"{prop.get('description', '')} (JSON)".strip(),
            "type": "object", "default": prop.get("default")}


def _shape(def_name: str, schema: dict, defs: dict) -> dict:
    props = schema.get("properties")
    if not props:
        return schema
    first, advanced = _rules(EVERYDAY, def_name), _rules(ADVANCED, def_name)
    out: dict[str, dict] = {}
    required = set(schema.get("required", []))
    for name, prop in props.items():
        prop = _titled(name, prop, defs)
        if "description" in prop:  # the V1 form renders descriptions as HTML: `<workspace>` would vanish
            prop["description"] = re.sub(r"<([^<>\s]+)>", r"{\1}", prop["description"])
        if "const" in prop:  # a node's kind: a one-choice select, described by its node's section
            prop = {**prop, "enum": [prop["const"]], "readOnly": True}
            prop.pop("description", None)
        if _always_filled(prop, defs):  # a section made a JSON editor too: it always holds the section
            required.add(name)
        if name in advanced:
            prop = _advanced(prop)
        out[name] = prop
    order = [n for n in first if n in out] + [n for n in out if n not in first and n not in advanced] + \
        [n for n in advanced if n in out]
    for i, name in enumerate(order):
        out[name]["position"] = i
    return {**schema, "properties": {n: out[n] for n in order}, "required": sorted(required)}


def form_schema(cfg: PipelineConfig) -> dict[str, Any]:
    """The run-form schema of a deployment serving `cfg` (see the module docstring)."""
    from prefect.utilities.callables import parameter_schema

    from posttrain.flows.pipeline import post_training

    schema = copy.deepcopy(parameter_schema(post_training.fn).model_dump())
    defs = schema["definitions"]
    generic_node = defs["PipelineConfig"]["properties"]["nodes"]["additionalProperties"]
    kinds = {m.rsplit("/", 1)[-1]: k for k, m in generic_node["discriminator"]["mapping"].items()}
    for name in list(defs):
        defs[name] = _shape(name, defs[name], defs)
    by_kind = {k: d for d, k in kinds.items()}
    nodes = defs["PipelineConfig"]["properties"]["nodes"]
    nodes["properties"] = {
        name: {"$ref": f"#/definitions/{by_kind[node.kind]}", "title": f"{name} ({_kind_title(node.kind)})",
               "description": defs[by_kind[node.kind]]["properties"]["kind"].get("description", ""),
               "position": i}
        for i, (name, node) in enumerate(cfg.nodes.items())}
    nodes["required"] = list(cfg.nodes)
    nodes["description"] = ("The DAG this deployment serves, one section per node (nodes can be added "
                            "through the API or a config file: `posttrain serve FILE`).")
    root = schema["properties"]["config"]
    root.update(title="Pipeline", description="The pipeline config; checked as a whole when the run starts.")
    return schema


_KIND_TITLES = {"data_prep": "data prep", "sft": "SFT", "distill": "distillation", "dpo": "DPO",
                "grpo": "GRPO", "evaluate": "evaluation"}


def _kind_title(kind: str) -> str:
    return _KIND_TITLES.get(kind, kind)


# ------------------------------------------------------------------------------ the summary

def _cell(v: Any) -> str:
    text = "—" if v in (None, "", []) else str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _layout(parallel: Any) -> str:
    dims = [(k, getattr(parallel, k)) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")]
    shown = [f"{k}={v}" for k, v in dims if v not in (1, -1)]
    return ", ".join(shown) if shown else "FSDP over all ranks"


def node_rows(cfg: PipelineConfig) -> list[dict[str, str]]:
    """One row per node: name, kind, model, data, steps, lr, LoRA rank, parallel layout."""
    rows = []
    for name, n in cfg.nodes.items():
        kind = n.kind
        model = data = steps = lr = rank = layout = None
        if kind == "data_prep":
            data = ", ".join(n.sources) if n.sources else f"synthetic ({n.synthetic_size} examples)"
        else:
            data = ", ".join(n.data.sources)
        if kind in ("sft", "distill", "dpo", "grpo"):
            model = n.model.name_or_path + (f" (teacher: {n.teacher.name_or_path})" if kind == "distill" else "")
            steps = " / ".join(x for x in (f"{n.max_steps} steps" if n.max_steps else None,
                                           f"{n.epochs} epochs") if x)
            lr = f"{n.optim.lr:g}"
            rank = str(n.lora.rank) if n.lora.enabled else "off (full)"
            layout = _layout(n.parallel)
        if kind == "evaluate":
            model = ", ".join(n.models)
            layout = _layout(n.parallel)
        extra = []
        if getattr(n, "rounds", 1) > 1:
            extra.append(f"{n.rounds} rounds")
        if n.sweep:
            extra.append("sweep " + "; ".join(f"{k}: {', '.join(map(str, v))}" for k, v in n.sweep.items()))
        rows.append({"node": name + (f" ({', '.join(extra)})" if extra else ""), "kind": kind, "model": model,
                     "data": data, "steps": steps, "lr": lr, "lora_rank": rank, "parallel": layout})
    return rows


def summary(cfg: PipelineConfig, schedule: str | None = None, timezone: str | None = None) -> str:
    """Markdown for the deployment's description: the DAG as a table, then the schedule."""
    head = ["Node", "Kind", "Model", "Data", "Steps", "Learning rate", "LoRA rank", "Parallel"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in node_rows(cfg):
        lines.append("| " + " | ".join(_cell(v) for v in r.values()) + " |")
    out = [f"**Pipeline `{cfg.name}`**, workspace `{cfg.workspace}`, launcher `{cfg.launcher.kind}` "
           f"({cfg.launcher.nproc_per_node} processes per node)", "", *lines]
    if cfg.registry.enabled:
        out += ["", f"Registry: `{cfg.registry.model_name}`, promoted on `{cfg.registry.promote_metric}`."]
    if schedule:
        out += ["", f"**Schedule:** `{schedule}` ({timezone})"]
    return "\n".join(out)
