"""How a launch dies with whoever started it: SIGTERM to the waiting flow process cancels the
launch, a torchrun started here gets SIGTERM from the kernel when its launching thread dies, and
each rank gets SIGTERM when its torchrun dies (a training rank then checkpoints and exits 75)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

LAUNCHER_PID_ENV = "POSTTRAIN_LAUNCHER_PID"  # a local launch tells its torchrun who started it
AGENT_PID_ENV = "POSTTRAIN_AGENT_PID"  # the torchrun wrapper tells its ranks who started them


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """In the main thread, with no SIGTERM handler installed, SIGTERM (how Prefect and schedulers
    stop a flow process) raises SystemExit, so `wait` cancels the launch before the process goes.
    A handler someone else installed (Prefect's, which raises in its own way) is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def die_with_launcher(launcher_pid: int) -> bool:
    """Ask the kernel for SIGTERM when the thread that started this process dies (Linux's
    PR_SET_PDEATHSIG); False when the launcher `launcher_pid` is already gone, before that took
    effect. A no-op (True) elsewhere."""
    if not sys.platform.startswith("linux"):
        return True
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    return os.getppid() == launcher_pid


def die_with_agent() -> bool:
    """In a rank: SIGTERM from the kernel when the torchrun that started it dies. torchrun passes
    its own SIGTERM on, but a torchrun killed outright (SIGKILL, the OOM killer) would leave its
    ranks running, training and writing into the stage directory while the flow's rerun of the
    stage starts there. False when that torchrun is already gone (the rank should exit); True
    when there is none to die with (a rank not started by the wrapper) or not on Linux."""
    agent = os.environ.pop(AGENT_PID_ENV, None)
    if not agent or not agent.isdigit():
        return True
    return die_with_launcher(int(agent))
