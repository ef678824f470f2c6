"""The local runner: one torchrun started here per node launcher (kind 'local' standalone, or
'multinode' meeting the others at a c10d rendezvous), stopped with its whole process tree.

torchrun runs in its own session and passes SIGTERM to its workers, but puts each worker in a
session of its own, so `terminate` snapshots the tree first, SIGTERMs torchrun (or, when torchrun
itself was killed, its workers directly), and after the grace period SIGKILLs whatever of the tree
is still alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from stages.launch import proctree
from stages.launch.logstream import LogSink, pump


class LocalNode:
    """One torchrun started here, in its own session, its output pumped into the sink."""

    job_id = None

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, sink: LogSink, prefix: str = "",
                 grace_s: float = 15.0):
        self.grace_s = grace_s  # for leftovers of a dead torchrun, as for a cancel
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        # Known descendants. Refreshed now and then, so that if torchrun itself dies (OOM killer)
        # the workers it leaves behind, now children of init, can still be found and killed.
        self._known: dict[int, int] = {}
        self._next_scan = 0.0
        self._pump = pump(self.proc.stdout, sink, prefix)

    def _scan(self) -> None:
        if self.proc.returncode is None:
            self._known.update(proctree.tree(self.proc.pid))

    def _leftovers(self) -> bool:
        return any(proctree.alive(p, s) for p, s in self._known.items() if p != self.proc.pid)

    def poll(self) -> int | None:
        if time.monotonic() >= self._next_scan:
            self._scan()
            self._next_scan = time.monotonic() + 2.0
        rc = self.proc.poll()
        if rc is not None and self._leftovers():
            self.terminate(grace_s=self.grace_s)  # torchrun is gone; its leftovers must not outlive it
        if rc is not None:
            self._pump.join(timeout=5.0)  # the last lines, before the caller reads the log
        return rc

    def terminate(self, grace_s: float) -> None:
        self._scan()  # before signalling: once torchrun exits, its workers leave its tree
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # torchrun passes SIGTERM on to its workers
        else:  # torchrun is gone (killed): nobody passes SIGTERM on, so the workers get it from here
            for pid, start in self._known.items():
                if pid != self.proc.pid and proctree.alive(pid, start):
                    proctree.send(pid, signal.SIGTERM)  # a training rank checkpoints and ends its run
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._scan()  # a restart may have started new workers
            if self.proc.poll() is not None and not any(proctree.alive(p, s) for p, s in self._known.items()):
                break
            time.sleep(0.05)
        for pid, start in self._known.items():
            if proctree.alive(pid, start):
                proctree.send(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._pump.join(timeout=5.0)
