"""A training stage's disaggregated sampling (generation.mode: disaggregated): generator worker
processes on the lead rank's host (posttrain.core.generation.remote), fed the policy's weights by version.

`Generators` is on every trainer rank. Per round: `sync(version)` (collective over the trainer's
ranks: a sharded policy is gathered bucket by bucket; skipped when that version was already sent),
`submit(round, requests)` on the lead (the workers start at once), `collect(round)` (the lead
waits, restarting a failed worker and asking again; every rank gets the results). With
generation.prefetch 1 the stage submits round k+1 right after collecting round k, so the workers
sample it while the trainer trains on round k, with weights one round older (their version tag
says so, and generation.max_staleness / stale say what such a sample is worth).

Versions are rounds trained: the weights after training round k - 1 are version k, and a round-k
sample made by version v lags k - v rounds (0 on-policy, 1 prefetched).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import torch.distributed as dist

from posttrain.core.generation.remote import Disaggregated, Request, WorkerSpec
from posttrain.core.generation.weights import Staleness
from posttrain.stages.common import StageError
from posttrain.stages.recipe import Session, generator_model

log = logging.getLogger("posttrain.generators")


class Generators:
    def __init__(self, s: Session):
        cfg, d = s.cfg, s.dist
        g = cfg.generation
        lora_only = g.sync == "lora" or (g.sync == "auto" and cfg.lora.enabled)
        if lora_only and not cfg.lora.enabled:
            raise StageError("generation.sync: 'lora' moves the adapters only, but lora.enabled is false")
        device = g.device
        if device == "cuda":  # the first GPU after the trainer's own on this host (every worker on it)
            device = f"cuda:{int(os.environ.get('LOCAL_WORLD_SIZE', 1))}"
        spec = WorkerSpec(functools.partial(generator_model, cfg.model_dump_json(), type(cfg).__name__),
                          device=device, threads=g.threads)
        t0 = time.perf_counter()
        try:
            self.remote = Disaggregated(s.model, spec, d.is_main, workers=g.workers, lora_only=lora_only,
                                        timeout_s=g.timeout_s, max_restarts=g.max_restarts,
                                        trainer_device=str(d.device))
        except Exception as e:
            raise StageError(f"generation: the generator workers did not start: {e}") from e
        self.d, self.prefetch = d, g.prefetch
        self.staleness = Staleness(g.max_staleness, g.stale, g.stale_decay)
        self.pending: tuple[int, list[int]] | None = None  # (round, request ids) submitted, not collected
        self.synced: int | None = None
        self.stats = {"generation/sync_s": 0.0, "generation/syncs": 0, "generation/restarts": 0,
                      "generation/start_s": time.perf_counter() - t0}
        if d.is_main:
            log.info("generation: %d disaggregated worker(s) on %s, %s sync, prefetch %d (%.1f s to start)",
                     g.workers, device, "LoRA-only" if lora_only else "full", g.prefetch,
                     self.stats["generation/start_s"])

    def sync(self, version: int) -> None:
        """Publish the policy as `version` unless it was the last one sent. Collective."""
        if self.synced == version:
            return
        stats = self.remote.sync(version)
        self.synced = version
        self.stats["generation/sync_s"] += stats.seconds
        self.stats["generation/syncs"] += 1

    def submit(self, rnd: int, requests: list[Request]) -> None:
        """Hand round `rnd`'s requests to the workers (the lead; the others keep nothing)."""
        self.pending = (rnd, self.remote.submit(requests) if self.d.is_main else [])

    def has(self, rnd: int) -> bool:
        return self.pending is not None and self.pending[0] == rnd

    def collect(self, rnd: int) -> list[tuple[list[Any], float]]:
        """Round `rnd`'s results, per request: (generations, weight), the same on every rank;
        weight = what a sample of that lag is worth (Staleness). Collective."""
        if not self.has(rnd):
            raise RuntimeError(f"round {rnd} was not submitted")
        out: list[Any] = [None]
        if self.d.is_main:
            try:
                results = self.remote.collect(self.pending[1])
                out[0] = ([(r.generations, r.version) for r in results], list(self.remote.pool.events), None)
            except Exception as e:  # every rank raises it, none waits in the broadcast
                out[0] = (None, [], f"{type(e).__name__}: {e}")
        if self.d.world > 1:
            dist.broadcast_object_list(out, src=0)
        results, events, error = out[0]
        self.pending = None
        if error is not None:
            raise StageError(f"generation: {error}")
        self.stats["generation/restarts"] = len(events)
        weighted = []
        for gens, version in results:
            weight = self.staleness.weight(version, rnd)
            if weight is None:  # excluded by GenerationConfig's check (prefetch <= max_staleness or reweight)
                raise StageError(f"generation: a round-{rnd} sample of weights version {version} is beyond "
                                 f"max_staleness {self.staleness.max_behind}")
            weighted.append((gens, weight))
        return weighted

    def close(self, wait: bool = True) -> None:
        self.remote.close(wait)
