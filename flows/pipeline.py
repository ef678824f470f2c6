"""The post-training pipeline as one Prefect flow: a task per DAG node (posttrain.flows.dag), named after
the node; independent nodes run concurrently as far as the devices allow (posttrain.flows.resources), each
node's output directory locked while it runs (posttrain.flows.workspace), nodes cached by the content
hashes of their inputs and the settings that change their result, retried with backoff, and
tracked as one MLflow parent run with a child run per node (posttrain.flows.runs: opened when the node
launches; a cached node's points at the run it reused).

The flow never imports torch: each node runs as its own torchrun job (stages/launch/), which is
also what makes cancellation clean (the launcher kills the job's process group).
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
from prefect.states import Completed

from posttrain.core.config import dump_config
from posttrain.core.manifest import CHECKPOINTS, MANIFEST, clear_partial, digest, is_stage_dir, read_manifest
from posttrain.flows.config import PipelineConfig
from posttrain.flows.dag import PipelineDAG, Upstream
from posttrain.flows.runs import RUN_ID_ENV, end_if_running, open_node_run, record_cached
from posttrain.stages.config import StageConfig

KEY_FILE = ".posttrain-cache-key"

log = logging.getLogger("posttrain.flow")

# Settings that change how a node runs but not what it produces: they are left out of its cache
# key, so changing them alone keeps the finished result, or resumes a crashed attempt from its
# checkpoints (resharded to the new layout). Everything else counts. docs/pipelines.md lists both.
NOT_IN_KEY = ("output_dir", "tracking", "launcher", "parallel", "checkpoint", "reliability", "kernels",
              "teacher_cache")
NOT_IN_KEY_MODEL = ("kernels", "compile", "activation_checkpointing", "parallel")  # teacher.parallel: a layout


def result_settings(spec: StageConfig) -> dict[str, Any]:
    """The part of a spec that determines the node's result (what the cache key hashes)."""
    data = dump_config(spec)
    for k in NOT_IN_KEY:
        data.pop(k, None)
    for section in ("model", "teacher", "judge"):
        if isinstance(data.get(section), dict):
            for k in NOT_IN_KEY_MODEL:
                data[section].pop(k, None)
    if isinstance(data.get("data"), dict):
        data["data"].pop("sources", None)  # upstream nodes count by content digest, files below
    return data


def cache_key(spec: StageConfig, kind: str, inputs: dict[str, str]) -> str:
    """Digest of the node's result settings and the content digests of what it reads (`inputs`:
    reference key -> upstream digest, registry version, or a file's path)."""
    return digest({"kind": kind, "spec": result_settings(spec), "inputs": inputs})


@dataclass
class StageResult:
    stage: str  # the node name
    output_dir: str
    cached: bool
    digest: str
    kind: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    selected: str | None = None  # an evaluate node's chosen model
    seconds: float | None = None  # wall time of the launch (None: served from the cache)
    cached_run_id: str | None = None  # a cached node's child run in this pipeline run (posttrain.flows.runs.record_cached)

    @classmethod
    def of(cls, name: str, kind: str, out: Path, cached: bool, seconds: float | None = None) -> StageResult:
        m = read_manifest(out)
        sel = (m.get("selected") or {}).get("model")
        return cls(name, str(out), cached, m["digest"], kind, m.get("metrics", {}), m.get("mlflow_run_id"), sel,
                   seconds)


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


def node_inputs(dag: PipelineDAG, name: str, upstream: dict[str, Upstream], fetched: dict[str, str]) -> dict[str, str]:
    """What node `name`'s result depends on besides its settings: each upstream's content digest
    (by the key that references it), each registry model's version, each named file's path."""
    node = dag.nodes[name]
    inputs: dict[str, str] = {}
    for e in node.edges:
        inputs[e.key] = inputs.get(e.key, "") + upstream[e.src].digest
    inputs.update(fetched)
    if node.kind == "data_prep":
        inputs.update({f"sources[{i}]": _file_identity(s) for i, s in enumerate(node.cfg.sources)})
    else:
        inputs.update({f"data.sources[{i}]": _file_identity(s) for i, s in enumerate(node.cfg.data.sources)
                       if s not in dag.members})
    return inputs


def _file_identity(path: str) -> str:
    """A user's data file by content (sha256); a directory by its files' names, sizes and mtimes."""
    from posttrain.core.manifest import file_sha256

    p = Path(path)
    if p.is_file():
        return f"{path} sha256:{file_sha256(p)}"
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
    return digest([path] + [[str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns] for f in files])


