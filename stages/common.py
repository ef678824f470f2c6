"""What every stage does the same way: read its spec, join the process group, find its model,
tokenizer and data from upstream manifests, show progress, and write its outputs.

Stages compose these functions; there is no stage base class (torchtune's recipe shape)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, TypeVar

import torch
import torch.distributed as dist

from posttrain.core.config import from_json_file
from posttrain.core.lora.config import LoRAConfig
from posttrain.core.model.config import ModelConfig
from posttrain.core.parallel.config import ParallelConfig
from posttrain.stages.config import StageConfig
from posttrain.core.manifest import is_stage_dir, read_manifest
from posttrain.core.model import Transformer, build_model, get_preset
from posttrain.core.tracking import NullTracker, Tracker

C = TypeVar("C", bound=StageConfig)
log = logging.getLogger("posttrain")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StageError(RuntimeError):
    """A stage cannot run with its inputs; the message says which input and why."""


def parse_spec(cls: type[C], argv: list[str] | None = None) -> C:
    """The stage's spec from `--config`; first, under the torchrun wrapper, the rank is bound to
    die with its torchrun (posttrain.stages.launch.signals.die_with_agent), and exits if it is gone."""
    from posttrain.stages.launch.signals import die_with_agent

    if not die_with_agent():
        sys.exit(128 + 15)  # torchrun died while this rank started: nobody waits for it
    parser = argparse.ArgumentParser(description=f"posttrain stage ({cls.__name__})")
    parser.add_argument("--config", required=True, help="stage spec JSON (posttrain.core.config.to_json_file)")
    return from_json_file(cls, parser.parse_args(argv).config)


@dataclass
class Dist:
    """Where this process stands: its rank, the world, its device, and once a training stage has
    parallelized its policy, the mesh (None on one process, and in stages without one)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    mesh: Any = None  # posttrain.core.parallel.ParallelMesh
    pipeline: Any = None  # posttrain.core.parallel.pipeline.Pipeline: the policy's schedule, under pipeline parallelism
    lockstep: Any = None  # evaluation of sharded models: the group whose ranks run every forward together

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this rank's shard, shards) of the data: tp ranks of a mesh read the same batches."""
        if self.mesh is not None:
            return self.mesh.local_rank("dp"), self.mesh.size("dp")
        return self.rank, self.world

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            t = t.to(self.device) if self.device.type == "cuda" else t
            dist.all_reduce(t)
        return t.cpu().tolist()


def start_distributed(parallel: ParallelConfig | None = None, timeout_s: float | None = None) -> Dist:
    """Join torchrun's process group with `parallel`'s backend and device (posttrain.core.parallel.mesh,
    the one place a group is made); a plain single process needs none. `timeout_s`: the
    collective timeout (ReliabilityConfig)."""
    from posttrain.core.parallel.mesh import init_process_group

    try:
        env, device = init_process_group(parallel or ParallelConfig(), timeout_s)
    except ValueError as e:
        raise StageError(f"parallel: {e}") from None
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING,
                        format=f"[rank{env.rank}] %(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    return Dist(env.rank, env.world_size, env.local_rank, device)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Models and tokenizers from presets, HF directories or upstream stage outputs


def local_model_path(name_or_path: str) -> str:
    """A model reference as a local path where it names a file to import: a packaged model's name
    (registry/packaged.py) and a `.gguf` file both become the HF directory the file is imported
    into (once, registry/gguf.py); anything else is returned as it is."""
    from posttrain.registry.packaged import PackageMissing, is_packaged, packaged_file

    ref = str(name_or_path)
    if not is_packaged(ref) and not (ref.lower().endswith(".gguf") and Path(ref).is_file()):
        return ref
    from posttrain.registry.gguf import GGUFError, gguf_model_dir

    try:
        return str(gguf_model_dir(packaged_file(ref) if is_packaged(ref) else ref))
    except (PackageMissing, GGUFError) as e:
        raise StageError(f"model {ref!r}: {e}") from None


def resolve_model_dir(name_or_path: str) -> tuple[Path | None, dict | None]:
    """(HF model directory, upstream manifest) for a path; (None, None) for a preset name. A
    packaged model's name or a `.gguf` file resolves to the directory it is imported into."""
    p = Path(local_model_path(name_or_path))
    if is_stage_dir(p):
        manifest = read_manifest(p)
        model_rel = manifest["outputs"].get("model")
        adapters = sorted(k.split("/", 1)[1] for k in manifest["outputs"] if k.startswith("model/"))
        if model_rel is None and adapters:  # several adapters, each merged on its own (stages/adapters.py)
            raise StageError(f"{p}: stage {manifest['stage']!r} trained several adapters ({', '.join(adapters)}); "
                             f"name one: {p / manifest['outputs']['model/' + adapters[0]]} (in a pipeline "
                             f"'<node>:{adapters[0]}')")
        if model_rel is None:
            raise StageError(f"{p}: stage {manifest['stage']!r} produced no model output")
        return p / model_rel, manifest
    if p.exists():
        return p, None
    if os.sep in name_or_path or name_or_path.startswith("."):
        raise StageError(f"model {name_or_path!r}: no such directory (and not a preset name)")
    return None, None


