"""The save side of checkpoints: snapshot the state on the training thread, then write it into a
tmp dir on every rank and commit it from rank 0 (manifest, rename, `latest`), either right away or
on one background thread (async_save) after staging the tensors to CPU."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from posttrain.core.atomic import fsync_dir, write_json_atomic, write_text_atomic
from posttrain.core.checkpoint.layout import (
    COMMON, ERRORS, FORMAT, LATEST, MANIFEST, TMP_PREFIX, CheckpointError, final_steps, step_dir_name, why,
)
from posttrain.core.checkpoint.state import Stateful, encode, model_state_dict, optim_options, rng_state, split_tensors
from posttrain.core.distenv import all_gather_object, broadcast_object, dist_on, rank_world
from posttrain.core.manifest import file_sha256

logger = logging.getLogger("posttrain.core.checkpoint")


@dataclass
class Payload:
    step: int
    tensors: dict[str, torch.Tensor]
    common: dict[str, Any]  # JSON-encoded; written by rank 0
    per_rank: dict[str, Any]  # JSON-encoded; written by every rank


def collect(step: int, model: torch.nn.Module, optimizer, scheduler, extra: Mapping[str, Any] | None,
            trainable_only: bool, group=None) -> Payload:
    """Snapshot everything on the calling thread: state dicts, RNG, and the JSON parts. The
    JSON values (param groups' settings, keyed by parameter name) are the union over the ranks:
    ranks holding different parameters (pipeline stages) each contribute theirs. Collective."""
    tensors, model_values = split_tensors(model_state_dict(model, trainable_only), "model.")
    common: dict[str, Any] = {"step": step, "model_values": encode(_union(model_values, group), "model")}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=optim_options(trainable_only))
        optim_tensors, optim_values = split_tensors(osd, "optim.")
        tensors.update(optim_tensors)
        common["optim_values"] = encode(_union(optim_values, group), "optimizer")
    if scheduler is not None:
        common["scheduler"] = encode(scheduler.state_dict(), "scheduler")
    trainer = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in (extra or {}).items()}
    per_rank = {"step": step, "trainer": encode(trainer, "extra"), "rng": encode(rng_state(), "rng")}
    return Payload(step, tensors, common, per_rank)


def _union(values: dict[str, Any], group) -> dict[str, Any]:
    """Every rank's `values` merged (rank 0's win where keys repeat: equal where ranks share a parameter)."""
    if not dist_on():
        return values
    merged: dict[str, Any] = {}
    for part in reversed(all_gather_object(values, group)):
        merged.update(part)
    return merged


def _write_json(path: Path, obj: Any) -> None:
    write_json_atomic(path, obj, indent=None)  # fsynced: the commit renames the dir right after


class CheckpointWriter:
    """Writes and commits the payloads of one checkpoint dir; every rank holds one. Collectives go
    through `pg` (the manager's gloo group), so a save on the background thread never interleaves
    with the training collectives on the default group."""

    def __init__(self, dir: Path, pg, *, keep_last: int, async_save: bool, manifest: dict[str, Any]):
        self.dir, self._pg, self.keep_last = dir, pg, keep_last
        self._manifest = manifest  # what every manifest records besides step, time and files
        self.last_saved: int | None = None  # the step last committed (or loaded) here
        self._pending: tuple[int, Future] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if async_save else None
        # Staging copies the state to CPU (pinned on GPU hosts) so training may go on mutating it.
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
            use_async_staging=False, use_non_blocking_copy=False)) if async_save else None
        self._stale_removed = False

    @property
    def pending_step(self) -> int | None:
        """The step of an async save not yet waited for."""
        return self._pending[0] if self._pending is not None else None

    def submit(self, p: Payload) -> None:
        """Write and commit `p` now, or (async_save) stage it and hand it to the writer thread."""
        if self._executor is None:
            self._write_and_commit(p)
            return
        p.tensors = self._stager.stage(p.tensors)
        self._pending = (p.step, self._executor.submit(self._write_and_commit, p))

    def wait(self) -> None:
        """Block until the pending async save is committed; raises what made it fail."""
        if self._pending is not None:
            _, future = self._pending
            self._pending = None
            future.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._stager.close()
            self._executor = None

    def _write_and_commit(self, p: Payload) -> None:
        """Every rank writes its files into one tmp dir and hashes a share of them; rank 0 commits."""
        rank, world = rank_world()
        nonce = broadcast_object(uuid.uuid4().hex[:8], self._pg)
        tmp = self.dir / f"{TMP_PREFIX}{p.step:06d}-{nonce}"
        files: dict[str, dict[str, Any]] = {}
        local_error: BaseException | None = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            md = dcp.save(p.tensors, storage_writer=FileSystemWriter(tmp, sync_files=True),
                          process_group=self._pg, no_dist=not dist_on())
            own = [f"rank-{rank:05d}.json"]
            _write_json(tmp / own[0], p.per_rank)
            if rank == 0:
                _write_json(tmp / COMMON, p.common)
                own += [COMMON, ".metadata"]
            # Every rank sees the global metadata, so shard hashing is split evenly, in parallel.
            shards = sorted({s.relative_path for s in md.storage_data.values()})
            for name in own + shards[rank::world]:
                files[name] = {"size": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
        except ERRORS as e:
            local_error = e
        results = all_gather_object((f"rank {rank}: {why(local_error)}" if local_error else None, files), self._pg)
        outcome = None
        if rank == 0:
            outcome = "; ".join(err for err, _ in results if err) or None
            if outcome is None:
                try:
                    self._commit(p.step, tmp, {k: v for _, f in results for k, v in f.items()}, world)
                except Exception as e:
                    outcome = why(e)
            if outcome is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        outcome = broadcast_object(outcome, self._pg)  # every rank raises, or none does
        if local_error is not None:
            raise local_error
        if outcome:
            raise CheckpointError(outcome)
        self.last_saved = p.step

    def _commit(self, step: int, tmp: Path, files: dict[str, Any], world: int) -> None:
        manifest = {"format": FORMAT, "step": step, "time": time.time(), "world_size": world, **self._manifest,
                    "torch_version": torch.__version__, "files": dict(sorted(files.items()))}
        _write_json(tmp / MANIFEST, manifest)
        fsync_dir(tmp)
        final = self.dir / step_dir_name(step)
        old = None
        if final.exists():  # re-saving a step after a resume: set the old one aside, then swap
            old = self.dir / f"{TMP_PREFIX}{step:06d}-replaced-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        write_text_atomic(self.dir / LATEST, f"{final.name}\n")
        fsync_dir(self.dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        try:
            self._prune(keep=final.name)
            if not self._stale_removed:  # at the first save, not at construction: a reader
                self._remove_stale()     # of a dir (eval, export) must not kill a writer's save
                self._stale_removed = True
        except OSError as e:  # the checkpoint is committed; a failed cleanup is only worth a warning
            logger.warning("cleaning up old checkpoints in %s failed: %s", self.dir, e)

    def _prune(self, keep: str) -> None:
        """Delete all but the keep_last most recently written checkpoints (by manifest time, so a
        stale higher step from an abandoned timeline goes first); never `keep`, the one just saved."""
        dated = []
        for step in final_steps(self.dir):
            d = self.dir / step_dir_name(step)
            try:
                written = json.loads((d / MANIFEST).read_text())["time"]
            except (OSError, ValueError, KeyError, TypeError):
                written = float("-inf")  # no readable manifest: unusable anyway
            dated.append((written, step, d))
        dated.sort()
        for _, _, d in dated[:-self.keep_last]:
            if d.name != keep:
                # Rename first: a crash mid-delete must not leave a partial dir under a final name.
                doomed = self.dir / f"{TMP_PREFIX}{d.name[5:]}-deleting-{uuid.uuid4().hex[:8]}"
                os.rename(d, doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def _remove_stale(self) -> None:
        """Leftovers of saves interrupted by a crash (one writer per dir is assumed)."""
        for p in self.dir.iterdir():
            if p.name.startswith(TMP_PREFIX) and p.is_dir():
                logger.info("removing an interrupted save: %s", p)
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith((".latest-", f".{LATEST}.")):  # a `latest` being replaced
                p.unlink(missing_ok=True)
