"""Atomic, verified, resumable checkpoints on torch.distributed.checkpoint (torchtitan's manager, here).

Layout of `<dir>`:

    step-000120/     __<rank>_<i>.distcp shards + .metadata (DCP), common.json (rank 0: non-tensor
                     optimizer values, scheduler), rank-00000.json ... (per rank: trainer dict, RNG),
                     manifest.json (step, time, world size, config hash, every file's size + sha256)
    latest           "step-000120": the newest committed checkpoint
    .tmp-step-000140-<nonce>/   a save in progress; never read, removed when stale

A save writes everything into the tmp dir with fsync, then rank 0 (once every rank has reported
its files) writes the manifest, renames the dir to its final name and os.replace()s `latest`. A
crash or an exception at any point leaves no partial dir under a final name, `latest` untouched.

Loading verifies the manifest first (presence, sizes, hashes) and falls back to the previous
complete checkpoint when one is bad, reporting why. Only tensors go through DCP; every other value
is JSON (no pickle), and DCP's `.metadata` is unpickled against an allowlist of DCP's own classes,
so a checkpoint cannot run code on load. Model and optimizer go through `get_*_state_dict` /
`set_*_state_dict`, so FSDP2/DTensor models save per-rank shards and reshard on load to another
world size. The checkpoint dir must be visible to all ranks (a shared filesystem), as DCP needs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)

try:
    import numpy as np
except ImportError:  # numpy is optional; its RNG is then not part of the state
    np = None

logger = logging.getLogger(__name__)
# DCP warns on every save/load without a process group; single-process use is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

FORMAT = 1
MANIFEST, COMMON, LATEST = "manifest.json", "common.json", "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-step-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or no usable one could be loaded; the message says why."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with state_dict/load_state_dict (a data sampler, a loss-spike detector...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class LoadReport:
    """What load_latest/load did: the step used and every checkpoint skipped, with the reason."""

    step: int | None = None
    path: str | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# DCP raises CheckpointException, a BaseException, carrying one wrapped exception per failing rank.
_ERRORS = (Exception, CheckpointException)


def _why(e: BaseException) -> str:
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {_why(exc)}" for r, (exc, _) in e.failures.items())
    return f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------ JSON codec, no pickle
# Tensors and arrays become raw bytes in base64 (small ones only: RNG states, sampler positions);
# tuples and dicts with non-string keys are tagged so they come back as the same types.

def _encode(x: Any, where: str) -> Any:
    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
            raise CheckpointError(f"{where}: {type(x).__name__} is not a plain tensor; pass its full value")
        t = x.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": [str(t.dtype).removeprefix("torch."), list(t.shape), base64.b64encode(raw).decode()]}
    if np is not None and isinstance(x, np.ndarray):
        return {"__ndarray__": [x.dtype.str, list(x.shape), base64.b64encode(x.tobytes()).decode()]}
    if np is not None and isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: _encode(v, f"{where}.{k}") for k, v in x.items()}
        return {"__dict__": [[_encode(k, where), _encode(v, f"{where}.{k}")] for k, v in x.items()]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise CheckpointError(f"{where}: {type(x).__name__} is neither JSON-able nor a tensor; "
                          "checkpoints hold no pickled objects")


def _decode(x: Any) -> Any:
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tensor__" in x:
        dtype, shape, data = x["__tensor__"]
        raw = bytearray(base64.b64decode(data))
        dt = getattr(torch, dtype)
        if not raw:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(shape).clone()
    if "__ndarray__" in x:
        dtype, shape, data = x["__ndarray__"]
        return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(shape).copy()
    if "__tuple__" in x:
        return tuple(_decode(v) for v in x["__tuple__"])
    if "__dict__" in x:
        return {_decode(k): _decode(v) for k, v in x["__dict__"]}
    return {k: _decode(v) for k, v in x.items()}


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])


# ------------------------------------------------------------------------------ files

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    _write_durable(path, json.dumps(obj, sort_keys=True).encode())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_TORCH_CONSTANTS = (torch.dtype, torch.memory_format, torch.layout)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; accept only the classes a DCP metadata file is made of."""

    _OTHER = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PureWindowsPath"), ("pathlib", "Path"), ("builtins", "set"), ("builtins", "frozenset")}

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # a dataclass or an enum, never a function
                return obj
        elif module == "torch" and isinstance(obj := getattr(torch, name, None), _TORCH_CONSTANTS):
            return obj
        elif (module, name) in self._OTHER:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")