def load_model(cfg: ModelConfig, device: torch.device, seed: int = 0,
               meta: bool = False) -> tuple[Transformer, dict | None]:
    """The model a stage starts from (on `device`, in cfg.dtype), and its upstream manifest.
    meta=True: the same model on the meta device, without values; parallelize it (LoRA first, if
    any), then `materialize_model` gives each rank its shards of the same values."""
    from posttrain.registry.hf import load_pretrained, model_on_meta

    model_dir, manifest = resolve_model_dir(cfg.name_or_path)
    dtype = DTYPES[cfg.dtype]
    if model_dir is None:
        try:
            args = get_preset(cfg.name_or_path, **cfg.overrides)
        except KeyError as e:
            raise StageError(str(e.args[0])) from None
        if meta:
            with torch.device("meta"):
                return Transformer(args).to(dtype), None
        return build_model(args, device=device, dtype=dtype, seed=seed), None
    if cfg.overrides:
        raise StageError(f"model.overrides apply to presets only, not to the checkpoint {model_dir}")
    if meta:
        return model_on_meta(model_dir).to(dtype), manifest
    return load_pretrained(model_dir, dtype=dtype, device=device), manifest


def load_on_meta(lora: LoRAConfig) -> bool:
    """Whether a policy with these adapters can be built on the meta device and get its weights
    after parallelizing: not when the adapters' initial values read the base weights (QLoRA
    quantizes them, DoRA takes their norms, PiSSA their SVD); those load whole (QLoRA from a
    checkpoint: quantized as read, `load_quantized`)."""
    return not lora.enabled or not (lora.quantize_base or lora.use_dora or lora.init_lora_weights == "pissa")


def streams_quantized(model_cfg: ModelConfig, lora: LoRAConfig) -> bool:
    """QLoRA on a checkpoint (not a preset, whose random init draws every weight in one order):
    loaded by `load_quantized`, the dense base never whole in memory."""
    return bool(lora.enabled and lora.quantize_base and lora.init_lora_weights != "pissa"
                and resolve_model_dir(model_cfg.name_or_path)[0] is not None and not model_cfg.overrides)


def load_quantized(model_cfg: ModelConfig, lora: LoRAConfig, device: torch.device) -> tuple[Transformer, dict | None]:
    """The QLoRA policy from a checkpoint, the same values as load_model + apply_lora give, with
    the dense base never whole in memory: built on the meta device, each targeted linear layer's
    weight read (memory-mapped) just before it is quantized to NF4 and dropped, then the rest
    (embedding, norms, head, biases, routers) allocated and read. The peak is the NF4 base plus
    the dense rest plus one dense weight, not the dense model (docs/scaling.md)."""
    from posttrain.core.lora import apply_lora
    from posttrain.registry.hf import model_on_meta
    from posttrain.registry.hf_sharded import load_sharded, open_checkpoint, read_whole

    model_dir, manifest = resolve_model_dir(model_cfg.name_or_path)
    dtype = DTYPES[model_cfg.dtype]
    model = model_on_meta(model_dir).to(dtype)
    family = model.args.family
    quantized: list[str] = []
    with open_checkpoint(model_dir) as files:
        def fill(name: str, linear: torch.nn.Linear) -> None:
            w = read_whole(model_dir, files, family, f"{name}.weight", linear.weight, dtype, device)
            linear.weight = torch.nn.Parameter(w, requires_grad=False)
            quantized.append(f"{name}.weight")

        apply_lora(model, lora, base_weight=fill)
    _allocate_meta(model, device)
    load_sharded(model_dir, model, dtype, loaded=frozenset(quantized))
    return model, manifest


def _allocate_meta(model: Transformer, device: torch.device) -> None:
    """Give every tensor of `model` still on the meta device storage on `device` (values
    undefined), the embedding shared with a tied head again, and the non-persistent buffers
    computed (RoPE, MoE state)."""
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(mod, name, torch.nn.Parameter(torch.empty_like(p, device=device),
                                                      requires_grad=p.requires_grad))
        for name, b in list(mod.named_buffers(recurse=False)):
            if b.is_meta:
                mod.register_buffer(name, torch.empty_like(b, device=device),
                                    persistent=name not in mod._non_persistent_buffers_set)
    if model.args.tie_embeddings:
        model.tie_weights()
    model.init_buffers()


