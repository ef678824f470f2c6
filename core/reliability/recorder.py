"""What a hang dump shows of the collectives: our ring buffer of the last ones issued (which, at
which step, finished or not), torch's own flight recorder, and the collective timeout backstop."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from posttrain.core.distenv import dist_on


def prepare_process_group(timeout_s: float | None) -> dict[str, Any]:
    """init_process_group kwargs with the collective timeout; also turns on torch's flight
    recorder (TORCH_FR_BUFFER_SIZE, unless set: it must be set before the group exists), whose
    trace the watchdog adds to its dumps."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "1000")
    return {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}


@dataclass
class CollectiveRecord:
    seq: int
    op: str
    name: str
    shape: list[int]
    dtype: str
    group_size: int
    step: int
    start: float
    end: float | None = None
    error: str | None = None


class FlightRecorder:
    """The last `size` collectives this process issued through `all_reduce` below: which, at which
    step, when, and whether it finished. A hang shows who waits in which collective."""

    def __init__(self, size: int = 64):
        self.records: deque[CollectiveRecord] = deque(maxlen=size)
        self.seq = 0
        self.step = 0  # set by the loop: the step being attempted
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def record(self, op: str, name: str, tensor: torch.Tensor | None = None, group=None) -> Iterator[None]:
        size = dist.get_world_size(group) if dist_on() else 1
        with self._lock:
            self.seq += 1
            rec = CollectiveRecord(self.seq, op, name, list(tensor.shape) if tensor is not None else [],
                                   str(tensor.dtype).removeprefix("torch.") if tensor is not None else "",
                                   size, self.step, time.time())
            self.records.append(rec)
        try:
            yield
        except BaseException as e:
            rec.error = f"{type(e).__name__}: {e}"[:500]
            raise
        finally:
            rec.end = time.time()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return [asdict(r) for r in self.records]

    def state(self) -> dict[str, Any]:
        """What a heartbeat carries: the count issued, and the one in flight (if any)."""
        with self._lock:
            last = self.records[-1] if self.records else None
            flight = last if last is not None and last.end is None else None
            return {"seq": self.seq, "in_flight": asdict(flight) if flight else None,
                    "last": asdict(last) if last else None}


RECORDER = FlightRecorder()
"""The process's recorder (collectives are per process, like torch's own flight recorder)."""


def all_reduce(tensor: torch.Tensor, group=None, op=None, name: str = "all_reduce") -> torch.Tensor:
    """dist.all_reduce, recorded in RECORDER under `name`."""
    with RECORDER.record("all_reduce", name, tensor, group):
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    return tensor


def torch_flight_recorder(timeout: float = 5.0) -> Any:
    """torch's own trace of this process's collectives (gloo and NCCL), if it was enabled."""
    if not int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0):
        return "disabled (TORCH_FR_BUFFER_SIZE unset)"
    box: list[Any] = ["timed out"]

    def dump() -> None:
        try:
            from torch._C._distributed_c10d import _dump_fr_trace_json
            box[0] = json.loads(_dump_fr_trace_json(True, False))
        except Exception as e:  # a private API: report, never fail the dump over it
            box[0] = f"unavailable: {type(e).__name__}: {e}"

    t = threading.Thread(target=dump, daemon=True)
    t.start()
    t.join(timeout)  # a wedged backend must not stop the stacks from being written
    return box[0]
