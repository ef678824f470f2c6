"""Process trees from /proc: who descends from a torchrun, and whether a pid is still that process.

torchrun puts each worker in a session of its own, so no process-group kill reaches them all; the
local runner snapshots the tree instead and signals every member. Where there is no /proc, a tree
is its root alone.
"""

from __future__ import annotations

import os
from pathlib import Path


def _stat(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after "pid (comm) " (comm may hold spaces); OSError if gone."""
    stat = Path("/proc", str(pid), "stat").read_text()
    return stat[stat.rindex(")") + 2:].split()


def proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, start time, state) of every process, from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = _stat(name)
            except OSError:  # exited while we looked
                continue
            table[int(name)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def tree(root: int) -> dict[int, int]:
    """pid -> start time of `root` and all its descendants (just `root` where there is no /proc)."""
    if not os.path.isdir("/proc/self"):
        return {root: 0}
    table = proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in found:
            found[pid] = table[pid][1]
            todo += children.get(pid, [])
    return found


def start_time(pid: int) -> int:
    """The process's start time (clock ticks since boot; 0 where there is no /proc); OSError if gone."""
    return int(_stat(pid)[19]) if os.path.isdir("/proc/self") else 0


def alive(pid: int, start: int) -> bool:
    """Still running: not gone, not a zombie, and not a new process that reused the pid."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
    try:
        fields = _stat(pid)
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and int(fields[19]) == start


def send(pid: int, sig: int) -> None:
    """os.kill, quiet when the process is already gone (or no longer ours)."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
