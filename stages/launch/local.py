"""The local runner: one torchrun started here per node launcher (kind 'local' standalone, or
'multinode' meeting the others at a c10d rendezvous), stopped with its whole process tree.

torchrun runs in its own session and passes SIGTERM to its workers, but puts each worker in a
session of its own, so `terminate` snapshots the tree first, SIGTERMs torchrun (or, when torchrun
itself was killed, its workers directly), and after the grace period SIGKILLs whatever of the tree
is still alive.

The tree is also recorded in the launch's workdir (`processes-node<i>.json`, with the launching
process). When the launching process is killed outright, torchrun and its ranks get SIGTERM from
the kernel and stop on their own time (a training rank first checkpoints); `await_earlier`, at the
next launch from that workdir, waits for them, and kills them past a timeout, so that two jobs
never write one stage directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from posttrain.core.atomic import write_json_atomic
from posttrain.stages.launch import proctree
from posttrain.stages.launch.base import LaunchError
from posttrain.stages.launch.logstream import LogSink, pump

# In the launch's workdir, per host and node: {"owner": [pid, start], "processes": {pid: start}}.
RECORD = "processes-{host}-node{node}.json"


class LocalNode:
    """One torchrun started here, in its own session, its output pumped into the sink."""

    job_id = None

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, sink: LogSink, prefix: str = "",
                 grace_s: float = 15.0, record: Path | None = None):
        self.grace_s = grace_s  # for leftovers of a dead torchrun, as for a cancel
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        # Known descendants. Refreshed now and then, so that if torchrun itself dies (OOM killer)
        # the workers it leaves behind, now children of init, can still be found and killed.
        self._known: dict[int, int] = {}
        self._next_scan = 0.0
        self._record, self._recorded = record, 0
        self._pump = pump(self.proc.stdout, sink, prefix)
        self._scan()

    def _scan(self) -> None:
        if self.proc.returncode is None:
            self._known.update(proctree.tree(self.proc.pid))
            if self._record is not None and len(self._known) != self._recorded:
                me = os.getpid()
                write_json_atomic(self._record, {"owner": [me, proctree.start_time(me)],
                                                 "processes": {str(p): s for p, s in self._known.items()}},
                                  fsync=False)
                self._recorded = len(self._known)

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


def await_earlier(workdir: Path, sink: LogSink, timeout_s: float) -> None:
    """Before a local launch from `workdir`: processes an earlier launch from it left (its
    launching process was killed; they got SIGTERM and are on their way out) are waited for up to
    `timeout_s`, then SIGKILLed. An earlier launch whose launching process still lives is another
    launch of the same stage going on now: LaunchError, as two jobs must not share an output dir."""
    for record in sorted(workdir.glob(RECORD.format(host=socket.gethostname(), node="*"))):
        try:
            data = json.loads(record.read_text())
            owner = (int(data["owner"][0]), int(data["owner"][1]))
            procs = {int(p): int(s) for p, s in data["processes"].items()}
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue  # unreadable: nothing to go by
        left = {p: s for p, s in procs.items() if proctree.alive(p, s)}
        if left and owner[0] != os.getpid() and proctree.alive(*owner):
            raise LaunchError(f"another launch from {workdir} is running (started by pid {owner[0]}, its "
                              f"processes {sorted(left)}): two jobs must not write one stage directory")
        if left:
            sink.put(f"posttrain: processes {sorted(left)} of an earlier launch, whose launcher is gone, still "
                     f"run; waiting up to {timeout_s:.0f}s for them to exit")
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and any(proctree.alive(p, s) for p, s in left.items()):
                time.sleep(0.2)
            for p, s in left.items():
                if proctree.alive(p, s):
                    sink.put(f"posttrain: killing process {p} of the earlier launch")
                    proctree.send(p, signal.SIGKILL)
        record.unlink(missing_ok=True)
