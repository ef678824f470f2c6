"""Disaggregated generation: generator worker processes beside the trainer, fed versioned weights
over torch.distributed, surviving a worker's death.

Roles. The trainer's lead rank owns a `GeneratorPool`: it spawns `workers` generator processes on
its host, each building its own model (`WorkerSpec.build`, the trainer's architecture, adapters
and dtype; a picklable callable) on its own device and running the paged-KV engine
(posttrain.core.generation.engine.engine_generate) on request. Every trainer rank holds a `Disaggregated`,
whose `sync` is collective over the trainer's ranks (gathering a sharded policy bucket by bucket,
posttrain.core.generation.weights.WeightPublisher) and sends the weights from the lead to every worker.

Channels. The lead hosts a TCPStore. Commands (sync, generate, stop) and generation results are
small JSON documents under per-worker keys of it (never pickles: a store
port is reachable from the host, and nothing read from it may run code), so a worker waits for work for as long as training takes
without a collective timing out. Weights go over a two-member process group per worker (gloo; NCCL
when the trainer and the worker are both on CUDA), made from the store under a prefix of the
worker's incarnation, so one worker's death breaks no other's group and a restarted worker gets a
fresh one.

Faults. The lead waits for a result in short slices, checking the worker's process each time: a
worker that died (SIGKILL, a crash, an exception it reports) or that gives no result within
`timeout_s` (hung) is killed, restarted (a new incarnation), sent the last published weights (the
lead keeps them packed: no trainer rank gathers again) and given its outstanding requests again,
up to `max_restarts` times per worker; then `GeneratorError` names the worker and what happened.
Sample i of a prompt draws from its own generator seeded seed + i (the engine), so a request
answered after a restart, or by another worker, gives the tokens it would have: a round completes
with the same samples whatever fails and however the requests are spread. A worker whose trainer
is gone (its parent process changed) exits.

Versions. Each sync carries a version (the trainer's choice, e.g. rounds trained); each result is
tagged with the version of the weights that made it (posttrain.core.generation.weights.Staleness decides what
an old one is worth).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from posttrain.core.generation.weights import SyncStats, WeightPublisher, WeightSubscriber

# a raw two-member group (not registered in the world) passed where torch.distributed wants a
# ProcessGroup: it works (group ranks, group_src=) but warns once per call
warnings.filterwarnings("ignore", message="You are using a Backend")

POLL_S = 0.05
START_S = 120.0  # the least a worker is given to build its model (timeout_s is for answers)


class GeneratorError(RuntimeError):
    """A generator worker failed beyond its restarts, or could not start."""


@dataclass
class WorkerSpec:
    """How a generator worker builds its model and runs the engine. `build`: a picklable callable
    (a module-level function or a functools.partial of one) returning the model on CPU or
    `device`; `threads`: torch's intra-op threads in the worker (0: torch's default)."""

    build: Callable[[], nn.Module]
    device: str = "cpu"
    threads: int = 0
    block_size: int = 16
    max_batch_tokens: int = 2048


@dataclass
class Request:
    """One engine call: `n` samples of each of `prompts` under `params` (SamplingParams fields)."""

    prompts: list[list[int]]
    params: dict[str, Any]
    n: int = 1


@dataclass
class Result:
    generations: list  # posttrain.core.model.generate.Generation, prompt-major
    version: int  # of the weights that made them
    worker: int


def _encode_cmd(cmd: tuple) -> bytes:
    if cmd[0] == "generate":
        _, rid, req = cmd
        return json.dumps(["generate", rid, {"prompts": req.prompts, "params": req.params, "n": req.n}]).encode()
    return json.dumps(list(cmd)).encode()


def _decode_cmd(raw: bytes) -> tuple:
    cmd = json.loads(raw)
    if cmd[0] == "generate":
        return "generate", cmd[1], Request(**cmd[2])
    return tuple(cmd)


def _encode_result(version: int | None, gens: list) -> bytes:
    return json.dumps([version, [[g.tokens, g.finish_reason, g.logprobs] for g in gens]]).encode()


def _decode_result(raw: bytes) -> tuple[int | None, list]:
    from posttrain.core.model.generate import Generation

    version, gens = json.loads(raw)
    return version, [Generation(t, f, lp) for t, f, lp in gens]


def _group(store: dist.Store, prefix: str, rank: int, timeout_s: float, nccl: bool) -> dist.ProcessGroup:
    store = dist.PrefixStore(prefix, store)
    if nccl:
        return dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))


def _worker_main(spec: WorkerSpec, port: int, prefix: str, parent: int, timeout_s: float, nccl: bool) -> None:
    """A generator worker's life: build, join the weight group, then serve commands until 'stop'
    (or until its trainer is gone). An exception is reported under the prefix's 'error' key."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        from posttrain.core.generation.engine import engine_generate
        from posttrain.core.model.generate import SamplingParams

        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = spec.build().to(device).eval()
        store.set(prefix + "ready", b"1")
        group = _group(store, prefix + "pg/", 1, timeout_s, nccl)
        sub = WeightSubscriber(model, group, group_src=0)
        seq = 0
        while True:
            key = f"{prefix}cmd/{seq}"
            while not store.check([key]):
                if os.getppid() != parent:
                    return
                time.sleep(POLL_S / 5)
            cmd = _decode_cmd(store.get(key))
            seq += 1
            if cmd[0] == "stop":
                return
            if cmd[0] == "sync":
                sub.receive()
            else:  # ("generate", request id, Request)
                _, rid, req = cmd
                with torch.no_grad():
                    gens = engine_generate(model, req.prompts, SamplingParams(**req.params), n=req.n,
                                           block_size=spec.block_size, max_batch_tokens=spec.max_batch_tokens)
                store.set(f"{prefix}result/{rid}", _encode_result(sub.version, gens))
    except BaseException as e:  # the lead raises it, naming the worker
        store.set(prefix + "error", f"{type(e).__name__}: {e}".encode())
        raise


