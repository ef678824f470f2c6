"""The trackers: Tracker (rank 0; buffered, delivered by one background thread, never blocking
training on MLflow), NullTracker (every other rank, or tracking off), create_tracker. The package
docstring (core/tracking/__init__.py) says how delivery, outages and run nesting work."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Mapping

from posttrain.core.tracking.params import (MASK, MAX_TAG_LEN, check_artifact_path, clean_key,
                                  flatten_params, is_secret_key, mask_secrets, plain, truncate)
from posttrain.core.tracking.recovery import process_tags

logger = logging.getLogger(__name__)

PARENT_ENV = ("POSTTRAIN_PARENT_RUN_ID", "MLFLOW_PARENT_RUN_ID")
PARENT_TAG = "mlflow.parentRunId"
# The MLflow 3 UI's experiment type: what page an experiment opens on (runs table, not GenAI traces).
EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT = "mlflow.experimentKind", "custom_model_development"
METRICS_PER_BATCH, PARAMS_PER_BATCH = 1000, 100
# Errors MLflow will answer the same way however often we retry: drop the data, do not buffer it.
PERMANENT = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE",
             "RESOURCE_DOES_NOT_EXIST", "PERMISSION_DENIED", "UNAUTHENTICATED"}

# ------------------------------------------------------------------------------ trackers

class NullTracker:
    """What ranks other than 0 (or a disabled config) get: every call does nothing."""

    run_id: str | None = None
    dropped = 0

    def log_params(self, params: Any, prefix: str = "") -> None: ...
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None: ...
    def log_dict(self, d: Any, artifact_file: str) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_figure(self, figure: Any, artifact_file: str) -> None: ...
    def child_env(self) -> dict[str, str]:
        return {}

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def end(self, status: str = "FINISHED") -> None: ...
    close = end

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.end(_exit_status(exc_type))


def _exit_status(exc_type) -> str:
    if exc_type is None:
        return "FINISHED"
    return "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"


def create_tracker(tracking: Any, run_name: str, parent_run_id: str | None = None,
                   tags: Mapping[str, str] | None = None, run_id: str | None = None,
                   rank: int | None = None, **kwargs: Any) -> Tracker | NullTracker:
    """A Tracker on rank 0 (RANK from torchrun's env unless given), a NullTracker elsewhere."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if rank != 0 or not getattr(tracking, "enabled", True):
        return NullTracker()
    return Tracker(tracking, run_name, parent_run_id=parent_run_id, tags=tags, run_id=run_id, **kwargs)


class Tracker(NullTracker):
    """One MLflow run (created, or resumed by `run_id`), fed from memory by a delivery thread.

    `tracking` is a posttrain.core.config.TrackingConfig or anything with tracking_uri and experiment
    (artifact_location, system_metrics, tags are optional). `tracking_uri` may be re-pointed
    later (a failover); the next delivery reconnects.
    """

    def __init__(self, tracking: Any, run_name: str, parent_run_id: str | None = None,
                 tags: Mapping[str, str] | None = None, run_id: str | None = None, *,
                 flush_every: int = 500, flush_interval_s: float = 10.0, max_buffer: int = 100_000,
                 max_backoff_s: float = 60.0, connect_timeout_s: float = 60.0, close_timeout_s: float = 30.0,
                 system_metrics: bool | None = None):
        self.tracking_uri: str = tracking.tracking_uri
        self.experiment: str = tracking.experiment
        self.artifact_location = getattr(tracking, "artifact_location", None)
        # system_metrics: overrides the config's (runs that are not a stage's, e.g. the pipeline's parent, pass False)
        self.system_metrics = bool(getattr(tracking, "system_metrics", False) if system_metrics is None
                                   else system_metrics)
        self.run_name = run_name
        self.parent_run_id = parent_run_id or next((os.environ[e] for e in PARENT_ENV if os.environ.get(e)), None)
        self.run_id = run_id
        self.experiment_id: str | None = None
        self.flush_every, self.flush_interval_s, self.max_buffer = flush_every, flush_interval_s, max_buffer
        self.max_backoff_s, self.close_timeout_s = max_backoff_s, close_timeout_s
        self.dropped = 0  # metric points lost to a full buffer or rejected by MLflow

        self._lock = threading.Lock()  # guards the buffers; never held during I/O
        self._metrics: deque[tuple[int, str, float, int, int]] = deque()  # (seq, key, value, ms, step)
        self._seq = 0
        self._params: dict[str, str] = {}
        self._logged_params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._artifacts: deque[tuple[str, str | None]] = deque()
        self._wake, self._stop = threading.Event(), threading.Event()
        # where the run runs, so that a later run can tell it was killed (posttrain.core.tracking.recovery)
        self.set_tags({**getattr(tracking, "tags", {}), **(tags or {}), **process_tags()})

        self._client = None
        self._running = False  # the run exists and is RUNNING (created or resumed)
        self._monitor = None
        self._end_status: str | None = None
        self._ended = False
        self._disabled: str | None = None
        self._outage_since: float | None = None
        self._backoff = 0.0
        self._retry_at = 0.0
        self._staging = Path(tempfile.mkdtemp(prefix="posttrain-mlflow-"))

        # Delivery attempts are numbered; flush() waits for one that started after it was called.
        self._cond = threading.Condition()
        self._started = self._finished = 0
        self._last_ok = self._force = False
        self._thread = threading.Thread(target=self._loop, name="mlflow-tracker", daemon=True)
        self._thread.start()
        # Wait for the first attempt so run_id is known; an outage only delays it. A run resumed by
        # id (a stage the pipeline flow opened a run for) has its id already: it starts at once,
        # and the thread imports mlflow and resumes the run while the stage loads its model.
        if run_id is None:
            with self._cond:
                if not self._cond.wait_for(lambda: self._finished > 0, timeout=connect_timeout_s):
                    logger.warning("MLflow at %s did not answer within %.0fs; logging to memory meanwhile",
                                   self.tracking_uri, connect_timeout_s)

    # -------------------------------------------------------------------------- logging (buffer only)

    def log_params(self, params: Any, prefix: str = "") -> None:
        """Flattened, stringified, truncated, masked. MLflow params are immutable: a changed value
        for a key already logged is warned about and not sent."""
        with self._lock:
            for k, v in flatten_params(params, prefix).items():
                old = self._logged_params.get(k)
                if old is not None and old != v:
                    logger.warning("param %s already logged as %r; MLflow keeps the first value, not %r", k, old, v)
                    continue
                self._logged_params[k] = self._params[k] = v
        self._wake.set()

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        now = int(time.time() * 1000)
        with self._lock:
            for k, v in metrics.items():
                if len(self._metrics) >= self.max_buffer:
                    self._metrics.popleft()
                    self.dropped += 1
                    if self.dropped == 1:
                        logger.warning("MLflow metric buffer full (%d points); dropping the oldest", self.max_buffer)
                self._seq += 1
                value = float(v.item() if hasattr(v, "item") else v)
                self._metrics.append((self._seq, clean_key(k), value, now, int(step or 0)))
            full = len(self._metrics) >= self.flush_every
        if full:
            self._wake.set()

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        with self._lock:
            for k, v in tags.items():
                self._tags[clean_key(k)] = MASK if is_secret_key(k) else truncate(mask_secrets(str(v)), MAX_TAG_LEN)
        self._wake.set()

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file or directory in the background: it must stay in place until flush()/end()."""
        check_artifact_path(artifact_path)
        with self._lock:
            self._artifacts.append((str(path), artifact_path))
        self._wake.set()

    def _stage(self, artifact_file: str) -> Path:
        check_artifact_path(artifact_file, "artifact file")
        path = self._staging / uuid.uuid4().hex / Path(artifact_file).name
        path.parent.mkdir(parents=True)
        return path

    def _log_staged(self, path: Path, artifact_file: str) -> None:
        self.log_artifact(path, str(Path(artifact_file).parent) if Path(artifact_file).parent != Path(".") else None)

    def log_dict(self, d: Any, artifact_file: str) -> None:
        """As JSON, or YAML when artifact_file ends in .yaml/.yml."""
        path = self._stage(artifact_file)
        if path.suffix in (".yaml", ".yml"):
            import yaml
            path.write_text(yaml.safe_dump(plain(d), sort_keys=False))
        else:
            path.write_text(json.dumps(plain(d), indent=2, default=str))
        self._log_staged(path, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        path = self._stage(artifact_file)
        path.write_text(text)
        self._log_staged(path, artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure (savefig) or a plotly one (.html via write_html)."""
        path = self._stage(artifact_file)
        if hasattr(figure, "savefig"):
            figure.savefig(path)
        else:
            figure.write_html(str(path))
        self._log_staged(path, artifact_file)

    def child_env(self) -> dict[str, str]:
        """Env for a stage process whose run nests under this one."""
        return {"POSTTRAIN_PARENT_RUN_ID": self.run_id, "MLFLOW_TRACKING_URI": self.tracking_uri} if self.run_id else {}

    def pending(self) -> int:
        with self._lock:
            return len(self._metrics) + len(self._params) + len(self._tags) + len(self._artifacts)

    # -------------------------------------------------------------------------- flush / end

    def flush(self, timeout: float | None = None) -> bool:
        """Deliver now (ignoring the backoff window); True if everything pending was delivered."""
        if not self._thread.is_alive():
            return False
        with self._cond:
            target = self._started + 1
            self._force = True
            self._wake.set()
            if not self._cond.wait_for(lambda: self._finished >= target, timeout=timeout):
                return False
            return self._last_ok

    def end(self, status: str = "FINISHED") -> None:
        """Final flush (bounded by close_timeout_s), then mark the run `status` and stop."""
        if self._ended:
            return
        self._ended = True
        self._end_status = status
        if not self.flush(timeout=self.close_timeout_s):
            logger.warning("could not deliver everything to MLflow at %s before closing: %d items "
                           "pending, %d metric points dropped; they are lost", self.tracking_uri,
                           self.pending(), self.dropped)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=1.0)
        shutil.rmtree(self._staging, ignore_errors=True)

    close = end

    # -------------------------------------------------------------------------- delivery thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                due = self._force or time.monotonic() >= self._retry_at
                if due:
                    self._force = False
                    self._started += 1
                    attempt = self._started
            if due:
                ok = self._deliver()
                with self._cond:
                    self._finished, self._last_ok = attempt, ok
                    self._cond.notify_all()
            if self._stop.is_set():
                return
            self._wake.wait(timeout=self.flush_interval_s)
            self._wake.clear()

    def _deliver(self) -> bool:
        if self._disabled:
            return False
        try:
            client = self._ensure_run()
            self._send_params_and_tags(client)
            self._send_metrics(client)
            self._send_artifacts(client)
            if self._end_status is not None:
                if self._monitor is not None:
                    _finish_monitor(self._monitor)
                    self._monitor = None
                client.set_terminated(self.run_id, self._end_status)
        except Exception as e:
            if not self._running and _is_permanent(e):
                self._disabled = _short(e)
                logger.error("MLflow run %r cannot be created or resumed (%s); tracking is off for this run",
                             self.run_name, self._disabled)
                return False
            self._client = None  # reconnect next time, perhaps to a re-pointed tracking_uri
            self._backoff = min(max(1.0, 2 * self._backoff), self.max_backoff_s)
            self._retry_at = time.monotonic() + self._backoff
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                logger.warning("MLflow at %s is unreachable or failing (%s); buffering in memory (up to %d "
                               "metric points) and retrying with backoff", self.tracking_uri, _short(e),
                               self.max_buffer)
            return False
        if self._outage_since is not None:
            logger.warning("MLflow at %s is back after %.0fs; buffered data delivered (%d metric points "
                           "dropped)", self.tracking_uri, time.monotonic() - self._outage_since, self.dropped)
            self._outage_since = None
        self._backoff = 0.0
        return True

    def _ensure_run(self):
        from mlflow import MlflowClient

        if self._client is None:
            self._client = MlflowClient(self.tracking_uri)
        client = self._client
        if self.run_id is None:
            self.experiment_id = experiment_id(client, self.experiment, self.artifact_location)
            with self._lock:
                tags, self._tags = self._tags, {}
            if self.parent_run_id:
                tags[PARENT_TAG] = self.parent_run_id
            try:
                run = client.create_run(self.experiment_id, run_name=self.run_name, tags=tags)
            except Exception:
                with self._lock:
                    self._tags = {**tags, **self._tags}
                    self._tags.pop(PARENT_TAG, None)
                raise
            self.run_id = run.info.run_id
            self._running = True
            self._start_system_metrics()
        elif not self._running:  # resume by id, as mlflow.start_run(run_id=...) does
            run = client.get_run(self.run_id)
            self.experiment_id = run.info.experiment_id
            client.update_run(self.run_id, status="RUNNING")
            if self.parent_run_id and PARENT_TAG not in run.data.tags:
                client.set_tag(self.run_id, PARENT_TAG, self.parent_run_id)
            self._running = True
            self._start_system_metrics(resume=True)
        return client

    def _start_system_metrics(self, resume: bool = False) -> None:
        if not self.system_metrics:
            return
        try:
            import psutil  # noqa: F401  (mlflow's monitor needs it)
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except ImportError:
            logger.warning("system_metrics needs psutil; not sampling CPU/GPU/memory")
            return
        # resume: a resumed run's system/ steps continue after its last one (a restarted stage)
        self._monitor = SystemMetricsMonitor(self.run_id, tracking_uri=self.tracking_uri, resume_logging=resume)
        self._monitor.start()

    def _send_params_and_tags(self, client) -> None:
        from mlflow.entities import Param, RunTag

        with self._lock:
            params, tags = list(self._params.items()), list(self._tags.items())
        for i in range(0, max(len(params), len(tags)), PARAMS_PER_BATCH):
            p, t = params[i:i + PARAMS_PER_BATCH], tags[i:i + PARAMS_PER_BATCH]
            self._batch(client, "params/tags", params=[Param(k, v) for k, v in p], tags=[RunTag(k, v) for k, v in t])
            with self._lock:  # a value re-set meanwhile stays pending
                for k, v in p:
                    if self._params.get(k) == v:
                        del self._params[k]
                for k, v in t:
                    if self._tags.get(k) == v:
                        del self._tags[k]

    def _send_metrics(self, client) -> None:
        from mlflow.entities import Metric

        while True:
            with self._lock:
                chunk = [self._metrics[i] for i in range(min(METRICS_PER_BATCH, len(self._metrics)))]
            if not chunk:
                return
            if not self._batch(client, "metrics", metrics=[Metric(k, v, ts, s) for _, k, v, ts, s in chunk]):
                self.dropped += len(chunk)
            last = chunk[-1][0]
            with self._lock:  # by sequence number: log_metrics may have dropped the oldest meanwhile
                while self._metrics and self._metrics[0][0] <= last:
                    self._metrics.popleft()

    def _send_artifacts(self, client) -> None:
        while True:
            with self._lock:
                if not self._artifacts:
                    return
                path, artifact_path = self._artifacts[0]
            try:
                if os.path.isdir(path):
                    client.log_artifacts(self.run_id, path, artifact_path)
                else:
                    client.log_artifact(self.run_id, path, artifact_path)
            except Exception as e:
                if not (_is_permanent(e) or isinstance(e, FileNotFoundError)):
                    raise
                logger.warning("artifact %s not uploaded: %s", path, _short(e))
            with self._lock:
                self._artifacts.popleft()

    def _batch(self, client, what: str, **entities: Any) -> bool:
        """log_batch; False when MLflow rejects the data itself (retrying would not help)."""
        try:
            client.log_batch(self.run_id, **entities)
        except Exception as e:
            if not _is_permanent(e):
                raise
            logger.warning("MLflow rejected %s for run %s: %s; dropped", what, self.run_id, _short(e))
            return False
        return True


