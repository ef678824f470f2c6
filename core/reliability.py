"""Surviving faults in a training job: bad steps, hangs and preemption. `core.loop.fit` drives it.

- Bad steps. A step whose loss or gradient norm is not finite is skipped by the Trainer; a step
  whose loss is a spike (z-score against a rolling window of accepted losses above a threshold) is
  skipped too. After `max_bad_steps` skipped steps in a row the loop rolls back to the last
  checkpoint, keeping the data position, so the bad batches are not seen again.
- Preemption. SIGTERM only sets a flag; at the next step boundary the ranks agree on it (one
  all-reduce), write a final checkpoint and exit with EXIT_PREEMPTED (75, sysexits' EX_TEMPFAIL:
  "try again"; the flow's retry resumes from that checkpoint). If that takes longer than the
  grace period, a timer exits hard: checkpoints are atomic, so `latest` stays the previous one.
- Hangs. Every rank beats a heartbeat (in memory each micro-step; a thread writes it to
  `<dir>/<session>/heartbeat-rank*.json` every few seconds). Rank 0's thread watches all of them:
  when a rank makes no progress for `timeout_s`, every rank dumps its Python stacks
  (faulthandler) and the collectives it issued last (our ring buffer, plus torch's flight recorder
  when TORCH_FR_BUFFER_SIZE is set), and rank 0 ends the job with EXIT_HUNG and the message
  "watchdog: rank R made no progress for S s; stacks in DIR". The watchdog dir must be visible to
  every rank (a shared filesystem, as checkpoints need). Collective timeouts
  (`prepare_process_group`) are the backstop and must be longer than the watchdog's.

What else survives what, and where it is handled:
- A killed rank: torchrun (`launcher.max_restarts`) restarts the group, which resumes from the
  latest complete checkpoint (model, optimizer, schedule, RNG, data position, spike window) to
  the same weights as an uninterrupted run; past the restarts the flow retries the stage.
- A corrupt or truncated checkpoint: core.checkpoint verifies hashes and falls back to the
  previous one; fit logs `events/checkpoint_skipped`.
- A full disk or I/O error while saving: `checkpoint.on_save_error` = "continue" (train on,
  retry at the next save) or "fail"; either way `latest` stays the previous complete checkpoint.
- MLflow down: core.tracking buffers and retries in the background; training never waits on it.
- Prefect's API down: stages never talk to Prefect (only flows/ do; tests/test_reliability.py
  checks no stage or core module imports it), so a running stage is unaffected; the flow's own
  client retries, and a re-run flow skips finished stages (cache) and resumes the others.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

log = logging.getLogger("posttrain.reliability")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint written; retrying resumes
EXIT_HUNG = 124  # as coreutils `timeout`: the watchdog ended a job that made no progress
DUMP_SIGNAL = signal.SIGUSR2  # faulthandler dumps the stacks on it, even while the GIL is held


class Preempted(SystemExit):
    """Raised by fit after a preemption signal, once the final checkpoint is written. A SystemExit,
    so an uncaught one ends the process with EXIT_PREEMPTED and no traceback."""

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(EXIT_PREEMPTED)
        self.step, self.checkpoint = step, checkpoint

    def __str__(self) -> str:
        where = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint written"
        return f"preempted at step {self.step} ({where}); exit code {EXIT_PREEMPTED}, resume to continue"


class TrainingDiverged(RuntimeError):
    """Bad steps persist and no rollback can help; the message says how many and why."""


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    if _dist_on():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def prepare_process_group(timeout_s: float | None) -> dict[str, Any]:
    """init_process_group kwargs with the collective timeout; also turns on torch's flight
    recorder (TORCH_FR_BUFFER_SIZE, unless set: it must be set before the group exists), whose
    trace the watchdog adds to its dumps."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "1000")
    return {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}


# ------------------------------------------------------------------------------ flight recorder

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
        size = dist.get_world_size(group) if _dist_on() else 1
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


