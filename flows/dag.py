"""The pipeline as a DAG of explicit edges, built once per pipeline run.

A PipelineConfig names each stage's upstream by stage name (`init_from`, `teacher_from`,
`compare_to`) or, for data, by leaving `data.sources` empty (= data prep's output). `PipelineDAG`
turns those names into `Edge`s (upstream stage, downstream stage, role), skipping disabled stages
(a disabled stage passes its own `init_from` on), and from the same edges derives both what the
flow needs (each stage's inputs, for ordering and cache keys) and what each stage gets (its
self-contained spec, with the upstream output directories filled in). Each spec is resolved once.

    dag = PipelineDAG(cfg)
    dag.edges                 # [Edge('data_prep', 'sft_teacher', 'data'), Edge('sft_student', 'distill', 'model'), ...]
    dag.inputs("distill")     # ['data_prep', 'sft_student', 'sft_teacher']
    dag.spec("distill")       # DistillConfig with model/teacher/data paths, launcher, tracking, output_dir
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flows.config import PipelineConfig
from stages.config import STAGES, DistillConfig, EvalConfig, StageConfig

Role = Literal["model", "teacher", "data", "compare"]


@dataclass(frozen=True)
class Edge:
    src: str  # the upstream stage, whose output directory is read
    dst: str  # the stage that reads it
    role: Role  # which input of `dst` it fills: model.name_or_path, teacher, data.sources, compare_to


class PipelineDAG:
    def __init__(self, cfg: PipelineConfig):
        self.cfg = cfg
        self.nodes = cfg.enabled_stages()
        self.edges = [e for name in self.nodes for e in self._edges_into(name)]
        self._specs: dict[str, StageConfig] = {}

    def _upstream(self, name: str, ref: str) -> str | None:
        """Nearest enabled stage feeding `name` via `ref`; a disabled one passes on its own init_from."""
        cfg = self.cfg
        up = getattr(getattr(cfg, name), ref, None)
        while up is not None and not getattr(cfg.stages, up):
            up = getattr(getattr(cfg, up), "init_from", None)
        return up

    def _edges_into(self, name: str) -> list[Edge]:
        cfg, stage = self.cfg, getattr(self.cfg, name)
        out = []
        for ref, role in (("init_from", "model"), ("teacher_from", "teacher")):
            if (up := self._upstream(name, ref)) is not None:
                out.append(Edge(up, name, role))
        data = getattr(stage, "data", None)
        if data is not None and not data.sources and cfg.stages.data_prep and name != "data_prep":
            out.append(Edge("data_prep", name, "data"))
        for c in getattr(stage, "compare_to", []):
            if c in STAGES and getattr(cfg.stages, c):
                out.append(Edge(c, name, "compare"))
        return out

    def inputs(self, name: str) -> list[str]:
        """The stages whose outputs stage `name` reads."""
        return sorted({e.src for e in self.edges if e.dst == name})

    def upstream(self, name: str, role: Role = "model") -> str | None:
        return next((e.src for e in self.edges if e.dst == name and e.role == role), None)

    def spec(self, name: str) -> StageConfig:
        """Stage `name`'s self-contained spec: output dir, launcher, tracking and the upstream
        outputs its edges name, filled in (resolved once; the same object on every call)."""
        if name not in self._specs:
            self._specs[name] = self._resolve(name)
        return self._specs[name]

    def _resolve(self, name: str) -> StageConfig:
        cfg = self.cfg
        spec = getattr(cfg, name).model_copy(deep=True)
        spec.output_dir = str(cfg.stage_dir(name))
        spec.launcher = spec.launcher or cfg.launcher.model_copy(deep=True)
        spec.tracking = spec.tracking or cfg.tracking.model_copy(deep=True)
        into = [e for e in self.edges if e.dst == name]
        for e in into:
            path = str(cfg.stage_dir(e.src))
            if e.role == "model":
                spec.model.name_or_path = path
            elif e.role == "teacher":
                assert isinstance(spec, DistillConfig)
                spec.teacher.name_or_path = path
            elif e.role == "data":
                spec.data.sources = [path]
        if isinstance(spec, EvalConfig):  # stage names become their output dirs; disabled stages drop out
            compared = {e.src for e in into if e.role == "compare"}
            spec.compare_to = [str(cfg.stage_dir(c)) if c in compared else c for c in spec.compare_to
                               if c not in STAGES or c in compared]
        return spec
