"""Devices for concurrent nodes: each node declares what it uses (its launcher's ranks, on GPUs or
CPUs) and waits until that many are free; GPU nodes get disjoint devices through
CUDA_VISIBLE_DEVICES, so two nodes never share a GPU unless `resources.share_gpus` says so.

Only local launches are counted: a Slurm or Kubernetes job gets its devices from its scheduler.

    pool = DevicePool(gpus=8, cpu_slots=16)
    with pool.lease("gpu", 4, node="sft") as ids:    # blocks until 4 GPUs are free
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("posttrain.resources")


def visible_gpus() -> int:
    """GPUs this process may use, without importing torch: CUDA_VISIBLE_DEVICES, else nvidia-smi."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


class DevicePool:
    """Free GPU indices and CPU rank slots, handed out under one lock, first come first served."""

    def __init__(self, gpus: int, cpu_slots: int, share_gpus: bool = False):
        self.total = {"gpu": gpus, "cpu": cpu_slots}
        self.share_gpus = share_gpus
        self._free = {"gpu": list(range(gpus)), "cpu": list(range(cpu_slots))}
        self._cond = threading.Condition()
        self.history: list[dict] = []  # {node, kind, ids, start, end} per lease, in grant order

    def check(self, kind: str, n: int, node: str) -> None:
        if n > self.total[kind]:
            what = "resources.gpus" if kind == "gpu" else "resources.cpu_slots"
            raise ValueError(f"nodes.{node}: needs {n} {kind.upper()} rank(s) at once but {what} = "
                             f"{self.total[kind]}; lower its launcher.nproc_per_node or raise {what}")

    @contextlib.contextmanager
    def lease(self, kind: str, n: int, node: str = "") -> Iterator[list[int]]:
        self.check(kind, n, node)
        if kind == "gpu" and self.share_gpus:
            yield list(range(n))
            return
        with self._cond:
            while len(self._free[kind]) < n:
                log.info("%s waits for %d free %s slot(s)", node, n, kind)
                self._cond.wait()
            ids, self._free[kind] = self._free[kind][:n], self._free[kind][n:]
            entry = {"node": node, "kind": kind, "ids": list(ids), "start": time.time(), "end": None}
            self.history.append(entry)
        try:
            yield ids
        finally:
            with self._cond:
                entry["end"] = time.time()
                self._free[kind] = sorted(self._free[kind] + ids)
                self._cond.notify_all()


def needs(device: str, nproc: int, launcher_kind: str, gpus: int) -> tuple[str, int] | None:
    """What a node asks of the pool: (kind, ranks), or None when a scheduler places it."""
    if launcher_kind != "local":
        return None
    if device == "cuda" or (device == "auto" and gpus > 0):
        return "gpu", nproc
    return "cpu", nproc


_POOLS: dict[str, DevicePool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(run_id: str, gpus: int, cpu_slots: int, share_gpus: bool) -> DevicePool:
    """The pool of one flow run (its tasks run as threads of the flow's process)."""
    with _POOLS_LOCK:
        if run_id not in _POOLS:
            _POOLS[run_id] = DevicePool(gpus, cpu_slots, share_gpus)
        return _POOLS[run_id]


def release_pool(run_id: str) -> list[dict]:
    """Forget a finished flow run's pool; returns its lease history."""
    with _POOLS_LOCK:
        pool = _POOLS.pop(run_id, None)
    return pool.history if pool is not None else []