def _torch_flight_recorder(timeout: float = 5.0) -> Any:
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


# ------------------------------------------------------------------------------ loss spikes

class SpikeDetector:
    """z = (loss - mean) / std over the last `window` accepted losses; a spike when z > zscore.

    Active once `min_history` losses are in (default half the window). The std has a floor of
    1e-3 x |mean|, so a flat run of identical losses does not make every wiggle a spike. Only
    accepted losses enter the window, so a spike does not raise the bar for the next one."""

    def __init__(self, zscore: float = 6.0, window: int = 100, min_history: int | None = None):
        if zscore <= 0 or window < 2:
            raise ValueError(f"zscore must be > 0 and window >= 2, got {zscore}, {window}")
        self.threshold = zscore
        self.min_history = min_history or max(2, window // 2)
        self.losses: deque[float] = deque(maxlen=window)

    def zscore(self, loss: float) -> float | None:
        if len(self.losses) < self.min_history or not math.isfinite(loss):
            return None
        n = len(self.losses)
        mean = sum(self.losses) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / n)
        return (loss - mean) / max(std, 1e-3 * abs(mean), 1e-12)

    def is_spike(self, loss: float) -> float | None:
        """The z-score when `loss` is a spike, else None."""
        z = self.zscore(loss)
        return z if z is not None and z > self.threshold else None

    def accept(self, loss: float) -> None:
        if math.isfinite(loss):
            self.losses.append(float(loss))

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.clear()
        self.losses.extend(float(x) for x in state["losses"])


# ------------------------------------------------------------------------------ preemption

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
        if _dist_on() and dist.get_world_size() > 1:
            t = torch.tensor([flag], device=device if device is not None and device.type == "cuda" else "cpu")
            all_reduce(t, op=dist.ReduceOp.MAX, name="loop/preempt_flag")
            flag = float(t.item())
        return flag > 0


# ------------------------------------------------------------------------------ hang watchdog

def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, default=str))
    os.replace(tmp, path)


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
        self.rank, self.world = _rank_world()
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
        self.rank, self.world = _rank_world()
        if _dist_on() and self.world > 1:
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
                     "torch_flight_recorder": _torch_flight_recorder()})
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


# ------------------------------------------------------------------------------ what fit uses

