"""Preemption: SIGTERM becomes a checkpoint at the next step boundary and exit code 75.

The signal handler only records the request; the ranks agree on it at a step boundary (one
all-reduce), fit writes a final checkpoint and raises Preempted. A timer started by the signal
exits hard once the grace period is over: checkpoints are atomic, so `latest` stays the previous one.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from posttrain.core.distenv import dist_on
from posttrain.core.reliability.recorder import all_reduce

log = logging.getLogger("posttrain.reliability")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint written; retrying resumes


class Preempted(SystemExit):
    """Raised by fit after a preemption signal, once the final checkpoint is written. A SystemExit,
    so an uncaught one ends the process with EXIT_PREEMPTED and no traceback."""

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(EXIT_PREEMPTED)
        self.step, self.checkpoint = step, checkpoint

    def __str__(self) -> str:
        where = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint written"
        return f"preempted at step {self.step} ({where}); exit code {EXIT_PREEMPTED}, resume to continue"


class Preemption:
    """A handler for SIGTERM (and `signals`) that only records the request; the loop acts on it
    at a step boundary. From the first signal, `grace_s` is allowed until a hard exit."""

    def __init__(self, grace_s: float = 60.0, signals: tuple[int, ...] = (signal.SIGTERM,),
                 on_expire: Callable[[], None] | None = None):
        self.grace_s, self.signals = grace_s, signals
        self.on_expire = on_expire or (lambda: os._exit(EXIT_PREEMPTED))
        self.requested: int | None = None  # the signal received
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption handler not installed: signal handlers need the main thread")
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """Restore the previous handlers. A grace timer already running keeps running: the
        process is on its way out and must not outlive the grace period."""
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def close(self) -> None:
        self.uninstall()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            return  # torchrun and Slurm may signal twice; the grace timer is already running
        self.requested = signum
        log.warning("received %s: checkpointing at the end of this step, then exiting with code %d "
                    "(%.0f s grace)", signal.Signals(signum).name, EXIT_PREEMPTED, self.grace_s)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        try:  # nothing here may stand between the timer and the exit
            sys.stderr.write(f"preemption: no clean exit within {self.grace_s:.0f} s of the signal; exiting "
                             f"hard with code {EXIT_PREEMPTED} (the latest checkpoint is the last complete one). "
                             "Where the main thread was:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except Exception:
            pass
        finally:
            self.on_expire()

    def agreed(self, device: torch.device | None = None) -> bool:
        """True on every rank when any rank was signalled (one all-reduce in a distributed job)."""
        flag = 1.0 if self.requested is not None else 0.0
        if dist_on() and dist.get_world_size() > 1:
            t = torch.tensor([flag], device=device if device is not None and device.type == "cuda" else "cpu")
            all_reduce(t, op=dist.ReduceOp.MAX, name="loop/preempt_flag")
            flag = float(t.item())
        return flag > 0
