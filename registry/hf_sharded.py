"""Loading an HF checkpoint into a parallelized model, each rank reading only its own slices.

The model was built on the meta device, parallelized and materialized (posttrain.core.parallel.materialize);
each of its tensors holds one block of the whole (`local_part`). For each one this reads exactly
that block from the memory-mapped safetensors file (`safe_open(...).get_slice(name)[block]`),
under the HF name the family's StateDictAdapter gives (registry/hf.py); stacked expert tensors
(E, ...) read the per-expert tensors of the experts in the block, each sliced. So a rank's reads
add up to its shards, not to the model: about 1/n of the checkpoint's bytes for n FSDP ranks.

Names and shapes are checked from the files' headers before any tensor is read, with
load_pretrained's messages. Values are load_pretrained's bit for bit (the same cast to `dtype`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from posttrain.core.lora.model import lora_parameters
from posttrain.core.parallel.materialize import local_part
from posttrain.registry.hf import ADAPTERS, CheckpointError, _safetensors_files


@contextmanager
def open_checkpoint(path: str | Path) -> Iterator[dict]:
    """{HF tensor name: its open, memory-mapped safetensors file} of the checkpoint directory."""
    with ExitStack() as stack:
        files = {}
        for file in _safetensors_files(Path(path)):
            try:
                f = stack.enter_context(safe_open(str(file), framework="pt"))
            except SafetensorError as e:
                raise CheckpointError(f"{file}: unreadable or truncated safetensors file ({e})") from None
            files.update(dict.fromkeys(f.keys(), f))
        yield files


def read_whole(path: str | Path, files: dict, family: str, key: str, like: torch.Tensor, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Our whole tensor `key` of a `family` model (shaped like `like`, e.g. a meta parameter)
    from the open checkpoint `files` (open_checkpoint), cast to `dtype` on `device`: one weight
    at a time (QLoRA quantizes each as it is read: posttrain.stages.common.load_quantized)."""
    names, stacked = _sources(Path(path), key, like, ADAPTERS[family], files)
    t = torch.stack([files[n].get_tensor(n) for n in names]) if stacked else files[names[0]].get_tensor(names[0])
    return t.to(device=device, dtype=dtype)


def load_sharded(path: str | Path, model: nn.Module, dtype: torch.dtype,
                 loaded: frozenset[str] = frozenset()) -> dict[str, int]:
    """Fill this rank's part of every checkpoint weight of `model` (a materialized
    posttrain.core.model.Transformer, any layout) from the HF checkpoint directory `path`, cast to
    `dtype`. Returns the bytes read per HF tensor name (in the file's dtype): the loader's own
    accounting, for logs and tests. LoRA adapters and the MoE expert bias are not in a checkpoint;
    `loaded`: our names of weights already filled (an NF4 base quantized as it was read)."""
    path = Path(path)
    args = model.args
    adapter = ADAPTERS[args.family]
    adapters = {id(p) for p in lora_parameters(model)}
    # A tied head is the embedding, except on a pipeline's last stage, which holds a copy of it alone.
    head_copy = args.tie_embeddings and getattr(model, "embed", None) is None
    skip = tuple(f"{k}." for k in loaded)  # an NF4 weight's own state (its codes and scales)
    expected = {k: t for k, t in model.state_dict(keep_vars=True).items()
                if id(t) not in adapters and not k.endswith("router.expert_bias") and not k.startswith(skip)
                and not (k == "lm_head.weight" and args.tie_embeddings and not head_copy)}
    others = {n for n, _ in getattr(model, "whole_parameters", ())}  # a pipeline stage's part: the rest's names
    read: dict[str, int] = {}
    with open_checkpoint(path) as files:
        for name in files:
            mapped = adapter.to_ours(name)
            if mapped is not None and (mapped[0] in loaded or mapped[0] in others and mapped[0] not in expected):
                continue  # already read, or another pipeline stage's weight
            if mapped is None or mapped[0] not in expected:
                if name == "lm_head.weight" and args.tie_embeddings:
                    continue  # some tied checkpoints store the head anyway
                raise CheckpointError(f"{path}: unexpected tensor {name!r} for model_type {args.family!r}")
        sources = {key: _sources(path, "embed.weight" if key == "lm_head.weight" and head_copy else key, t,
                                 adapter, files) for key, t in expected.items()}
        with torch.no_grad():
            for key, t in expected.items():
                local, block = local_part(t)
                if local.numel() == 0:
                    continue
                names, stacked = sources[key]
                if not stacked:  # one HF tensor, sliced as ours
                    part = files[names[0]].get_slice(names[0])[block]
                    read[names[0]] = part.numel() * part.element_size()
                else:  # stacked experts: those in the block, each sliced on its own dims
                    parts = []
                    for e in range(block[0].start, block[0].stop):
                        parts.append(files[names[e]].get_slice(names[e])[block[1:]])
                        read[names[e]] = parts[-1].numel() * parts[-1].element_size()
                    part = torch.stack(parts)
                local.copy_(part.to(dtype))
    return read


def _sources(path: Path, key: str, t: torch.Tensor, adapter, files: dict) -> tuple[list[str], bool]:
    """The HF names of our tensor `key` (one, or one per expert: stacked), checked present and
    shaped as the config implies, from the file headers alone."""
    names = [n for n, _ in adapter.to_hf(key, torch.empty(t.shape, device="meta"))]
    shown = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
    stacked = adapter.to_ours(names[0])[1] is not None  # (key, expert index) for one of the stack
    missing = [i for i, n in enumerate(names) if n not in files]
    if missing and len(missing) < len(names) and stacked:
        raise CheckpointError(f"{path}: tensor {key!r} is missing experts {missing}")
    if missing:
        raise CheckpointError(f"{path}: missing tensor for {key!r} ({shown})")
    shapes = [tuple(files[n].get_slice(n).get_shape()) for n in names]
    got = shapes[0] if not stacked else (len(shapes), *shapes[0])
    if any(s != shapes[0] for s in shapes) or got != tuple(t.shape):
        raise CheckpointError(f"{path}: tensor {key!r} ({shown}) has shape {got}, config.json implies "
                              f"{tuple(t.shape)}")
    return names, stacked
