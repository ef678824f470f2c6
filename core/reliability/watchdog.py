"""Hangs: heartbeats from every rank, rank 0 watching them, stacks and collectives dumped by all.

A rank that makes no progress for `timeout_s` makes every rank dump its Python stacks
(faulthandler) and its recent collectives (recorder.py), and rank 0 end the job with EXIT_HUNG.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from posttrain.core.atomic import write_json_atomic
from posttrain.core.distenv import dist_on, rank_world
from posttrain.core.reliability.recorder import RECORDER, FlightRecorder, torch_flight_recorder

log = logging.getLogger("posttrain.reliability")

EXIT_HUNG = 124  # as coreutils `timeout`: the watchdog ended a job that made no progress
DUMP_SIGNAL = signal.SIGUSR2  # faulthandler dumps the stacks on it, even while the GIL is held


def _write_json(path: Path, obj: Any) -> None:
    """Heartbeats and dump files: whole for their readers on other ranks; not worth an fsync."""
    write_json_atomic(path, obj, indent=None, sort_keys=False, default=str, fsync=False)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Watchdog:
    """Heartbeats, hang detection on rank 0, stack and collective dumps on every rank.

    `beat()` is all the training thread does (an integer increment); a daemon thread per rank
    writes the heartbeat file, and on rank 0 also reads every rank's. When one has not changed for
    `timeout_s`, rank 0 writes `dump-request.json`; each rank's thread then writes
    `stacks-rank*.txt` (faulthandler: every thread's Python stack) and `collectives-rank*.json`.
    A rank on rank 0's host that does not answer (its thread stuck behind a held GIL) gets
    DUMP_SIGNAL, on which faulthandler writes its stacks from C. Then rank 0 writes `reason.txt`,
    logs the reason and calls `on_fire` (default: exit with EXIT_HUNG); the other ranks exit too.
    Each start() uses a fresh session dir, so a retry never sees an old request.
    """

    def __init__(self, dir: str | os.PathLike, timeout_s: float, *, interval_s: float | None = None,
                 dump_wait_s: float | None = None, recorder: FlightRecorder | None = None,
                 on_fire: Callable[[str], None] | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.root, self.timeout_s = Path(dir), float(timeout_s)
        self.interval_s = interval_s or min(max(timeout_s / 10, 0.2), 5.0)
        self.dump_wait_s = dump_wait_s or min(max(timeout_s / 2, 3.0), 60.0)
        self.recorder = recorder or RECORDER
        self.on_fire = on_fire or (lambda reason: os._exit(EXIT_HUNG))
        self.rank, self.world = rank_world(env_fallback=True)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.dir: Path | None = None
        self.reason: str | None = None
        self.fired = threading.Event()
        self._progress, self._step, self._phase = 0, 0, "start"
        self._seen: dict[int, tuple[Any, float, dict | None]] = {}
        self._finished: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stacks = None
        self._dumped = False

    # -- the training thread's side ----------------------------------------------------------

    def beat(self, step: int | None = None, phase: str | None = None) -> None:
        self._progress += 1
        if step is not None:
            self._step = step
        if phase is not None:
            self._phase = phase

    def start(self) -> Watchdog:
        """Every rank calls it (it agrees on the session dir with a broadcast)."""
        session = [f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"]
        self.rank, self.world = rank_world(env_fallback=True)
        if dist_on() and self.world > 1:
            dist.broadcast_object_list(session, src=0)
        self.dir = self.root / session[0]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._stacks = open(self.dir / f"stacks-rank{self.rank:05d}.txt", "w")
        if threading.current_thread() is threading.main_thread():
            faulthandler.register(DUMP_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        self._seen.clear()
        self._finished.clear()
        self._stop.clear()
        self._write_heartbeat()
        self._thread = threading.Thread(target=self._run, name="posttrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; a clean stop removes this rank's files (and the session dir when empty)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s * 4 + 1)
            self._thread = None
        if self._stacks is None:
            return
        if threading.current_thread() is threading.main_thread():
            faulthandler.unregister(DUMP_SIGNAL)
        self._stacks.close()
        self._stacks = None
        if not self.fired.is_set() and not self._dumped and self.dir is not None:
            for name in (f"stacks-rank{self.rank:05d}.txt", f"heartbeat-rank{self.rank:05d}.json"):
                (self.dir / name).unlink(missing_ok=True)
            for d in (self.dir, self.root):
                with contextlib.suppress(OSError):
                    d.rmdir()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- the watchdog thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write_heartbeat()
                if (self.dir / "dump-request.json").exists():
                    self._answer_request()
                    return
                if self.rank == 0 and self._check():
                    return
            except Exception:  # the watchdog must never be what kills a healthy job
                log.exception("watchdog iteration failed")

    def _heartbeat(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": self.pid, "host": self.host, "progress": self._progress,
                "step": self._step, "phase": self._phase, "collectives": self.recorder.state(),
                "time": time.time()}

    def _write_heartbeat(self) -> None:
        _write_json(self.dir / f"heartbeat-rank{self.rank:05d}.json", self._heartbeat())

    def _check(self) -> bool:
        """Rank 0: fire when any rank's progress counter has not moved for timeout_s."""
        now = time.monotonic()
        for r in range(self.world):
            if r in self._finished:
                continue
            path = self.dir / f"heartbeat-rank{r:05d}.json"
            hb = self._heartbeat() if r == self.rank else _read_json(path)
            old = self._seen.get(r)
            if hb is None and old is not None and old[2] is not None and not path.exists():
                self._finished.add(r)  # it stopped cleanly (a crashed rank leaves its heartbeat)
                self._seen.pop(r)
                continue
            key = (hb or {}).get("progress")
            if old is None or old[0] != key:
                self._seen[r] = (key, now, hb)
            else:
                self._seen[r] = (key, old[1], hb)
        ages = {r: now - t for r, (_, t, _) in self._seen.items()}
        if not ages or max(ages.values()) < self.timeout_s:
            return False
        # Every rank not moving now is a suspect, not only those past the timeout: the one that
        # stopped first holds up the others, who stop a moment later inside the next collective.
        self._fire({r: a for r, a in ages.items() if a >= min(2 * self.interval_s, self.timeout_s)})
        return True

    def _fire(self, stale: dict[int, float]) -> None:
        beats = {r: hb for r, (_, _, hb) in self._seen.items()}

        def blame(r: int) -> tuple:  # who holds the others up: outside a collective, or the furthest behind
            hb = beats.get(r)
            if hb is None:
                return (0, -1)
            c = hb["collectives"]
            return (1 if c["in_flight"] else 0, c["seq"])

        worst = min(blame(r) for r in stale)
        culprits = sorted(r for r in stale if blame(r) == worst)
        seconds = max(stale[r] for r in culprits)
        who = f"rank {culprits[0]}" if len(culprits) == 1 else f"ranks {', '.join(map(str, culprits))}"
        self.reason = f"watchdog: {who} made no progress for {seconds:.0f} s; stacks in {self.dir}"
        details = [self._describe(r, beats.get(r), stale.get(r)) for r in range(self.world)]
        _write_json(self.dir / "dump-request.json", {"reason": self.reason, "time": time.time()})
        self._dump()
        deadline = time.monotonic() + self.dump_wait_s
        missing = self._missing_dumps()
        while missing and time.monotonic() < deadline:
            time.sleep(0.1)
            missing = self._missing_dumps()
        for r in missing:  # a rank whose thread cannot run: faulthandler answers the signal in C
            hb = beats.get(r)
            if hb and hb["host"] == self.host:
                with contextlib.suppress(OSError):
                    os.kill(hb["pid"], DUMP_SIGNAL)
        if missing:
            time.sleep(1.0)
        text = "\n".join([self.reason, *details,
                          f"no dump from ranks {missing} (signalled those on {self.host})" if missing else
                          "every rank dumped its stacks (stacks-rank*.txt) and collectives (collectives-rank*.json)"])
        (self.dir / "reason.txt").write_text(text + "\n")
        sys.stderr.write(text + "\n")  # not through logging: it must show whatever logging is set to
        sys.stderr.flush()
        self.fired.set()
        self.on_fire(self.reason)

    @staticmethod
    def _describe(r: int, hb: dict | None, stale: float | None) -> str:
        if hb is None:
            return f"  rank {r}: no heartbeat"
        c = hb["collectives"]
        f = c["in_flight"]
        where = (f"waiting in collective #{f['seq']} {f['op']} '{f['name']}' (step {f['step']})" if f else
                 f"not in a collective (last: #{c['seq']}" + (f" {c['last']['name']}" if c["last"] else "") + ")")
        idle = f"no progress for {stale:.0f} s" if stale is not None else "progressing"
        return f"  rank {r} (pid {hb['pid']} on {hb['host']}): step {hb['step']}, {hb['phase']}, {where}; {idle}"

    def _missing_dumps(self) -> list[int]:
        return [r for r in range(self.world)
                if r not in self._finished and not (self.dir / f"dumped-rank{r:05d}").exists()]

    def _dump(self) -> None:
        if self._dumped:
            return
        self._dumped = True
        f = self._stacks
        f.write(f"# rank {self.rank}, pid {self.pid} on {self.host}, step {self._step}, phase {self._phase}, "
                f"at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.flush()
        _write_json(self.dir / f"collectives-rank{self.rank:05d}.json",
                    {"rank": self.rank, "recorded": self.recorder.snapshot(),
                     "torch_flight_recorder": torch_flight_recorder()})
        (self.dir / f"dumped-rank{self.rank:05d}").touch()

    def _answer_request(self) -> None:
        """Ranks other than 0: dump, wait for rank 0 to write the reason, then end this rank too."""
        self._dump()
        reason = _read_json(self.dir / "dump-request.json") or {}
        deadline = time.monotonic() + self.dump_wait_s + 10
        while not (self.dir / "reason.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.fired.set()
        self.reason = reason.get("reason", "watchdog: rank 0 requested a dump")
        self.on_fire(self.reason)