def plan_node(dag: PipelineDAG, name: str, upstream: dict[str, Upstream], fetch: bool = True):
    """(spec, cache key) of node `name` given its finished upstream nodes; registry references are
    fetched (fetch=False: named only, for dry runs)."""
    node = dag.nodes[name]
    external, fetched = {}, {}
    for key, ref in node.external.items():
        if fetch:
            from posttrain.registry.mlflow_registry import fetch_registered

            local, version = fetch_registered(dag.cfg.tracking.tracking_uri, ref, dag.cfg.run_dir / ".registry")
            external[key], fetched[key] = str(local), version
        else:
            external[key], fetched[key] = ref, ref
    spec = dag.spec(name, upstream, external)
    return spec, cache_key(spec, node.kind, node_inputs(dag, name, upstream, fetched))


def _devices(dag: PipelineDAG, name: str):
    """(what node `name` asks of the device pool or None, the GPUs the pool has)."""
    from posttrain.flows.resources import needs, visible_gpus

    res, launcher = dag.cfg.resources, dag.launcher(name)
    gpus = visible_gpus() if res.gpus is None else res.gpus
    device = getattr(getattr(dag.nodes[name].cfg, "parallel", None), "device", "cpu")
    return needs(device, launcher.nproc_per_node, launcher.kind, gpus), gpus


@task(cache_policy=NO_CACHE, log_prints=True, task_run_name="{name}")
def run_node(dag: PipelineDAG, name: str, upstream: dict[str, StageResult], parent_run_id: str | None,
             pool_id: str) -> StageResult:
    """Launch node `name` unless its cached result is current; returns its manifest summary.
    `upstream`: the finished nodes it reads (Prefect resolves their futures first)."""
    import os

    from posttrain.flows.resources import pool_for
    from posttrain.flows.workspace import node_lock
    from posttrain.stages.launch import launch_stage

    logger = get_run_logger()
    ups = {k: Upstream(r.output_dir, r.digest, r.selected) for k, r in upstream.items()}
    kind = dag.kind(name)
    spec, key = plan_node(dag, name, ups)
    out = Path(spec.output_dir)
    with node_lock(dag.cfg.run_dir, name, dag.cfg.lock_wait_s, owner=pool_id):
        if _prepare_dir(out, key):
            r = StageResult.of(name, kind, out, True)
            r.cached_run_id = record_cached(spec, name, kind, parent_run_id, key, r.mlflow_run_id, r.metrics)
            logger.info("%s: inputs and settings unchanged (key %s), using %s from MLflow run %s (cached)", name,
                        key[:16], out, r.mlflow_run_id)
            # Prefect's own Cached state: the UI shows the node as served from the cache, not as a 1 s run
            return Completed(data=r, name="Cached", message=f"cached: key {key[:16]}, MLflow run {r.mlflow_run_id}")
        if (out / MANIFEST).exists():
            (out / MANIFEST).unlink()
        env = {"POSTTRAIN_RUN_NAME": name, **({"POSTTRAIN_PARENT_RUN_ID": parent_run_id} if parent_run_id else {})}
        ctx = get_run_context()
        env["POSTTRAIN_PREFECT_FLOW_RUN_ID"] = str(getattr(ctx.task_run, "flow_run_id", "") or "")
        need, gpus = _devices(dag, name)
        res = dag.cfg.resources
        pool = pool_for(pool_id, gpus, res.cpu_slots or os.cpu_count() or 1, res.share_gpus)
        lease = pool.lease(*need, node=name) if need else _no_lease()
        with lease as ids:
            if need and need[0] == "gpu":
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
            logger.info("%s: %s", name, f"on {need[0]} {ids}" if need else "placed by its scheduler")
            run_id = open_node_run(spec, name, kind, parent_run_id, key)  # MLflow's start = the stage's
            if run_id:
                env[RUN_ID_ENV] = run_id
            try:
                result = launch_stage(kind, spec, spec.launcher, workdir=out.parent / ".launch" / name, env=env,
                                      on_output=lambda line: logger.info("%s | %s", name, line.rstrip()))
            except BaseException as e:  # cancelled, or the launcher itself failed
                end_if_running(spec, run_id, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED",
                               f"{type(e).__name__}: {e}")
                raise
        if not result.ok:
            end_if_running(spec, run_id, "FAILED", f"exit code {result.returncode}")
            tail = "".join(Path(result.log_file).read_text().splitlines(keepends=True)[-30:])
            raise RuntimeError(f"node {name} failed with exit code {result.returncode}; log {result.log_file}:\n{tail}")
        r = StageResult.of(name, kind, out, False, result.wall_time_s)
        logger.info("%s: done in %.1fs, MLflow run %s: %s", name, result.wall_time_s, r.mlflow_run_id,
                    json.dumps(r.metrics)[:500])
        return r


class _no_lease:
    def __enter__(self):
        return []

    def __exit__(self, *exc):
        return False


