"""Runs whose process died without ending them.

MLflow keeps a run RUNNING until its client ends it, and a process killed outright (kill -9, the
OOM killer, a flow process whose machine went away) never does: the UI would show the pipeline
"running" forever. So every Tracker tags its run with where it runs (`process_tags`: host, pid
and the pid's start time, which tells a reused pid apart), and the next run of the same pipeline
calls `end_stale_runs` before it opens its own: every RUNNING run of the pipeline (its parent
runs, tagged `posttrain.pipeline`, and their stage child runs) whose process is gone from this
host is ended as KILLED, with a `posttrain.error` tag saying so. A run on another host, or one
without the tags, cannot be checked from here and is left alone; so is a run whose process lives
(another run of the pipeline, going on now). Torch-free: the flow calls it.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

logger = logging.getLogger(__name__)

HOST_TAG, PID_TAG, START_TAG = "posttrain.host", "posttrain.pid", "posttrain.pid_start"
PIPELINE_TAG = "posttrain.pipeline"
PARENT_TAG = "mlflow.parentRunId"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" where there is no /proc)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2:].split()[19]


def process_tags(pid: int | None = None) -> dict[str, str]:
    """Where a run runs: this host, the process `pid` (this one by default), its start time."""
    pid = os.getpid() if pid is None else pid
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(pid), START_TAG: _start_time(pid)}


def process_alive(tags: dict[str, str]) -> bool | None:
    """Whether the process a run's tags name still runs: None when that cannot be told here
    (another host, no tags)."""
    if tags.get(HOST_TAG) != socket.gethostname() or not tags.get(PID_TAG, "").isdigit():
        return None
    pid = int(tags[PID_TAG])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, though not the run's if the start differs
        pass
    start = tags.get(START_TAG)
    if not start or not os.path.isdir("/proc/self"):
        return True
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X") and _start_time(pid) == start


def end_stale_runs(tracking: Any, pipeline: str) -> list[str]:
    """End as KILLED every RUNNING run of pipeline `pipeline` (parents and their children) in
    `tracking`'s experiment whose process is gone; returns their run ids. Never raises: an
    unreachable MLflow only costs the clean-up (logged)."""
    if not getattr(tracking, "enabled", True):
        return []
    try:
        return _end_stale_runs(tracking.tracking_uri, tracking.experiment, pipeline)
    except Exception as e:  # noqa: BLE001 (the pipeline runs on without the clean-up)
        logger.warning("could not look for stale MLflow runs of pipeline %r at %s: %s: %s", pipeline,
                       tracking.tracking_uri, type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
        return []


def _end_stale_runs(tracking_uri: str, experiment: str, pipeline: str) -> list[str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    running = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'", max_results=50_000)
    pipeline_of: dict[str, str | None] = {}  # run id -> its posttrain.pipeline tag

    def pipeline_tag(run_id: str) -> str | None:
        if run_id not in pipeline_of:
            try:
                pipeline_of[run_id] = client.get_run(run_id).data.tags.get(PIPELINE_TAG)
            except Exception:  # noqa: BLE001 (a parent deleted meanwhile)
                pipeline_of[run_id] = None
        return pipeline_of[run_id]

    for r in running:
        pipeline_of[r.info.run_id] = r.data.tags.get(PIPELINE_TAG)
    ended = []
    for r in running:
        tags = r.data.tags
        mine = tags.get(PIPELINE_TAG) == pipeline or (
            PARENT_TAG in tags and pipeline_tag(tags[PARENT_TAG]) == pipeline)
        if not mine or process_alive(tags) is not False:
            continue
        why = (f"process {tags[PID_TAG]} on {tags[HOST_TAG]} ended without ending this run (killed); "
               f"marked KILLED by the next run of pipeline {pipeline!r}")
        client.set_tag(r.info.run_id, "posttrain.error", why)
        client.set_terminated(r.info.run_id, "KILLED")
        ended.append(r.info.run_id)
        logger.warning("MLflow run %s (%s): %s", r.info.run_id, r.info.run_name, why)
    return ended
