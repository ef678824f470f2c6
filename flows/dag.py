"""The pipeline's nodes expanded and wired into a DAG, validated before anything launches.

Expansion: a node with `sweep: {lora.rank: [8, 16]}` becomes `name@rank=8`, `name@rank=16` (the
grid of every listed key); a DPO node with `rounds: K` becomes `name@r1` ... `name@rK`, round k's
model being round k-1's output (round 1's: the node's own `model`).

References: wherever a node takes a model (`model`, `teacher`, `judge`, an evaluate node's
`models`) or data (`data.sources`), a value is, in this order:
  - a node name: its output. A rounds chain means its last round; a sweep means all its members
    (only where a list is taken: `models`, `data.sources`); an evaluate node in a model place
    means the model it selects (it needs `select`). Expanded names (`dpo@r1`) can be named too.
    `node:adapter` (model places) is one adapter of a node training several (lora.adapter_names):
    that adapter merged into the base (stages/adapters.py).
  - `models:/name@alias` or `models:/name/3`: a registered MLflow model, fetched when the node runs;
  - a model preset name (model places only), or an existing path (HF dir, stage output, data file).
Anything else, a wrong type (a data node as a model), a cycle, a layout the launcher's ranks or the
model's heads cannot take, is a ValueError naming the node and key path.

    dag = PipelineDAG(cfg)
    dag.order                       # ['prep', 'teacher', 'student', 'kd', 'dpo@r1', 'dpo@r2', 'eval']
    dag.edges                       # [Edge('prep', 'teacher', 'data', 'data.sources[0]'), ...]
    dag.inputs('kd')                # ['prep', 'student', 'teacher']
    dag.spec('kd', upstream)        # the DistillConfig it runs, references replaced by paths
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from posttrain.flows.nodes import NODE_CLASSES, node_error, stage_spec
from posttrain.registry.packaged import PACKAGED, is_packaged
from posttrain.stages.config import StageConfig, check_layout

if TYPE_CHECKING:
    from posttrain.flows.config import PipelineConfig

Role = Literal["model", "teacher", "judge", "evaluated", "data"]
TRAIN_KINDS = ("sft", "distill", "dpo", "grpo")
MAX_MEMBERS = 1000  # of one sweep: a grid grows as the product of its value counts


@dataclass(frozen=True)
class Edge:
    src: str  # the upstream node, whose output is read
    dst: str  # the node that reads it
    role: Role
    key: str  # where in dst's settings: "model", "teacher", "data.sources[0]", "models[2]", "judge"
    adapter: str | None = None  # `node:adapter`: that adapter of a node training several


@dataclass
class Node:
    name: str  # expanded name (`dpo@r2`)
    base: str  # the name the user wrote (`dpo`)
    cfg: Any  # the node's settings (a NODE_CLASSES instance), expanded
    edges: list[Edge] = field(default_factory=list)
    external: dict[str, str] = field(default_factory=dict)  # key -> models:/... reference

    @property
    def kind(self) -> str:
        return self.cfg.kind


@dataclass
class Upstream:
    """What a node reads of a finished upstream node."""

    output_dir: str
    digest: str
    selected: str | None = None  # an evaluate node's chosen model (a path)


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        data = data.setdefault(p, {})
        if not isinstance(data, dict):
            raise ValueError(f"{key!r}: {p!r} is a value, not a section")
    data[parts[-1]] = value


def _label(keys: list[str], key: str, value: Any) -> str:
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    name = key.rsplit(".", 1)[-1] if leaves.count(key.rsplit(".", 1)[-1]) == 1 else key
    return f"{name}={json.dumps(value) if not isinstance(value, str) else value}"


def _model_refs(cfg: Any) -> list[tuple[str, str, Role]]:
    """(key, value, role) of every model reference in a node's settings."""
    kind = cfg.kind
    out: list[tuple[str, str, Role]] = []
    if kind in TRAIN_KINDS:
        out.append(("model", cfg.model.name_or_path, "model"))
    if kind == "distill":
        out.append(("teacher", cfg.teacher.name_or_path, "teacher"))
    if kind in ("dpo", "grpo") and cfg.judge is not None:
        out.append(("judge", cfg.judge.name_or_path, "judge"))
    if kind == "evaluate":
        out.extend((f"models[{i}]", m, "evaluated") for i, m in enumerate(cfg.models))
        if cfg.judge is not None:
            out.append(("judge", cfg.judge, "judge"))
    return out