@dataclass
class _Worker:
    index: int
    incarnation: int = 0
    restarts: int = 0
    proc: Any = None
    group: Any = None
    seq: int = 0
    pending: dict[int, Request] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        return f"w{self.index}/{self.incarnation}/"


class GeneratorPool:
    """The lead rank's generator workers (module doc). `publisher`: the lead's WeightPublisher
    (keep_last), which the pool attaches each worker's group to."""

    def __init__(self, spec: WorkerSpec, publisher: WeightPublisher, workers: int = 1, timeout_s: float = 300.0,
                 max_restarts: int = 2, trainer_device: str = "cpu"):
        if workers < 1:
            raise ValueError(f"workers={workers}: at least one generator worker")
        self.spec, self.publisher, self.timeout_s, self.max_restarts = spec, publisher, timeout_s, max_restarts
        self.nccl = spec.device.startswith("cuda") and trainer_device.startswith("cuda")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.ctx = mp.get_context("spawn")
        self.workers = [_Worker(i) for i in range(workers)]
        self.next_id = 0
        self.events: list[str] = []  # restarts and their reasons, for the stage's log and metrics
        self.synced = False  # whether a version was published (what a restarted worker is sent)
        for w in self.workers:
            self._launch(w)

    # -- processes ----------------------------------------------------------------------------

    def _launch(self, w: _Worker) -> None:
        w.proc = self.ctx.Process(target=_worker_main, daemon=True, name=f"posttrain-generator-{w.index}",
                                  args=(self.spec, self.store.port, w.prefix, os.getpid(), self.timeout_s, self.nccl))
        w.proc.start()
        w.seq = 0
        self._wait_key(w, w.prefix + "ready", "to build its model", max(self.timeout_s, START_S))
        w.group = _group(self.store, w.prefix + "pg/", 0, self.timeout_s, self.nccl)
        self.publisher.attach(w.group, 0)
        if self.synced:  # a restarted worker: the last version first
            self._post(w, ("sync",))
            self.publisher.send_last(w.group)

    def _restart(self, w: _Worker, why: str) -> None:
        if w.restarts >= self.max_restarts:
            self.close()
            raise GeneratorError(f"generator worker {w.index} failed {w.restarts + 1} times (max_restarts="
                                 f"{self.max_restarts}); last: {why}")
        self.events.append(f"worker {w.index}: {why}; restarted")
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=10)
        self.publisher.detach(w.group)
        w.restarts += 1
        w.incarnation += 1
        self._launch(w)
        for rid, req in w.pending.items():  # what it had not answered, again
            self._post(w, ("generate", rid, req))

    def _failure(self, w: _Worker) -> str | None:
        if self.store.check([w.prefix + "error"]):
            return "raised " + self.store.get(w.prefix + "error").decode(errors="replace")
        if not w.proc.is_alive():
            return f"its process exited (exit code {w.proc.exitcode})"
        return None

    def _wait_key(self, w: _Worker, key: str, what: str, timeout_s: float | None = None) -> None:
        """Wait for `key`, checking the worker's process; raises GeneratorError when it died or
        `timeout_s` (default the pool's) passed (callers that can restart catch it)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            why = self._failure(w)
            if why is None and time.monotonic() > deadline:
                why = f"no answer within timeout_s={timeout_s:g} s"
            if why is not None:
                raise GeneratorError(f"generator worker {w.index} did not manage {what}: {why}")
            time.sleep(POLL_S)

    def _post(self, w: _Worker, cmd: tuple) -> None:
        self.store.set(f"{w.prefix}cmd/{w.seq}", _encode_cmd(cmd))
        w.seq += 1

    # -- work ---------------------------------------------------------------------------------

    def announce_sync(self) -> None:
        """Tell every worker weights come next (before WeightPublisher.publish)."""
        for w in self.workers:
            self._post(w, ("sync",))

    def after_sync(self) -> None:
        """Restart the workers whose group failed during the publish; they get the version from
        the packed copy."""
        self.synced = True
        failed = self.publisher.take_failed()
        for w in self.workers:
            if w.group in failed:
                self._restart(w, f"weight sync failed ({failed[w.group]})")

    def submit(self, requests: list[Request]) -> list[int]:
        """Spread `requests` over the workers (round-robin, by request); their ids, for `collect`."""
        ids = []
        for j, req in enumerate(requests):
            w = self.workers[j % len(self.workers)]
            rid, self.next_id = self.next_id, self.next_id + 1
            w.pending[rid] = req
            self._post(w, ("generate", rid, req))
            ids.append(rid)
        return ids

    def collect(self, ids: list[int]) -> list[Result]:
        """The results of `ids`, in order, restarting a failed worker and asking it again."""
        owner = {rid: w for w in self.workers for rid in w.pending}
        out = []
        for rid in ids:
            w = owner[rid]
            while True:
                try:
                    self._wait_key(w, f"{w.prefix}result/{rid}", f"request {rid}")
                    break
                except GeneratorError as e:
                    self._restart(w, str(e).split(": ", 1)[-1])
            key = f"{w.prefix}result/{rid}"
            version, gens = _decode_result(self.store.get(key))
            self.store.delete_key(key)
            del w.pending[rid]
            out.append(Result(gens, version, w.index))
        return out

    def kill(self, index: int) -> int:
        """SIGKILL worker `index` (fault drills and tests); its pid."""
        pid = self.workers[index].proc.pid
        self.workers[index].proc.kill()
        return pid

    def close(self, wait: bool = True) -> None:
        """Tell every worker to stop; with `wait`, join them (killing one that does not exit in
        10 s). Without, they exit on their own (a process's teardown takes a second or so)."""
        for w in self.workers:
            if w.proc is not None and w.proc.is_alive():
                self._post(w, ("stop",))
        if not wait:
            return
        for w in self.workers:
            if w.proc is not None:
                w.proc.join(timeout=10)
                if w.proc.is_alive():
                    w.proc.kill()
                    w.proc.join(timeout=10)


class Disaggregated:
    """Every trainer rank's side of disaggregated generation: `sync` (collective over the trainer's
    ranks) publishes the policy to the lead's workers; `submit` / `collect` on the lead only."""

    def __init__(self, model: nn.Module, spec: WorkerSpec, lead: bool, workers: int = 1, lora_only: bool = False,
                 timeout_s: float = 300.0, max_restarts: int = 2, bucket_mb: float | None = None,
                 trainer_device: str = "cpu"):
        self.publisher = WeightPublisher(model, None, lora_only=lora_only, bucket_mb=bucket_mb, keep_last=lead)
        self.pool = GeneratorPool(spec, self.publisher, workers, timeout_s, max_restarts, trainer_device) \
            if lead else None
        self.version: int | None = None

    def sync(self, version: int) -> SyncStats:
        if self.pool is not None:
            self.pool.announce_sync()
        stats = self.publisher.publish(version)
        if self.pool is not None:
            self.pool.after_sync()
        self.version = version
        return stats

    def submit(self, requests: list[Request]) -> list[int]:
        return self.pool.submit(requests)

    def collect(self, ids: list[int]) -> list[Result]:
        return self.pool.collect(ids)

    def close(self, wait: bool = True) -> None:
        if self.pool is not None:
            self.pool.close(wait)
