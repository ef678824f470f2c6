"""CheckpointManager: when to save, what to keep, and loading the newest checkpoint that verifies."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

from posttrain.core.checkpoint.layout import (
    COMMON, ERRORS, MANIFEST, CheckpointError, LoadReport, SafeReader, final_steps, read_latest, read_metadata,
    step_dir_name, why,
)
from posttrain.core.checkpoint.state import (
    Stateful, config_hash, decode, model_state_dict, optim_options, set_rng_state, split_tensors,
)
from posttrain.core.checkpoint.writer import CheckpointWriter, collect
from posttrain.core.distenv import all_gather_object, dist_on, rank_world
from posttrain.core.manifest import file_sha256

logger = logging.getLogger("posttrain.core.checkpoint")


class CheckpointManager:
    """Saves every `interval_steps` (maybe_save) or on demand (save), keeps the last `keep_last`.

    In a multi-process job every rank constructs it (it creates a gloo group for checkpoint
    collectives, so an async save in a background thread never interleaves with the training
    collectives on the default group) and every rank calls save/load with its shard.
    """

    def __init__(self, dir: str | os.PathLike, keep_last: int = 3, async_save: bool = False,
                 on_save_error: Literal["fail", "continue"] = "fail", interval_steps: int = 0,
                 trainable_only: bool = False, config: Any = None):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if on_save_error not in ("fail", "continue"):
            raise ValueError(f"on_save_error must be 'fail' or 'continue', got {on_save_error!r}")
        self.dir = Path(dir)
        self.keep_last, self.interval_steps = keep_last, interval_steps
        self.on_save_error, self.trainable_only = on_save_error, trainable_only
        self.config_hash = config_hash(config)
        self.save_failures = 0
        self.last_report: LoadReport | None = None
        self._pg = dist.new_group(backend="gloo") if dist_on() else None
        self._writer = CheckpointWriter(
            self.dir, self._pg, keep_last=keep_last, async_save=async_save,
            manifest={"config_hash": self.config_hash, "trainable_only": trainable_only})
        if rank_world()[0] == 0:
            self.dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_config(cls, dir: str | os.PathLike, cfg: Any, **kwargs: Any) -> CheckpointManager:
        """From a posttrain.core.config.CheckpointConfig."""
        return cls(dir, keep_last=cfg.keep_last, async_save=cfg.async_save,
                   on_save_error=cfg.on_save_error, interval_steps=cfg.interval_steps, **kwargs)

    # -------------------------------------------------------------------------- save

    def maybe_save(self, step: int, model: torch.nn.Module, optimizer=None, scheduler=None,
                   extra: Mapping[str, Any] | None = None) -> bool:
        """Save when `step` is a multiple of interval_steps (0 = never here; save at the end)."""
        if self.interval_steps and step % self.interval_steps == 0:
            return self.save(step, model, optimizer, scheduler, extra)
        return False

    def save(self, step: int, model: torch.nn.Module, optimizer=None, scheduler=None,
             extra: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        """Checkpoint `step`. True when written (async: handed to the writer); False when `step`
        was already saved (unless `force`) or the save failed under on_save_error="continue".

        `extra` is the trainer dict: JSON-able values and small tensors, and Stateful objects
        (saved via state_dict(), per rank). A value of another type raises CheckpointError.
        """
        self.wait()
        if step == self._writer.last_saved and not force:
            return False
        payload = collect(step, model, optimizer, scheduler, extra, self.trainable_only, self._pg)
        try:
            self._writer.submit(payload)
        except ERRORS as e:
            return self._failed(step, e)
        return True

    def wait(self) -> bool:
        """Block until an async save is committed; False if it failed under "continue"."""
        step = self._writer.pending_step
        if step is None:
            return True
        try:
            self._writer.wait()
        except ERRORS as e:
            return self._failed(step, e)
        return True

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._writer.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _failed(self, step: int, e: BaseException) -> bool:
        self.save_failures += 1
        reason = f"saving checkpoint step {step} in {self.dir} failed: {why(e)}"
        if self.on_save_error == "fail":
            raise CheckpointError(f"{reason} (the previous checkpoint is intact)") from e
        logger.warning("%s; training continues, latest is still step %s", reason, self.latest_step())
        return False

    # -------------------------------------------------------------------------- inventory

    def list_complete(self) -> list[int]:
        """Committed checkpoints (final name + manifest), oldest first; load() verifies the hashes."""
        return [s for s in final_steps(self.dir) if (self.dir / step_dir_name(s) / MANIFEST).is_file()]

    def latest_step(self) -> int | None:
        """The step `latest` names, or the newest committed one when `latest` is missing."""
        step = read_latest(self.dir)
        if step is not None:
            return step
        complete = self.list_complete()
        return complete[-1] if complete else None

    # -------------------------------------------------------------------------- load

    def load_latest(self, model: torch.nn.Module, optimizer=None, scheduler=None,
                    extra: Mapping[str, Any] | None = None, required: bool = False) -> dict | None:
        """Load the checkpoint `latest` names, or the newest older one that verifies.

        Returns the trainer dict saved with it plus "step" and "load_report" (a LoadReport, also
        at self.last_report), loading Stateful values of `extra` in place; None when there is
        nothing usable, or CheckpointError if `required`.
        """
        steps = sorted(final_steps(self.dir), reverse=True)
        pointer = read_latest(self.dir)
        candidates = steps if pointer is None else [pointer] + [s for s in steps if s < pointer]
        return self._load_first_good(candidates, model, optimizer, scheduler, extra, required)

    def load(self, step: int, model: torch.nn.Module, optimizer=None, scheduler=None,
             extra: Mapping[str, Any] | None = None, required: bool = True,
             fallback: bool = True) -> dict | None:
        """Load `step`; if it does not verify and `fallback`, the newest older one that does."""
        older = [s for s in sorted(final_steps(self.dir), reverse=True) if s < step] if fallback else []
        return self._load_first_good([step] + older, model, optimizer, scheduler, extra, required)

    def _load_first_good(self, candidates, model, optimizer, scheduler, extra, required) -> dict | None:
        self.wait()
        report = self.last_report = LoadReport()
        for step in candidates:
            problem = self.verify(step)
            if problem:
                logger.warning("checkpoint %s is unusable: %s; trying the previous one",
                               self.dir / step_dir_name(step), problem)
                report.skipped.append((step, problem))
                continue
            state = self._load_step(step, model, optimizer, scheduler, extra)
            report.step, report.path = step, str(self.dir / step_dir_name(step))
            return {**state, "step": step, "load_report": report}
        skipped = "; ".join(f"step {s}: {reason}" for s, reason in report.skipped) or "none saved"
        if required:
            raise CheckpointError(f"no usable checkpoint in {self.dir} ({skipped})")
        if report.skipped:
            logger.warning("no usable checkpoint in %s (%s); starting fresh", self.dir, skipped)
        return None

    def verify(self, step: int) -> str | None:
        """None if checkpoint `step` is complete and intact, else what is wrong. Every rank hashes
        a share of the files; the verdict is the same on all ranks."""
        path = self.dir / step_dir_name(step)
        rank, world = rank_world()
        problems: list[str] = []
        try:
            files = json.loads((path / MANIFEST).read_text())["files"]
            missing = [n for n in (".metadata", COMMON, "rank-00000.json") if n not in files]
            if missing:
                problems.append(f"manifest lists no {', '.join(missing)}")
            for name in sorted(files)[rank::world]:
                f = path / name
                if not f.is_file():
                    problems.append(f"{name} missing")
                elif f.stat().st_size != files[name]["size"]:
                    problems.append(f"{name} is {f.stat().st_size} bytes, manifest says {files[name]['size']}")
                elif file_sha256(f) != files[name]["sha256"]:
                    problems.append(f"{name} sha256 mismatch")
            if rank == 0 and not problems:
                md = read_metadata(path)
                unsafe = [k for k, v in md.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
                if unsafe:
                    problems.append(f".metadata declares non-tensor entries {unsafe[:3]}")
                unlisted = {s.relative_path for s in md.storage_data.values()} - set(files)
                if unlisted:
                    problems.append(f"shards not in the manifest: {sorted(unlisted)[:3]}")
        except FileNotFoundError as e:
            problems.append(f"{Path(e.filename).name if e.filename else e} missing")
        except (OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError, EOFError) as e:
            problems.append(f"unreadable: {type(e).__name__}: {e}")
        all_problems = [p for ps in all_gather_object(problems, self._pg) for p in ps]
        return "; ".join(all_problems) or None

    def _load_step(self, step, model, optimizer, scheduler, extra) -> dict[str, Any]:
        path = self.dir / step_dir_name(step)
        rank, world = rank_world()
        manifest = json.loads((path / MANIFEST).read_text())
        common = decode(json.loads((path / COMMON).read_text()))
        own = path / f"rank-{rank:05d}.json"
        if manifest["world_size"] != world:
            logger.warning("%s was saved by %d ranks, loading on %d: model and optimizer reshard; RNG "
                           "and trainer state come from rank %s", path, manifest["world_size"], world,
                           rank if own.is_file() else 0)
        if manifest.get("config_hash") != self.config_hash and self.config_hash is not None:
            logger.warning("%s was saved under another config (hash %s, now %s)", path,
                           manifest.get("config_hash"), self.config_hash)
        per_rank = decode(json.loads((own if own.is_file() else path / "rank-00000.json").read_text()))
        if optimizer is not None and "optim_values" not in common:
            raise CheckpointError(f"{path} holds no optimizer state")
        if scheduler is not None and "scheduler" not in common:
            raise CheckpointError(f"{path} holds no scheduler state")

        # DCP loads in place into the tensors of these state dicts (DTensor: into local shards).
        trainable_only = manifest["trainable_only"]
        msd = model_state_dict(model, trainable_only)
        target, _ = split_tensors(msd, "model.")
        osd: dict[str, Any] = {}
        if optimizer is not None:
            osd = get_optimizer_state_dict(model, optimizer, options=optim_options(trainable_only))
            target.update(split_tensors(osd, "optim.")[0])
        saved = read_metadata(path).state_dict_metadata
        missing = sorted(set(target) - set(saved))
        if optimizer is not None:  # e.g. an `initial_lr` a scheduler adds to the param groups
            values = {k for k, v in osd.items() if not isinstance(v, torch.Tensor)}
            missing += sorted(values - set(common["optim_values"]))
        wrong = [f"{k}: {tuple(saved[k].size)} saved, {tuple(t.shape)} here" for k, t in target.items()
                 if k in saved and tuple(saved[k].size) != tuple(t.shape)]
        if missing or wrong:
            raise CheckpointError(f"{path} does not fit this model/optimizer (saved with another "
                                  f"optimizer or scheduler?): missing {missing[:5]}, "
                                  f"shape mismatch {wrong[:5]}")
        try:
            dcp.load(target, storage_reader=SafeReader(path), process_group=self._pg, no_dist=not dist_on())
        except CheckpointException as e:
            raise CheckpointError(f"loading {path} failed: {why(e)}") from e

        # The JSON values are every rank's (posttrain.core.checkpoint.writer.collect): this rank takes its own keys.
        msd = {k: target.get("model." + k, common["model_values"].get(k, v)) for k, v in msd.items()}
        set_model_state_dict(model, msd, options=StateDictOptions(strict=not trainable_only))
        if optimizer is not None:
            flat = {k: target["optim." + k] if isinstance(v, torch.Tensor) else common["optim_values"][k]
                    for k, v in osd.items()}
            set_optimizer_state_dict(model, optimizer, flat, options=optim_options(trainable_only))
        if scheduler is not None:
            scheduler.load_state_dict(common["scheduler"])
        set_rng_state(per_rank["rng"])
        trainer = per_rank["trainer"]
        for k, obj in (extra or {}).items():
            if isinstance(obj, Stateful) and k in trainer:
                obj.load_state_dict(trainer[k])
        self._writer.last_saved = step
        return trainer
