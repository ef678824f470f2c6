"""One engine replica: a `posttrain.core.generation.Engine` driven by one background thread.

The engine is not thread-safe, so only this thread touches it. Callers `submit` a request with a
`Sink` (three callbacks, run on the engine thread); the thread adds queued requests between
steps, steps while work exists and sleeps when there is none. After each step it reports the
tokens the step appended (`Engine.step_tokens`) and the requests it finished. An exception from
the engine fails every request in it (`Sink.error`) and the replica starts over on a fresh engine
(`make_engine`), so one bad step never takes the server down. `cancel(sink)` aborts a request
whose client went away (`Engine.abort`: its blocks are freed, it takes no more steps).

A replica is self-contained (an engine factory in, callbacks out): a later load balancer runs
several and picks one per request.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from posttrain.core.generation import Engine, RequestOutput, RequestParams

log = logging.getLogger(__name__)


@dataclass
class Sink:
    """Where one request's progress goes; every callback runs on the engine thread."""

    tokens: Callable[[list[tuple[int, int, float | None, dict[int, float] | None]]], None]
    """(sample index, token, log-prob, top log-probs) of the tokens one step appended."""
    done: Callable[[RequestOutput], None]
    error: Callable[[BaseException], None]


@dataclass
class _Cancel:
    sink: Sink


class EngineWorker:
    def __init__(self, make_engine: Callable[[], Engine], name: str = "engine"):
        self.make_engine = make_engine
        self.engine = make_engine()
        self.inbox: queue.Queue = queue.Queue()
        self.sinks: dict[int, Sink] = {}
        self.num_failures = 0
        self.num_cancelled = 0  # requests aborted in the engine by `cancel`
        self.fatal: BaseException | None = None
        """Set when the replica cannot go on (posttrain.stages.serving.tp: a rank of its group failed)."""
        self.on_fatal: Callable[[], None] | None = None
        """Called (on the engine thread) once `fatal` is set; the server stops on it."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ------------------------------------------------------------ any thread

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(None)  # wake an idle loop
        self._thread.join(timeout)

    def submit(self, prompt: list[int], params: RequestParams, sink: Sink) -> None:
        self.inbox.put((prompt, params, sink))

    def cancel(self, sink: Sink) -> None:
        """Abort the request submitted with `sink` (a no-op once it has finished); its callbacks
        are not called again. Requests are admitted in order, so a cancel never overtakes its submit."""
        self.inbox.put(_Cancel(sink))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        """Sizes read without a lock (each a single len() of the engine's containers)."""
        s = self.engine.scheduler
        return {"waiting": self.inbox.qsize() + len(s.waiting), "running": len(s.running)}

    # ------------------------------------------------------------ the engine thread

    def _admit(self, item) -> int | None:
        """Add a queued request to the engine; its id, or None when the engine refused it."""
        prompt, params, sink = item
        try:
            rid = self.engine.add_request(prompt, params)
        except Exception as e:  # noqa: BLE001 - a refused request fails alone
            sink.error(e)
            return None
        self.sinks[rid] = sink
        return rid

    def _cancel(self, sink: Sink) -> int | None:
        """Abort the request of `sink` in the engine; its id, or None when it had already finished."""
        rid = next((r for r, s in self.sinks.items() if s is sink), None)
        if rid is not None:
            del self.sinks[rid]
            self.engine.abort(rid)
            self.num_cancelled += 1
        return rid

    def _drain(self, wait: float | None) -> None:
        """Admit what is queued; wait: seconds to wait for the first item (0: none, None: forever)."""
        while not self._stop.is_set():
            try:
                item = self.inbox.get(block=wait != 0, timeout=wait or None)
            except queue.Empty:
                return
            wait = 0
            if isinstance(item, _Cancel):
                self._cancel(item.sink)
            elif item is not None:
                self._admit(item)

    def _step(self) -> None:
        """One engine step, its tokens and finished requests reported to their sinks."""
        finished = self.engine.step()
        progress: dict[int, list] = {}
        for rid, index, token, logp, tops in self.engine.step_tokens:
            progress.setdefault(rid, []).append((index, token, logp, tops))
        for rid, events in progress.items():
            if rid in self.sinks:
                self._call(self.sinks[rid].tokens, events)
        for out in finished:
            sink = self.sinks.pop(out.request_id, None)
            if sink is not None:
                self._call(sink.done, out)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(None if not self.engine.has_unfinished() else 0)
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - fail the engine's requests, keep serving
                log.exception("engine step failed; failing %d requests and starting a fresh engine", len(self.sinks))
                self.num_failures += 1
                sinks, self.sinks = self.sinks, {}
                self.engine = self.make_engine()
                for sink in sinks.values():
                    self._call(sink.error, e)

    @staticmethod
    def _call(fn, arg) -> None:
        try:
            fn(arg)
        except Exception:  # noqa: BLE001 - a broken callback must not stop the engine
            log.exception("serving callback failed")