def materialize_model(model: Transformer, cfg: ModelConfig, device: torch.device, seed: int = 0) -> int:
    """Give a model from load_model(meta=True), parallelized or not, this rank's shards on
    `device`: read from the checkpoint's slices this rank owns (posttrain.registry.hf_sharded), or a
    preset's random init, then LoRA adapters' init (as apply_lora on the loaded model would draw
    them). The values are those load_model(meta=False) (+ apply_lora) gives, in every layout.
    Returns the checkpoint bytes this rank read (0 for a preset)."""
    from posttrain.core.parallel.materialize import init_adapters, init_weights, materialize
    from posttrain.registry.hf_sharded import load_sharded

    model_dir, _ = resolve_model_dir(cfg.name_or_path)
    materialize(model, device)
    read = 0
    if model_dir is None:
        init_weights(model, seed)
    else:
        read = sum(load_sharded(model_dir, model, DTYPES[cfg.dtype]).values())
        log.info("loaded this rank's shards of %s: %.1f MB read", model_dir, read / 2**20)
    init_adapters(model)
    return read


def find_tokenizer_dir(*candidates: str | Path | None) -> Path:
    """The first candidate that is (or whose manifest names) a tokenizer directory."""
    for c in candidates:
        if c is None:
            continue
        p = Path(local_model_path(c))
        if is_stage_dir(p):
            outputs = read_manifest(p)["outputs"]
            for key in ("tokenizer", "model"):
                if key in outputs and (p / outputs[key] / "tokenizer.json").exists():
                    return p / outputs[key]
        elif (p / "tokenizer.json").exists():
            return p
    raise StageError(f"no tokenizer.json found in any of {[str(c) for c in candidates if c]}")


def load_tokenizer(*candidates: str | Path | None):
    from posttrain.registry.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(find_tokenizer_dir(*candidates))


# ---------------------------------------------------------------------------------------------
# Progress


@contextlib.contextmanager
def progress(total: int, description: str, enabled: bool = True) -> Iterator[Any]:
    """A rich progress bar on rank 0 (`advance(n, **fields)`), a no-op elsewhere."""
    if not enabled or not sys.stderr.isatty() and os.environ.get("POSTTRAIN_PROGRESS") != "1":
        yield lambda n=1, **kw: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[info]}")) as bar:
        task = bar.add_task(description, total=total, info="")

        def advance(n: int = 1, **fields: float) -> None:
            info = " ".join(f"{k}={v:.4g}" for k, v in fields.items())
            bar.update(task, advance=n, info=info)

        yield advance


def dump_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))




# ---------------------------------------------------------------------------------------------
# Tracking


@contextlib.contextmanager
def stage_run(cfg: StageConfig, stage: str, is_main: bool = True) -> Iterator[Any]:
    """The stage's MLflow child run on rank 0 (nested under the pipeline's parent run when
    MLFLOW_PARENT_RUN_ID / POSTTRAIN_PARENT_RUN_ID is set; the run POSTTRAIN_RUN_ID names, opened
    by the flow, when set); a no-op elsewhere or when off.
    A failure ends the run as FAILED with the exception as a tag, then propagates."""
    tracking = cfg.tracking
    if not is_main or tracking is None or not tracking.enabled:
        yield NullTracker()
        return
    from posttrain.core.config import dump_config

    name = os.environ.get("POSTTRAIN_RUN_NAME") or stage
    # POSTTRAIN_RUN_ID: the child run the pipeline flow opened when it launched this stage (so the
    # run's duration is the stage's), resumed here; without it (a stage run on its own) a new run
    tracker = Tracker(tracking, run_name=name, tags={"posttrain.stage": stage, **tracking.tags},
                      run_id=os.environ.get("POSTTRAIN_RUN_ID") or None)
    tracker.log_params(dump_config(cfg))
    if tracker.run_id is None:
        tracker.flush(timeout=60)  # creates the run, so its id can go into the stage manifest
    try:
        yield tracker
    except BaseException as e:
        from posttrain.core.reliability import Preempted

        tracker.set_tags({"posttrain.error": f"{type(e).__name__}: {e}"[:5000]})
        tracker.end(status="KILLED" if isinstance(e, (Preempted, KeyboardInterrupt)) else "FAILED")
        raise
    else:
        tracker.end(status="FINISHED")
