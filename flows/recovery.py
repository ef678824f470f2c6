"""What a killed pipeline run leaves behind, cleared by the next run of the pipeline at its start.

A flow process killed outright (kill -9, the OOM killer) cannot clean up after itself. Its job
dies with it (posttrain.stages.launch: torchrun and the ranks get SIGTERM from the kernel, and the next
launch of a stage waits for any leftovers), and its outputs resume from their checkpoints; what is
left is bookkeeping, which `recover` (one call at the start of the flow) puts right:

- MLflow: the pipeline's runs still RUNNING whose process is gone (its parent runs and their stage
  child runs) end as KILLED (posttrain.core.tracking.recovery.end_stale_runs);
- Prefect: the flow runs of those parent runs, still Running, are set Crashed;
- Prefect's ephemeral API server: `posttrain run` without a Prefect server starts one as a child
  process (Prefect's SubprocessASGIServer), which would outlive a killed flow for good. Each run
  notes its server and owner under PREFECT_HOME; a server whose owner is gone is stopped.

Every step only logs what it cannot do: the pipeline runs on without the clean-up.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

from posttrain.core.tracking.recovery import end_stale_runs
from posttrain.stages.launch import proctree

log = logging.getLogger("posttrain.flow")

SERVER_APP = "prefect.server.api.server:create_app"  # in the ephemeral server's command line


def recover(tracking: Any, pipeline: str) -> dict[str, list[str]]:
    """Clear what killed runs of `pipeline` left (see the module docstring); returns what was
    cleared: {"mlflow_runs": [...], "prefect_flow_runs": [...], "servers": [pid, ...]}."""
    ended = end_stale_runs(tracking, pipeline)
    done = {"mlflow_runs": ended, "prefect_flow_runs": [], "servers": []}
    try:
        done["prefect_flow_runs"] = _crash_flow_runs(_flow_run_ids(tracking, ended))
    except Exception as e:  # noqa: BLE001
        log.warning("could not mark the flow runs of killed pipeline runs Crashed: %s: %s", type(e).__name__, e)
    try:
        done["servers"] = reap_orphaned_servers(_servers_dir())
    except Exception as e:  # noqa: BLE001
        log.warning("could not look for orphaned Prefect API servers: %s: %s", type(e).__name__, e)
    return done


def _flow_run_ids(tracking: Any, run_ids: list[str]) -> list[str]:
    if not run_ids:
        return []
    from mlflow import MlflowClient

    client = MlflowClient(tracking.tracking_uri)
    tags = [client.get_run(r).data.tags for r in run_ids]
    return [t["prefect.flow_run_id"] for t in tags if t.get("prefect.flow_run_id")]


def _crash_flow_runs(flow_run_ids: list[str]) -> list[str]:
    """Set Crashed each of these Prefect flow runs that is still Running."""
    if not flow_run_ids:
        return []
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    crashed = []
    with get_client(sync_client=True) as client:
        for fid in flow_run_ids:
            run = client.read_flow_run(UUID(fid))
            if run.state is not None and run.state.is_running():
                client.set_flow_run_state(run.id, Crashed(message="the flow process was killed (found by the "
                                                                  "next run of the pipeline)"), force=True)
                crashed.append(fid)
    return crashed


def _servers_dir() -> Path:
    from prefect.settings import PREFECT_HOME

    return Path(PREFECT_HOME.value()) / "posttrain-servers"


def _own_servers() -> list[int]:
    """Pids of this process's children that are Prefect ephemeral API servers."""
    import psutil

    found = []
    for child in psutil.Process().children():
        try:
            if any(SERVER_APP in part for part in child.cmdline()):
                found.append(child.pid)
        except psutil.Error:
            continue
    return found


def reap_orphaned_servers(records: Path) -> list[int]:
    """Note this process's ephemeral servers in `records`, and stop (SIGTERM) the noted servers
    whose owner process is gone; returns the pids stopped."""
    records.mkdir(parents=True, exist_ok=True)
    me = os.getpid()
    for pid in _own_servers():
        try:
            entry = {"server": [pid, proctree.start_time(pid)], "owner": [me, proctree.start_time(me)]}
        except OSError:  # exited meanwhile
            continue
        (records / f"{pid}.json").write_text(json.dumps(entry))
    stopped = []
    for f in sorted(records.glob("*.json")):
        try:
            entry = json.loads(f.read_text())
            server = (int(entry["server"][0]), int(entry["server"][1]))
            owner = (int(entry["owner"][0]), int(entry["owner"][1]))
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            f.unlink(missing_ok=True)
            continue
        if not proctree.alive(*server):
            f.unlink(missing_ok=True)
        elif not proctree.alive(*owner):
            log.warning("stopping Prefect API server pid %d, left running by the killed pipeline process %d",
                        server[0], owner[0])
            proctree.send(server[0], signal.SIGTERM)
            stopped.append(server[0])
            f.unlink(missing_ok=True)
    return stopped