@dataclass
class PipelineResult:
    ok: bool
    stages: dict[str, StageResult]  # by node name, in DAG order
    parent_run_id: str | None
    registered: dict[str, Any] | None = None
    leases: list[dict] = field(default_factory=list)  # which devices each launched node held, when


def check_resources(dag: PipelineDAG) -> None:
    """Every node fits the devices (else ValueError before anything launches)."""
    import os

    from posttrain.flows.resources import DevicePool

    res = dag.cfg.resources
    for name in dag.order:
        need, gpus = _devices(dag, name)
        if need:
            DevicePool(gpus, res.cpu_slots or os.cpu_count() or 1).check(*need, node=name)


@flow(name="post_training", log_prints=True)
def post_training(config: PipelineConfig) -> PipelineResult:
    """The user's DAG of nodes (posttrain.flows.dag), then the registry."""
    from posttrain.core.tracking import create_tracker
    from posttrain.flows.resources import release_pool
    from posttrain.flows.recovery import recover

    logger = get_run_logger()
    cfg = config
    dag = PipelineDAG(cfg)
    check_resources(dag)
    ctx = get_run_context()
    flow_run_id = str(ctx.flow_run.id)
    recover(cfg.tracking, cfg.name)  # what killed runs of this pipeline left: stale runs, orphaned servers
    parent = create_tracker(cfg.tracking, run_name=f"{cfg.name} ({ctx.flow_run.name})", tags={
        "posttrain.pipeline": cfg.name, "prefect.flow_run_id": flow_run_id,
        "prefect.flow_run_name": str(ctx.flow_run.name)}, rank=0, system_metrics=False)  # the stages sample
    parent.log_params(dump_config(cfg))
    parent.log_dict(dag.describe(), "dag.json")
    parent.flush(timeout=60)  # creates the run: children need its id
    parent_id = getattr(parent, "run_id", None)
    logger.info("MLflow parent run %s (%s)", parent_id, cfg.tracking.tracking_uri)
    futures: dict[str, Any] = {}
    results: dict[str, StageResult] = {}
    delays = [cfg.retry_delay_s * 3**i for i in range(cfg.stage_retries)]
    node_task = run_node.with_options(retries=cfg.stage_retries, retry_delay_seconds=delays or 0)
    try:
        for name in dag.order:  # every input is submitted before its readers; Prefect waits on the futures
            futures[name] = node_task.submit(dag, name, {u: futures[u] for u in dag.inputs(name)}, parent_id,
                                             flow_run_id)
        errors, failed = [], set()
        for name, fut in futures.items():
            bad = [u for u in dag.inputs(name) if u in failed]
            if bad:
                failed.add(name)
                errors.append(f"{name}: not run, its input {', '.join(bad)} failed")
                continue
            try:
                results[name] = fut.result()
            except BaseException as e:  # noqa: BLE001 - report every failed node, then fail
                failed.add(name)
                errors.append(f"{name}: {e}")
                continue
            parent.log_metrics({f"{name}/{k}": v for k, v in results[name].metrics.items()
                                if isinstance(v, (int, float))}, step=0)
            if results[name].cached and results[name].mlflow_run_id:  # the run this pipeline run reused
                parent.set_tags({f"posttrain.reused.{name}": results[name].mlflow_run_id})
        if errors:
            raise RuntimeError("nodes failed:\n" + "\n".join(errors))
        registered = None
        if cfg.registry.enabled and any(dag.kind(n) == "evaluate" for n in dag.order):
            from posttrain.registry.mlflow_registry import register_and_promote

            registered = register_and_promote(cfg.registry, cfg.tracking.tracking_uri, parent_id,
                                              registry_source(dag, results))
            parent.log_dict(registered, "registry_decision.json")
            logger.info("registry: %s version %s (%s) %s: %s", registered["model_name"], registered["version"],
                        registered["model"], "promoted to champion" if registered["promoted"] else
                        "registered as candidate, not promoted", registered["reason"])
        from posttrain.flows.report import log_reports, publish_run_artifact

        log_reports(cfg, results, parent)
        publish_run_artifact(cfg, dag.order, results, parent, registered)
        leases = release_pool(flow_run_id)
        parent.log_dict(leases, "device_leases.json")
        parent.end("FINISHED")
        return PipelineResult(True, results, parent_id, registered, leases)
    except BaseException as e:
        parent.set_tags({"posttrain.error": f"{type(e).__name__}: {e}"[:5000]})
        parent.end("FAILED")
        logger.error("pipeline failed: %s", e)
        raise
    finally:
        release_pool(flow_run_id)