def _data_refs(cfg: Any) -> list[tuple[str, str]]:
    if cfg.kind == "data_prep":
        return []
    return [(f"data.sources[{i}]", s) for i, s in enumerate(cfg.data.sources)]


def _presets() -> set[str]:
    from posttrain.core.model.args import PRESETS

    return set(PRESETS)


def is_registry_ref(v: str) -> bool:
    return v.startswith("models:/")


class PipelineDAG:
    def __init__(self, cfg: PipelineConfig):
        self.cfg = cfg
        self.nodes: dict[str, Node] = {}
        self.members: dict[str, list[str]] = {}  # user name -> expanded names (a chain: in order)
        for name, node in cfg.nodes.items():
            self._expand(name, node)
        for node in self.nodes.values():
            self._wire(node)
        self.edges = [e for n in self.nodes.values() for e in n.edges]
        self.order = self._toposort()
        dirs: dict[Path, str] = {}
        for name in self.order:
            self._check_node(self.nodes[name], dirs)
        reg = cfg.registry.evaluate
        if cfg.registry.enabled and reg is not None:  # checked now, not after every node has run
            evals = [n for n in self.order if self.kind(n) == "evaluate"]
            targets = self.members.get(reg, [])
            if len(targets) > 1:
                raise ValueError(f"registry.evaluate: {reg!r} is a sweep of {len(targets)} nodes; name one "
                                 f"({', '.join(targets)})")
            if not targets or self.kind(targets[0]) != "evaluate":
                raise ValueError(f"registry.evaluate: {reg!r} is not an evaluate node ({', '.join(evals) or 'none'})")

    # ------------------------------------------------------------------------------ expansion

    def _expand(self, name: str, node: Any) -> None:
        cls = NODE_CLASSES[node.kind]
        grid = [(k, v) for k, v in node.sweep.items()]
        keys = [k for k, _ in grid]
        for k, values in grid:
            if not values:
                raise ValueError(f"nodes.{name}.sweep.{k}: an empty list of values")
            labels = [_label(keys, k, v) for v in values]
            if len(set(labels)) < len(labels):
                twice = next(lb for lb in labels if labels.count(lb) > 1)
                raise ValueError(f"nodes.{name}.sweep.{k}: {twice.split('=', 1)[1]} is listed twice; "
                                 "the members would be one node")
            bad = next((lb for lb in labels if "/" in lb or "\\" in lb), None)
            if bad is not None:  # the member's name is its directory (and its lock file's) name
                raise ValueError(f"nodes.{name}.sweep.{k}: the member {name}@{bad} would be named by a path; "
                                 "sweep over values without '/', or give each path a node of its own")
        size = math.prod(len(v) for _, v in grid)
        if size > MAX_MEMBERS:
            raise ValueError(f"nodes.{name}.sweep: {size} members (the product of the value counts); "
                             f"at most {MAX_MEMBERS}")
        combos = list(itertools.product(*[[(k, v) for v in values] for k, values in grid])) if grid else [()]
        base = node.model_dump(mode="json", exclude={"sweep"})
        members = []
        for combo in combos:
            data = json.loads(json.dumps(base))
            for k, v in combo:
                try:
                    _set_dotted(data, k, v)
                except ValueError as e:
                    raise ValueError(f"nodes.{name}.sweep.{k}: {e}") from None
            try:
                expanded = cls.model_validate(data)
            except ValidationError as e:
                where = ", ".join(f"{k}={v!r}" for k, v in combo)
                raise ValueError(f"{node_error(name, cls, e)} (in the sweep member {where})") from None
            member = name + "".join(f"@{_label(keys, k, v)}" for k, v in combo)
            if len(member.encode()) + len("@r100.lock") > 255:  # NAME_MAX: a directory and lock file name
                raise ValueError(f"nodes.{name}{'.sweep' if combo else ''}: {member[:60]!r}... is too long a "
                                 "name for a directory")
            if combo and expanded.output_dir is not None:
                raise ValueError(f"nodes.{name}.output_dir: a swept node's members each need their own "
                                 "directory; leave output_dir unset")
            rounds = getattr(expanded, "rounds", 1)
            chain = [member] if rounds == 1 else [f"{member}@r{k}" for k in range(1, rounds + 1)]
            for k, n in enumerate(chain):
                c = expanded.model_copy(deep=True)
                if k > 0:
                    c.model.name_or_path = chain[k - 1]
                    c.seed = expanded.seed + k  # each round samples afresh
                if rounds > 1 and c.output_dir is not None:
                    c.output_dir = f"{c.output_dir}/r{k + 1}"
                self.nodes[n] = Node(n, name, c)
            members.append(chain)
        self.members[name] = [chain[-1] for chain in members]
        for chain in members:  # the expanded names are nodes too; a member's name means its last round
            self.members.setdefault(chain[-1].rsplit("@r", 1)[0] if len(chain) > 1 else chain[-1], [chain[-1]])
            for n in chain:
                self.members.setdefault(n, [n])

    # ------------------------------------------------------------------------------ references

    def _resolve(self, node: Node, key: str, value: str, role: Role, many: bool) -> list[str] | None:
        """Node names `value` refers to (None: not a node reference)."""
        where = f"nodes.{node.base}.{key}"
        if value not in self.members:
            return None
        targets = self.members[value]
        if len(targets) > 1 and not many:
            raise ValueError(f"{where}: {value!r} is a sweep of {len(targets)} nodes ({', '.join(targets)}); "
                             "name one of them, or evaluate them with an evaluate node that has `select` "
                             "and name that")
        for t in targets:
            kind = self.nodes[t].kind
            if role == "data" and kind != "data_prep":
                raise ValueError(f"{where}: {value!r} is a {kind} node; data comes from a data_prep node "
                                 "(or a file)")
            if role != "data":
                if kind == "data_prep":
                    raise ValueError(f"{where}: {value!r} is a data_prep node; a model comes from a training "
                                     f"node ({', '.join(TRAIN_KINDS)}) or an evaluate node with `select`")
                if kind == "evaluate" and self.nodes[t].cfg.select is None:
                    raise ValueError(f"{where}: evaluate node {value!r} names no model: give it "
                                     "`select: {metric: ...}` to hand its best model on")
        return targets

    def _adapter_ref(self, node: Node, key: str, value: str) -> tuple[list[str], str] | None:
        """(targets, adapter) of a `node:adapter` reference, or None when `value` is not one."""
        base, sep, adapter = value.rpartition(":")
        if not sep or base not in self.members or is_registry_ref(value):
            return None
        where = f"nodes.{node.base}.{key}"
        targets = self._resolve(node, key, base, "model", False)
        for t in targets:
            cfg = self.nodes[t].cfg
            names = cfg.lora.adapter_names if getattr(cfg, "lora", None) is not None and cfg.lora.enabled else []
            if len(names) < 2 or adapter not in names:
                raise ValueError(f"{where}: {value!r} names adapter {adapter!r} of node {base!r}, which trains "
                                 f"{'adapters ' + ', '.join(names) if len(names) > 1 else 'no several adapters'}")
            if cfg.save != "full" and not cfg.export_merged:
                raise ValueError(f"{where}: {value!r} is adapter {adapter!r} merged into the base, which node "
                                 f"{base!r} does not write (save: adapter); set its save: full or export_merged: true")
        return targets, adapter

    def _wire(self, node: Node) -> None:
        presets = _presets()
        for key, value, role in _model_refs(node.cfg):
            many = role == "evaluated"
            ref = self._adapter_ref(node, key, value) if value not in self.members else None
            if ref is not None:
                node.edges.extend(Edge(t, node.name, role, key, ref[1]) for t in ref[0])
                continue
            targets = self._resolve(node, key, value, role, many)
            if targets is not None:
                node.edges.extend(Edge(t, node.name, role, key) for t in targets)
            elif is_registry_ref(value):
                node.external[key] = value
            elif value not in presets and not is_packaged(value) and not _exists(value):
                raise ValueError(f"nodes.{node.base}.{key}: {value!r} is not a node ({', '.join(self.cfg.nodes)}), "
                                 "a registered model (models:/name@alias), a model preset "
                                 f"({', '.join(sorted(presets))}), a packaged model ({', '.join(sorted(PACKAGED))}) "
                                 "or an existing path (an HF directory or a .gguf file)")
        for key, value in _data_refs(node.cfg):
            targets = self._resolve(node, key, value, "data", True)
            if targets is not None:
                node.edges.extend(Edge(t, node.name, "data", key) for t in targets)
            elif not _exists(value):
                raise ValueError(f"nodes.{node.base}.{key}: {value!r} is neither a node nor an existing file")
        if node.kind in TRAIN_KINDS + ("evaluate",) and not node.cfg.data.sources:
            raise ValueError(f"nodes.{node.base}.data: no data; name a data_prep node (data: prep) or files")
        if node.kind == "data_prep":
            for i, s in enumerate(node.cfg.sources):
                if not _exists(s):
                    raise ValueError(f"nodes.{node.base}.sources[{i}]: {s!r} does not exist")

    def _toposort(self) -> list[str]:
        order: list[str] = []
        state: dict[str, int] = {}  # 1 visiting, 2 done
        inputs = {n: [e.src for e in node.edges] for n, node in self.nodes.items()}

        def visit(n: str, path: list[str]) -> None:
            if state.get(n) == 2:
                return
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                raise ValueError(f"nodes: a cycle {' -> '.join(self.nodes[c].base for c in cycle)}")
            state[n] = 1
            for u in inputs[n]:
                visit(u, path + [n])
            state[n] = 2
            order.append(n)

        for n in self.nodes:  # the user's order, as far as the edges allow
            visit(n, [])
        return order

    # ------------------------------------------------------------------------------ checks

    def _check_node(self, node: Node, dirs: dict[Path, str]) -> None:
        cfg, where = node.cfg, f"nodes.{node.base}"
        self._check_dir(node, dirs)
        parallel = getattr(cfg, "parallel", None)
        if parallel is not None:
            try:
                check_layout(parallel, cfg.launcher or self.cfg.launcher)
            except ValueError as e:
                raise ValueError(f"{where}.{e}") from None
            shape = self.model_shape(node.name)
            if shape is not None:
                try:
                    parallel.validate_for_model(*shape)
                except ValueError as e:
                    raise ValueError(f"{where}.parallel: {e}") from None

    def _check_dir(self, node: Node, dirs: dict[Path, str]) -> None:
        """A node's output dir stays in the workspace, and apart from the run's own files and every
        other node's dir: a node clears its dir when its result changes, which would delete what
        lies inside (or, for the workspace itself, every run)."""
        out = Path(os.path.abspath(self.cfg.node_dir(node.name, node.cfg.output_dir)))  # raises if it escapes
        run = Path(os.path.abspath(self.cfg.run_dir))
        where = f"nodes.{node.base}.output_dir"
        if out == run or out in run.parents:
            raise ValueError(f"{where}: {node.cfg.output_dir!r} is the {'run dir' if out == run else 'workspace'} "
                             "itself, not a directory of its own")
        if out.is_relative_to(run) and out.relative_to(run).parts[0].startswith("."):
            raise ValueError(f"{where}: {node.cfg.output_dir!r} is inside {out.relative_to(run).parts[0]}/, "
                             "where the pipeline keeps its own files")
        for d, other in dirs.items():
            if out == d or d in out.parents or out in d.parents:
                a, b = node.name, other
                if node.cfg.output_dir is None and self.nodes[other].cfg.output_dir is not None:
                    a, b = b, a  # name the node whose custom output_dir collides
                how = "the same directory as" if out == d else "inside the directory of" \
                    if self.output_dir(b) in self.output_dir(a).parents else "a directory holding that of"
                raise ValueError(f"nodes.{self.nodes[a].base}.output_dir: {self.output_dir(a)} is {how} node {b!r} "
                                 f"({self.output_dir(b)})")
        dirs[out] = node.name

    def model_shape(self, name: str) -> tuple[int, int, int] | None:
        """(heads, kv heads, experts) of the model node `name` trains, traced back to its preset or
        HF dir (None when unknown before running, e.g. a registered or selected model)."""
        node = self.nodes[name]
        if node.kind not in TRAIN_KINDS:
            return None
        up = next((e.src for e in node.edges if e.role == "model"), None)
        if up is not None:
            return self.model_shape(up)
        ref = node.cfg.model.name_or_path
        if ref in _presets():
            from posttrain.core.model.args import get_preset

            try:
                a = get_preset(ref, **node.cfg.model.overrides)
            except (TypeError, ValueError, KeyError) as e:
                raise ValueError(f"nodes.{node.base}.model.overrides: {e}") from None
            return a.num_heads, a.num_kv_heads, a.moe.num_experts if a.moe else 0
        conf = Path(ref) / "config.json"
        if conf.is_file():
            try:
                c = json.loads(conf.read_text())
                return (int(c["num_attention_heads"]), int(c.get("num_key_value_heads", c["num_attention_heads"])),
                        int(c.get("num_local_experts", c.get("num_experts", 0)) or 0))
            except (ValueError, KeyError, TypeError):
                return None
        return None

    # ------------------------------------------------------------------------------ queries

    def inputs(self, name: str) -> list[str]:
        """The nodes whose outputs node `name` reads."""
        return sorted({e.src for e in self.nodes[name].edges})

    def kind(self, name: str) -> str:
        return self.nodes[name].kind

    def output_dir(self, name: str) -> Path:
        return self.cfg.node_dir(name, self.nodes[name].cfg.output_dir)

    def launcher(self, name: str):
        """How node `name` is launched (a copy): its own launcher, else the pipeline's; a data-prep
        node runs as one process whatever the ranks asked for (rank 0 does all of posttrain.stages.data_prep),
        which is also what the device pool books for it."""
        node = self.nodes[name]
        launcher = (node.cfg.launcher or self.cfg.launcher).model_copy(deep=True)
        if node.kind == "data_prep":
            launcher.nproc_per_node = 1
        return launcher

    def spec(self, name: str, upstream: dict[str, Upstream], external: dict[str, str] | None = None) -> StageConfig:
        """Node `name`'s self-contained stage spec: output dir, launcher and tracking filled in, each
        node reference replaced by the upstream's output (`upstream`: name -> Upstream), each
        registry reference by its local copy (`external`: key -> dir)."""
        node = self.nodes[name]
        spec = stage_spec(node.cfg)
        spec.output_dir = str(self.output_dir(name))
        if node.kind == "distill" and spec.teacher_cache is None:  # shared by the nodes and runs of the workspace
            spec.teacher_cache = str(Path(self.cfg.workspace) / ".cache" / "teacher")
        spec.launcher = self.launcher(name)
        spec.tracking = spec.tracking or self.cfg.tracking.model_copy(deep=True)

        def model_path(src: str, adapter: str | None = None) -> str:
            u = upstream[src]
            if self.nodes[src].kind == "evaluate":
                if u.selected is None:
                    raise RuntimeError(f"evaluate node {src!r} selected no model")
                return u.selected
            if adapter is not None:  # posttrain.stages.adapters.merged_dir
                return str(Path(u.output_dir) / f"model-{adapter}")
            return u.output_dir

        evaluated = [model_path(e.src, e.adapter) for e in node.edges if e.role == "evaluated"]
        data = [upstream[e.src].output_dir for e in node.edges if e.role == "data"]
        for e in node.edges:
            if e.role == "model":
                spec.model.name_or_path = model_path(e.src, e.adapter)
            elif e.role == "teacher":
                spec.teacher.name_or_path = model_path(e.src, e.adapter)
            elif e.role == "judge":
                if node.kind == "evaluate":
                    spec.judge = model_path(e.src, e.adapter)
                else:
                    spec.judge.name_or_path = model_path(e.src, e.adapter)
        for key, local in (external or {}).items():
            if key == "model":
                spec.model.name_or_path = local
            elif key == "teacher":
                spec.teacher.name_or_path = local
            elif key == "judge":
                if node.kind == "evaluate":
                    spec.judge = local
                else:
                    spec.judge.name_or_path = local
        if node.kind == "evaluate":
            models = []
            for i, m in enumerate(node.cfg.models):
                key = f"models[{i}]"
                srcs = [e for e in node.edges if e.key == key]
                models.extend(model_path(e.src, e.adapter) for e in srcs) if srcs else \
                    models.append((external or {}).get(key, m))
            spec.models = models
            assert len(evaluated) <= len(models)
        if node.kind != "data_prep":
            sources = []
            for i, s in enumerate(node.cfg.data.sources):
                srcs = [e.src for e in node.edges if e.key == f"data.sources[{i}]"]
                sources.extend(upstream[x].output_dir for x in srcs) if srcs else sources.append(s)
            spec.data.sources = sources
            assert len(data) <= len(sources)
            lora = getattr(spec, "lora", None)
            if lora is not None and lora.adapter_sources:  # the same sources, by what they became
                where = dict(zip(node.cfg.data.sources, [[upstream[e.src].output_dir for e in node.edges
                                                           if e.key == f"data.sources[{i}]"] or [s]
                                                          for i, s in enumerate(node.cfg.data.sources)]))
                lora.adapter_sources = {a: [x for s in srcs for x in where.get(s, [s])]
                                        for a, srcs in lora.adapter_sources.items()}
        return spec

    def describe(self) -> dict[str, Any]:
        """Nodes and edges as plain data (for `posttrain config` and the flow's parent run)."""
        return {
            "nodes": {n: {"kind": self.nodes[n].kind, "from": self.nodes[n].base, "inputs": self.inputs(n),
                          "output_dir": str(self.output_dir(n))} for n in self.order},
            "edges": [{"src": e.src, "dst": e.dst, "role": e.role, "key": e.key} for e in self.edges],
        }


def _exists(path: str) -> bool:
    """Path(path).exists(), False for a name the file system cannot even look up (too long)."""
    try:
        return Path(path).exists()
    except OSError:
        return False