class Reliability:
    """The fault policy `core.loop.fit` applies: spike screening, skip accounting and rollback
    decisions, preemption and the watchdog. Its counters and the spike window are checkpointed."""

    def __init__(self, *, spike_zscore: float = 6.0, spike_window: int = 100, max_bad_steps: int = 5,
                 max_rollbacks: int = 3, preemption: Preemption | None = None, watchdog: Watchdog | None = None):
        self.spike = SpikeDetector(spike_zscore, spike_window) if spike_zscore > 0 else None
        self.max_bad_steps, self.max_rollbacks = max_bad_steps, max_rollbacks
        self.preemption, self.watchdog = preemption, watchdog
        self.bad_steps = 0  # skipped steps in a row
        self.rollbacks = 0  # in this process
        self.counts = {"skipped_nonfinite": 0, "skipped_spike": 0, "rollback": 0}
        self._spike_z: float | None = None

    @classmethod
    def from_config(cls, cfg: Any, watchdog_dir: str | os.PathLike | None = None,
                    preemption: bool = True) -> Reliability:
        """From a core.config.ReliabilityConfig; the watchdog needs a dir all ranks see."""
        wd = Watchdog(watchdog_dir, cfg.hang_timeout_s) if cfg.hang_timeout_s and watchdog_dir else None
        return cls(spike_zscore=cfg.spike_zscore, spike_window=cfg.spike_window, max_bad_steps=cfg.max_bad_steps,
                   max_rollbacks=cfg.max_rollbacks, preemption=Preemption(cfg.preempt_grace_s) if preemption else None,
                   watchdog=wd)

    # -- session -----------------------------------------------------------------------------

    def start(self) -> None:
        if self.preemption is not None:
            self.preemption.install()
        if self.watchdog is not None:
            self.watchdog.start()

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.preemption is not None:
            self.preemption.uninstall()

    def beat(self, step: int | None = None, phase: str | None = None) -> None:
        if step is not None:
            RECORDER.step = step
        if self.watchdog is not None:
            self.watchdog.beat(step, phase)

    def stop_requested(self, device: torch.device | None = None) -> bool:
        return self.preemption is not None and self.preemption.agreed(device)

    # -- bad steps -----------------------------------------------------------------------------

    def skip_if(self, metrics: dict[str, float]) -> bool:
        """Trainer.optim_step's screen, before the update: is this step's (global) loss a spike?"""
        self._spike_z = self.spike.is_spike(metrics["loss"]) if self.spike is not None else None
        return self._spike_z is not None

    def after_step(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """Account for an attempted step; returns the events to log (empty for a normal step)."""
        z, self._spike_z = self._spike_z, None
        if not metrics.get("skipped"):
            self.bad_steps = 0
            if self.spike is not None:
                self.spike.accept(metrics["loss"])
            return {}
        kind = "skipped_spike" if z is not None else "skipped_nonfinite"
        self.counts[kind] += 1
        self.bad_steps += 1
        events = {f"events/{kind}": float(self.counts[kind]), "events/bad_steps_in_a_row": float(self.bad_steps),
                  "events/skipped_loss": metrics["loss"], "events/skipped_grad_norm": metrics["grad_norm"]}
        if z is not None:
            events["events/spike_zscore"] = z
        log.warning("step %d skipped (%s): loss %.4g, grad norm %.4g%s; %d bad step(s) in a row", step,
                    kind.removeprefix("skipped_"), metrics["loss"], metrics["grad_norm"],
                    f", z-score {z:.1f}" if z is not None else "", self.bad_steps)
        return events

    def needs_rollback(self) -> bool:
        return self.max_bad_steps > 0 and self.bad_steps >= self.max_bad_steps

    def check_rollback_allowed(self, step: int, have_manager: bool) -> None:
        why = (f"{self.bad_steps} bad steps in a row at step {step} "
               f"({self.counts['skipped_nonfinite']} non-finite, {self.counts['skipped_spike']} spikes so far)")
        if not have_manager:
            raise TrainingDiverged(f"{why} and no checkpoint manager to roll back with")
        if self.rollbacks >= self.max_rollbacks:
            raise TrainingDiverged(f"{why} after {self.rollbacks} rollback(s) (max_rollbacks={self.max_rollbacks}); "
                                   "lower the lr, check the data, or raise spike_zscore")

    def rolled_back(self, state: dict[str, Any] | None, from_step: int, to_step: int) -> dict[str, float]:
        """After the checkpoint is loaded: take its spike window, count the rollback."""
        skipped = self.bad_steps
        self.load_state_dict(state, counters=False)
        self.bad_steps = 0
        self.rollbacks += 1
        self.counts["rollback"] += 1
        log.warning("rolled back from step %d to the checkpoint of step %d after %d bad steps; the data "
                    "position stays past the bad batches", from_step, to_step, skipped)
        return {"events/rollback": float(self.counts["rollback"]), "events/rollback_to_step": float(to_step),
                "events/rollback_from_step": float(from_step)}

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"spike": self.spike.state_dict() if self.spike is not None else None,
                "bad_steps": self.bad_steps, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any] | None, counters: bool = True) -> None:
        if not state:
            return
        if self.spike is not None and state.get("spike"):
            self.spike.load_state_dict(state["spike"])
        if counters:
            self.bad_steps = int(state.get("bad_steps", 0))
            self.counts.update({k: int(v) for k, v in state.get("counts", {}).items() if k in self.counts})