def experiment_id(client, name: str, artifact_location: str | None = None) -> str:
    """The id of experiment `name`, created if missing, tagged as model development (not GenAI:
    the MLflow UI then opens on the runs table, not on Traces)."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location,
                                            tags={EXPERIMENT_KIND_TAG: MODEL_DEVELOPMENT})
        except MlflowException:  # another process created it meanwhile
            return client.get_experiment_by_name(name).experiment_id
    if EXPERIMENT_KIND_TAG not in exp.tags:  # made before posttrain tagged its experiments
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT)
    return exp.experiment_id


def open_run(tracking: Any, run_name: str, parent_run_id: str | None = None,
             tags: Mapping[str, Any] | None = None) -> str:
    """Create a RUNNING run now and return its id, for a process that starts later to resume
    (Tracker(run_id=...)): the pipeline flow opens each stage's child run when it launches the
    stage, so the run's start is the stage's, not the moment the stage's process got to MLflow.
    Tagged with this process (posttrain.core.tracking.recovery ends it if this process dies first; the
    resuming process re-tags it with its own)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking.tracking_uri)
    exp = experiment_id(client, tracking.experiment, getattr(tracking, "artifact_location", None))
    all_tags = {clean_key(k): MASK if is_secret_key(k) else truncate(mask_secrets(str(v)), MAX_TAG_LEN)
                for k, v in {**getattr(tracking, "tags", {}), **(tags or {}), **process_tags()}.items()}
    if parent_run_id:
        all_tags[PARENT_TAG] = parent_run_id
    return client.create_run(exp, run_name=run_name, tags=all_tags).info.run_id


def _finish_monitor(monitor) -> None:
    """Stop MLflow's system-metrics monitor; a run shorter than one sampling interval (which the
    monitor would leave without any) gets one sample, taken now."""
    monitor.finish()
    if getattr(monitor, "_logging_step", 1) == 0:
        try:
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception as e:  # noqa: BLE001 - MLflow internals moved: lose the sample, not the run
            logger.debug("no closing system-metrics sample: %s", e)


def _is_permanent(e: BaseException) -> bool:
    return getattr(e, "error_code", None) in PERMANENT


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