def registry_source(dag: PipelineDAG, results: dict[str, StageResult]) -> dict[str, Any]:
    """What the registry registers: the model the chosen evaluate node selected (or its first
    model), with that model's evaluation metrics."""
    evals = [n for n in dag.order if dag.kind(n) == "evaluate"]
    name = dag.cfg.registry.evaluate
    if name is not None:
        targets = dag.members.get(name, [])
        if len(targets) != 1 or dag.kind(targets[0]) != "evaluate":
            raise ValueError(f"registry.evaluate: {name!r} is not an evaluate node ({', '.join(evals)})")
        name = targets[0]
    else:
        name = evals[-1]
    m = read_manifest(results[name].output_dir)
    per_model = m.get("results", {})
    if m.get("selected"):
        model_path, model_name = m["selected"]["model"], m["selected"]["name"]
    else:  # the first model it evaluated (`order`: manifests store mappings sorted by key)
        model_name = m["order"][0]
        model_path = m["models"][model_name]
    base = baseline_of(dag, results, m, model_name)
    metric = dag.cfg.registry.promote_metric
    baseline = {"name": base, "value": per_model.get(base, {}).get(metric)} if base else None
    return {"evaluate": name, "model_dir": model_path, "model_name": model_name,
            "metrics": per_model.get(model_name, {}), "lineage": {n: r.digest for n, r in results.items()},
            "runs": {n: r.mlflow_run_id for n, r in results.items() if r.mlflow_run_id},
            "datasets": datasets_of(dag, results), "baseline": baseline}


def datasets_of(dag: PipelineDAG, results: dict[str, StageResult]) -> list[dict[str, str]]:
    """Every file a data_prep node wrote, by content: {name: '<node>/<split>', path, digest (sha256),
    context (training, validation, or eval for a test split), node}."""
    rows = []
    for n in dag.order:
        if dag.kind(n) != "data_prep" or n not in results:
            continue
        m = read_manifest(results[n].output_dir)
        files = m.get("files", {})
        for split, rel in sorted(m.get("outputs", {}).items()):
            if rel in files:
                context = ("eval" if split.endswith("_test") else "validation" if split.endswith("_validation")
                           else "training")  # MLflow's dataset context: what the pipeline used it for
                rows.append({"name": f"{n}/{split}", "path": str(Path(results[n].output_dir) / rel),
                             "digest": files[rel], "context": context, "node": n})
    return rows


def baseline_of(dag: PipelineDAG, results: dict[str, StageResult], evaluated: dict[str, Any],
                candidate: str) -> str | None:
    """The evaluated model the candidate must beat (registry.baseline): a name as given; for
    'auto' the furthest ancestor of the candidate's node, along `model:`, among the models the
    evaluate node evaluated (the model it was trained from); None if there is none."""
    wanted = dag.cfg.registry.baseline
    names = [n for n in evaluated.get("order", []) if n != candidate]
    if wanted is None:
        return None
    if wanted != "auto":
        if wanted not in names:
            raise ValueError(f"registry.baseline: {wanted!r} is not a model evaluate node evaluated "
                             f"({', '.join(names)})")
        return wanted

    def node_of(path: str) -> str | None:
        p = Path(path).resolve()
        return next((n for n, r in results.items() if p == Path(r.output_dir).resolve()
                     or Path(r.output_dir).resolve() in p.parents), None)

    by_node = {node_of(evaluated["models"][n]): n for n in names}
    node, base = node_of(evaluated["models"][candidate]), None
    seen = set()
    while node is not None and node not in seen:
        seen.add(node)
        node = next((e.src for e in dag.nodes[node].edges if e.role == "model"), None)
        if node in by_node:
            base = by_node[node]
    return base


def run_pipeline(cfg: PipelineConfig) -> PipelineResult:
    """Run the flow once from the terminal (Prefect's local ephemeral API unless configured)."""
    return post_training(cfg)


def dry_run(dag: PipelineDAG) -> dict[str, dict[str, Any]]:
    """What a run would do, node by node, without launching: `cached` (its output holds this exact
    result), `resume` (a crashed attempt with the same key left checkpoints), or `run`; a node
    after one that runs is `run` too (its inputs are not known yet)."""
    status: dict[str, dict[str, Any]] = {}
    done: dict[str, Upstream] = {}
    for name in dag.order:
        row: dict[str, Any] = {"kind": dag.kind(name), "inputs": dag.inputs(name), "output_dir": str(dag.output_dir(name))}
        if all(u in done for u in dag.inputs(name)):
            spec, key = plan_node(dag, name, {u: done[u] for u in dag.inputs(name)}, fetch=False)
            out = Path(spec.output_dir)
            same = (out / KEY_FILE).exists() and (out / KEY_FILE).read_text() == key
            row["status"] = "cached" if same and is_stage_dir(out) else "resume" if same else "run"
            row["key"] = key[:12]
            if row["status"] == "cached":
                r = StageResult.of(name, dag.kind(name), out, True)
                done[name] = Upstream(r.output_dir, r.digest, r.selected)
        else:
            row["status"] = "run"
        status[name] = row
    return status
