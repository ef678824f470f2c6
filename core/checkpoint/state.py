"""What goes into a checkpoint besides DCP's tensors: JSON for every other value (no pickle), RNG
states, the split of a state dict into tensors and values, and the model state dict to save.

Tensors and arrays in JSON become raw bytes in base64 (small ones only: RNG states, sampler
positions); tuples and dicts with non-string keys are tagged so they come back as the same types.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
from typing import Any, Mapping, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from posttrain.core.checkpoint.layout import CheckpointError

try:
    import numpy as np
except ImportError:  # numpy is optional; its RNG is then not part of the state
    np = None


@runtime_checkable
class Stateful(Protocol):
    """Anything with state_dict/load_state_dict (a data sampler, a loss-spike detector...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def encode(x: Any, where: str) -> Any:
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
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: encode(v, f"{where}.{k}") for k, v in x.items()}
        return {"__dict__": [[encode(k, where), encode(v, f"{where}.{k}")] for k, v in x.items()]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise CheckpointError(f"{where}: {type(x).__name__} is neither JSON-able nor a tensor; "
                          "checkpoints hold no pickled objects")


def decode(x: Any) -> Any:
    if isinstance(x, list):
        return [decode(v) for v in x]
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
        return tuple(decode(v) for v in x["__tuple__"])
    if "__dict__" in x:
        return {decode(k): decode(v) for k, v in x["__dict__"]}
    return {k: decode(v) for k, v in x.items()}


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])


def split_tensors(flat: Mapping[str, Any], prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (incl. DTensor shards) go to DCP, everything else to JSON."""
    tensors, values = {}, {}
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            tensors[prefix + k] = v
        else:
            values[k] = v
    return tensors, values


def model_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, Any]:
    """What a checkpoint saves of the model. trainable_only (adapter training): the trained
    parameters and the buffers that carry state, without the frozen base, which the run loads
    again from the base model; so also without a QLoRA base's NF4 buffers (posttrain.core.quant.NF4Weight),
    derived from it (half a byte per base weight in every checkpoint otherwise)."""
    from posttrain.core.quant import NF4Weight

    sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))
    if trainable_only:  # DSD keeps tied aliases of frozen params (lm_head.weight = embed.weight)
        frozen = {n.replace("_orig_mod.", "") for n, p in model.named_parameters(remove_duplicate=False)
                  if not p.requires_grad}
        nf4 = tuple(n.replace("_orig_mod.", "") + "." for n, m in model.named_modules() if isinstance(m, NF4Weight))
        sd = {k: v for k, v in sd.items() if k not in frozen and not (nf4 and k.startswith(nf4))}
    return sd


def config_hash(config: Any) -> str | None:
    if config is None:
        return None
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def optim_options(trainable_only: bool) -> StateDictOptions:
    """How optimizer state is saved and loaded: flattened by parameter name."""
    return StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=trainable_only)
