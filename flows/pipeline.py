"""The post-training pipeline as one Prefect flow: a task per stage, artifacts passed as paths
to stage manifests, stages cached by the content hashes of their inputs and config, retried with
backoff, and tracked as one MLflow parent run with a child run per stage.

The flow never imports torch: each stage runs as its own torchrun job (stages/launch/), which
is also what makes cancellation clean (the launcher kills the job's process group).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context

from core.config import dump_config
from flows.config import PipelineConfig
from stages.config import STAGE_MODULES, StageConfig
from core.manifest import CHECKPOINTS, MANIFEST, clear_partial, digest, is_stage_dir, read_manifest
from flows.dag import PipelineDAG

KEY_FILE = ".posttrain-cache-key"

log = logging.getLogger("posttrain.flow")


def cache_key(spec: StageConfig, name: str, upstream: dict[str, str]) -> str:
    """Digest of the stage's spec (minus what does not change its result) and of the content
    digests of the manifests it reads."""
    data = dump_config(spec)
    data.pop("tracking", None)
    data.pop("launcher", None)
    return digest({"stage": name, "spec": data, "inputs": upstream})


@dataclass
class StageResult:
    stage: str
    output_dir: str
    cached: bool
    digest: str
    metrics: dict[str, Any] = field(default_factory=dict)
    mlflow_run_id: str | None = None


def _prepare_dir(out: Path, key: str) -> bool:
    """True when `out` already holds this exact result. A directory left by another key is
    cleared; one left by a crashed attempt with the same key is kept (its checkpoints resume)."""
    key_file = out / KEY_FILE
    if key_file.exists() and key_file.read_text() == key:
        if is_stage_dir(out):
            return True
        clear_partial(out, keep=(KEY_FILE, CHECKPOINTS))  # of what a killed attempt wrote, only checkpoints stay
        return False
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    key_file.write_text(key)
    return False


@task(cache_policy=NO_CACHE, log_prints=True, task_run_name="{name}")
def run_stage(spec: StageConfig, name: str, upstream: dict[str, str], parent_run_id: str | None) -> StageResult:
    """Launch stage `name` with its resolved `spec` unless its cached result is current; returns
    its manifest summary. `upstream`: the content digests of the stages it reads."""
    from stages.launch import launch_stage

    logger = get_run_logger()
    out = Path(spec.output_dir)
    key = cache_key(spec, name, upstream)
    if _prepare_dir(out, key):
        m = read_manifest(out)
        logger.info("%s: inputs and config unchanged, using %s (cached)", name, out)
        return StageResult(name, str(out), True, m["digest"], m.get("metrics", {}), m.get("mlflow_run_id"))
    if (out / MANIFEST).exists():
        (out / MANIFEST).unlink()
    env = {"POSTTRAIN_RUN_NAME": name}
    if parent_run_id:
        env["POSTTRAIN_PARENT_RUN_ID"] = parent_run_id
    ctx = get_run_context()
    env["POSTTRAIN_PREFECT_FLOW_RUN_ID"] = str(getattr(ctx.task_run, "flow_run_id", "") or "")
    result = launch_stage(STAGE_MODULES[name], spec, spec.launcher, workdir=out.parent / ".launch" / name,
                          env=env, on_output=lambda line: logger.info("%s | %s", name, line.rstrip()))
    if not result.ok:
        tail = "".join(Path(result.log_file).read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"stage {name} failed with exit code {result.returncode}; log {result.log_file}:\n{tail}")
    m = read_manifest(out)
    logger.info("%s: done in %.1fs: %s", name, result.wall_time_s, json.dumps(m.get("metrics", {}))[:500])
    return StageResult(name, str(out), False, m["digest"], m.get("metrics", {}), m.get("mlflow_run_id"))


@dataclass
class PipelineResult:
    ok: bool
    stages: dict[str, StageResult]
    parent_run_id: str | None
    registered: dict[str, Any] | None = None


@flow(name="post_training", log_prints=True)
def post_training(config: PipelineConfig) -> PipelineResult:
    """data prep -> SFT teacher || SFT student -> distillation -> DPO -> evaluation -> registry."""
    from core.tracking import create_tracker
    from flows.recovery import recover

    logger = get_run_logger()
    cfg = config
    ctx = get_run_context()
    flow_run_id = str(ctx.flow_run.id)
    recover(cfg.tracking, cfg.name)  # what killed runs of this pipeline left: stale runs, orphaned servers
    parent = create_tracker(cfg.tracking, run_name=f"{cfg.name}", tags={
        "posttrain.pipeline": cfg.name, "prefect.flow_run_id": flow_run_id,
        "prefect.flow_run_name": str(ctx.flow_run.name)}, rank=0)
    parent.log_params(dump_config(cfg))
    parent.flush(timeout=60)  # creates the run: children need its id
    parent_id = getattr(parent, "run_id", None)
    futures: dict[str, Any] = {}
    results: dict[str, StageResult] = {}
    delays = [cfg.retry_delay_s * 3**i for i in range(cfg.stage_retries)]
    stage_task = run_stage.with_options(retries=cfg.stage_retries, retry_delay_seconds=delays or 0)
    dag = PipelineDAG(cfg)
    try:
        for name in dag.nodes:  # in pipeline order, so every input is submitted before its readers
            # Submit as soon as the inputs are known; independent stages (the two SFTs) overlap.
            upstream = {d: futures[d].result().digest for d in dag.inputs(name)}
            futures[name] = stage_task.submit(dag.spec(name), name, upstream, parent_id)
        for name, fut in futures.items():
            results[name] = fut.result()
            parent.log_metrics({f"{name}/{k}": v for k, v in results[name].metrics.items()
                                if isinstance(v, (int, float))}, step=0)
        registered = None
        if "evaluate" in results and cfg.registry.enabled:
            from registry.mlflow_registry import register_and_promote

            registered = register_and_promote(cfg.registry, cfg.tracking.tracking_uri, results, parent_id,
                                              dag.upstream("evaluate"))
            parent.log_dict(registered, "registry_decision.json")
        from flows.report import log_reports

        log_reports(cfg, results, parent)
        parent.end("FINISHED")
        return PipelineResult(True, results, parent_id, registered)
    except BaseException as e:
        parent.set_tags({"posttrain.error": f"{type(e).__name__}: {e}"[:5000]})
        parent.end("FAILED")
        logger.error("pipeline failed: %s", e)
        raise


def run_pipeline(cfg: PipelineConfig) -> PipelineResult:
    """Run the flow once from the terminal (Prefect's local ephemeral API unless configured)."""
    return post_training(cfg)