def read_metadata(path: Path) -> Metadata:
    with open(path / ".metadata", "rb") as f:
        md = _MetadataUnpickler(f).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f".metadata holds a {type(md).__name__}, not DCP Metadata")
    return md


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(Path(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


# ------------------------------------------------------------------------------ process group helpers

def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _all_gather(obj: Any, group) -> list[Any]:
    if not _dist_on():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any, group) -> Any:
    if not _dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _split(flat: Mapping[str, Any], prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (incl. DTensor shards) go to DCP, everything else to JSON."""
    tensors, values = {}, {}
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            tensors[prefix + k] = v
        else:
            values[k] = v
    return tensors, values


def _model_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, Any]:
    sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))
    if trainable_only:  # DSD keeps tied aliases of frozen params (lm_head.weight = embed.weight)
        frozen = {n.replace("_orig_mod.", "") for n, p in model.named_parameters(remove_duplicate=False)
                  if not p.requires_grad}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    return sd


def config_hash(config: Any) -> str | None:
    if config is None:
        return None
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class _Payload:
    step: int
    tensors: dict[str, torch.Tensor]
    common: dict[str, Any]  # JSON-encoded; written by rank 0
    per_rank: dict[str, Any]  # JSON-encoded; written by every rank


# ------------------------------------------------------------------------------ the manager

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
        self._last_saved: int | None = None
        self._pending: tuple[int, Future] | None = None
        self._pg = dist.new_group(backend="gloo") if _dist_on() else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if async_save else None
        # Staging copies the state to CPU (pinned on GPU hosts) so training may go on mutating it.
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
            use_async_staging=False, use_non_blocking_copy=False)) if async_save else None
        self._stale_removed = False
        if _rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_config(cls, dir: str | os.PathLike, cfg: Any, **kwargs: Any) -> CheckpointManager:
        """From a core.config.CheckpointConfig."""
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
        if step == self._last_saved and not force:
            return False
        payload = self._collect(step, model, optimizer, scheduler, extra)
        try:
            if self._executor is not None:
                payload.tensors = self._stager.stage(payload.tensors)
                self._pending = (step, self._executor.submit(self._write_and_commit, payload))
            else:
                self._write_and_commit(payload)
        except _ERRORS as e:
            return self._failed(step, e)
        return True

    def wait(self) -> bool:
        """Block until an async save is committed; False if it failed under "continue"."""
        if self._pending is None:
            return True
        step, future = self._pending
        self._pending = None
        try:
            future.result()
        except _ERRORS as e:
            return self._failed(step, e)
        return True

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._stager.close()
                self._executor = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _failed(self, step: int, e: BaseException) -> bool:
        self.save_failures += 1
        reason = f"saving checkpoint step {step} in {self.dir} failed: {_why(e)}"
        if self.on_save_error == "fail":
            raise CheckpointError(f"{reason} (the previous checkpoint is intact)") from e
        logger.warning("%s; training continues, latest is still step %s", reason, self.latest_step())
        return False

    def _collect(self, step, model, optimizer, scheduler, extra) -> _Payload:
        """Snapshot everything on the calling thread: state dicts, RNG, and the JSON parts."""
        tensors, model_values = _split(_model_state_dict(model, self.trainable_only), "model.")
        common: dict[str, Any] = {"step": step, "model_values": _encode(model_values, "model")}
        if optimizer is not None:
            opts = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=self.trainable_only)
            optim_tensors, optim_values = _split(get_optimizer_state_dict(model, optimizer, options=opts), "optim.")
            tensors.update(optim_tensors)
            common["optim_values"] = _encode(optim_values, "optimizer")
        if scheduler is not None:
            common["scheduler"] = _encode(scheduler.state_dict(), "scheduler")
        trainer = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in (extra or {}).items()}
        per_rank = {"step": step, "trainer": _encode(trainer, "extra"), "rng": _encode(_rng_state(), "rng")}
        return _Payload(step, tensors, common, per_rank)

    def _write_and_commit(self, p: _Payload) -> None:
        """Every rank writes its files into one tmp dir and hashes a share of them; rank 0 commits.
        Runs on the caller's thread (sync) or the writer thread (async); collectives use self._pg."""
        rank, world = _rank(), _world()
        nonce = _broadcast(uuid.uuid4().hex[:8], self._pg)
        tmp = self.dir / f"{_TMP_PREFIX}{p.step:06d}-{nonce}"
        files: dict[str, dict[str, Any]] = {}
        local_error: BaseException | None = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            md = dcp.save(p.tensors, storage_writer=FileSystemWriter(tmp, sync_files=True),
                          process_group=self._pg, no_dist=not _dist_on())
            own = [f"rank-{rank:05d}.json"]
            _write_json(tmp / own[0], p.per_rank)
            if rank == 0:
                _write_json(tmp / COMMON, p.common)
                own += [COMMON, ".metadata"]
            # Every rank sees the global metadata, so shard hashing is split evenly, in parallel.
            shards = sorted({s.relative_path for s in md.storage_data.values()})
            for name in own + shards[rank::world]:
                files[name] = {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
        except _ERRORS as e:
            local_error = e
        results = _all_gather((f"rank {rank}: {_why(local_error)}" if local_error else None, files), self._pg)
        outcome = None
        if rank == 0:
            outcome = "; ".join(err for err, _ in results if err) or None
            if outcome is None:
                try:
                    self._commit(p.step, tmp, {k: v for _, f in results for k, v in f.items()}, world)
                except Exception as e:
                    outcome = _why(e)
            if outcome is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        outcome = _broadcast(outcome, self._pg)  # every rank raises, or none does
        if local_error is not None:
            raise local_error
        if outcome:
            raise CheckpointError(outcome)
        self._last_saved = p.step

    def _commit(self, step: int, tmp: Path, files: dict[str, Any], world: int) -> None:
        manifest = {"format": FORMAT, "step": step, "time": time.time(), "world_size": world,
                    "config_hash": self.config_hash, "trainable_only": self.trainable_only,
                    "torch_version": torch.__version__, "files": dict(sorted(files.items()))}
        _write_json(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        final = self.dir / step_dir_name(step)
        old = None
        if final.exists():  # re-saving a step after a resume: set the old one aside, then swap
            old = self.dir / f"{_TMP_PREFIX}{step:06d}-replaced-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.dir)
        self._write_latest(final.name)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        try:
            self._prune(keep=final.name)
            if not self._stale_removed:  # at the first save, not at construction: a reader
                self._remove_stale()     # of a dir (eval, export) must not kill a writer's save
                self._stale_removed = True
        except OSError as e:  # the checkpoint is committed; a failed cleanup is only worth a warning
            logger.warning("cleaning up old checkpoints in %s failed: %s", self.dir, e)

    def _write_latest(self, name: str) -> None:
        tmp = self.dir / f".latest-{uuid.uuid4().hex[:8]}"
        _write_durable(tmp, f"{name}\n".encode())
        os.replace(tmp, self.dir / LATEST)
        _fsync_dir(self.dir)

    def _prune(self, keep: str) -> None:
        """Delete all but the keep_last most recently written checkpoints (by manifest time, so a
        stale higher step from an abandoned timeline goes first); never `keep`, the one just saved."""
        dated = []
        for step in self._final_steps():
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
                doomed = self.dir / f"{_TMP_PREFIX}{d.name[5:]}-deleting-{uuid.uuid4().hex[:8]}"
                os.rename(d, doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def _remove_stale(self) -> None:
        """Leftovers of saves interrupted by a crash (one writer per dir is assumed)."""
        for p in self.dir.iterdir():
            if p.name.startswith(_TMP_PREFIX) and p.is_dir():
                logger.info("removing an interrupted save: %s", p)
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(".latest-"):
                p.unlink(missing_ok=True)

    # -------------------------------------------------------------------------- inventory

    def _final_steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())

    def list_complete(self) -> list[int]:
        """Committed checkpoints (final name + manifest), oldest first; load() verifies the hashes."""
        return [s for s in self._final_steps() if (self.dir / step_dir_name(s) / MANIFEST).is_file()]

    def _read_latest(self) -> int | None:
        try:
            m = _STEP_DIR.match((self.dir / LATEST).read_text().strip())
        except OSError:
            return None
        return int(m.group(1)) if m else None

    def latest_step(self) -> int | None:
        """The step `latest` names, or the newest committed one when `latest` is missing."""
        step = self._read_latest()
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
        steps = sorted(self._final_steps(), reverse=True)
        pointer = self._read_latest()
        candidates = steps if pointer is None else [pointer] + [s for s in steps if s < pointer]
        return self._load_first_good(candidates, model, optimizer, scheduler, extra, required)

    def load(self, step: int, model: torch.nn.Module, optimizer=None, scheduler=None,
             extra: Mapping[str, Any] | None = None, required: bool = True,
             fallback: bool = True) -> dict | None:
        """Load `step`; if it does not verify and `fallback`, the newest older one that does."""
        older = [s for s in sorted(self._final_steps(), reverse=True) if s < step] if fallback else []
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
        skipped = "; ".join(f"step {s}: {why}" for s, why in report.skipped) or "none saved"
        if required:
            raise CheckpointError(f"no usable checkpoint in {self.dir} ({skipped})")
        if report.skipped:
            logger.warning("no usable checkpoint in %s (%s); starting fresh", self.dir, skipped)
        return None

    def verify(self, step: int) -> str | None:
        """None if checkpoint `step` is complete and intact, else what is wrong. Every rank hashes
        a share of the files; the verdict is the same on all ranks."""
        path = self.dir / step_dir_name(step)
        rank, world = _rank(), _world()
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
                elif _sha256(f) != files[name]["sha256"]:
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
        all_problems = [p for ps in _all_gather(problems, self._pg) for p in ps]
        return "; ".join(all_problems) or None

    def _load_step(self, step, model, optimizer, scheduler, extra) -> dict[str, Any]:
        path = self.dir / step_dir_name(step)
        manifest = json.loads((path / MANIFEST).read_text())
        common = _decode(json.loads((path / COMMON).read_text()))
        own = path / f"rank-{_rank():05d}.json"
        if manifest["world_size"] != _world():
            logger.warning("%s was saved by %d ranks, loading on %d: model and optimizer reshard; RNG "
                           "and trainer state come from rank %s", path, manifest["world_size"], _world(),
                           _rank() if own.is_file() else 0)
        if manifest.get("config_hash") != self.config_hash and self.config_hash is not None:
            logger.warning("%s was saved under another config (hash %s, now %s)", path,
                           manifest.get("config_hash"), self.config_hash)
        per_rank = _decode(json.loads((own if own.is_file() else path / "rank-00000.json").read_text()))
        if optimizer is not None and "optim_values" not in common:
            raise CheckpointError(f"{path} holds no optimizer state")
        if scheduler is not None and "scheduler" not in common:
            raise CheckpointError(f"{path} holds no scheduler state")

        # DCP loads in place into the tensors of these state dicts (DTensor: into local shards).
        trainable_only = manifest["trainable_only"]
        msd = _model_state_dict(model, trainable_only)
        target, _ = _split(msd, "model.")
        osd: dict[str, Any] = {}
        if optimizer is not None:
            opts = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=trainable_only)
            osd = get_optimizer_state_dict(model, optimizer, options=opts)
            target.update(_split(osd, "optim.")[0])
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
            dcp.load(target, storage_reader=_SafeReader(path), process_group=self._pg, no_dist=not _dist_on())
        except CheckpointException as e:
            raise CheckpointError(f"loading {path} failed: {_why(e)}") from e

        msd = {k: target.get("model." + k, v) for k, v in msd.items()} | common["model_values"]
        set_model_state_dict(model, msd, options=StateDictOptions(strict=not trainable_only))
        if optimizer is not None:
            flat = {k: target["optim." + k] for k, v in osd.items() if isinstance(v, torch.Tensor)}
            opts = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=trainable_only)
            set_optimizer_state_dict(model, optimizer, flat | common["optim_values"], options=opts)
        if scheduler is not None:
            scheduler.load_state_dict(common["scheduler"])
        _set_rng_state(per_rank["rng"])
        trainer = per_rank["trainer"]
        for k, obj in (extra or {}).items():
            if isinstance(obj, Stateful) and k in trainer:
                obj.load_state_dict(trainer[k])
        self._last_saved = step
        return trainer


def export_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded model state dict on CPU, gathered on rank 0 ({} on other ranks); every
    rank must call it. For HF export (registry/hf.py)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)
