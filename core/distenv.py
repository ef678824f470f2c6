"""Where this process stands in a distributed job (the one rank helper of core/), and the object
collectives that fall back to a single process when there is no process group.

torch.distributed is imported on first use, so torch-free code may import this module.
"""

from __future__ import annotations

import os
from typing import Any


def dist_on() -> bool:
    """A default process group exists."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_world(*, env_fallback: bool = False) -> tuple[int, int]:
    """(rank, world size) in the default process group. Without one: (0, 1), or with
    `env_fallback` what torchrun put in RANK / WORLD_SIZE (the watchdog names its files by rank
    even where no group was created). Code that runs collectives must not take the fallback."""
    if dist_on():
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()
    if env_fallback:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return 0, 1


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's `obj`, in rank order ([obj] without a process group)."""
    if not dist_on():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group=None) -> Any:
    """Rank 0's `obj` on every rank (`obj` itself without a process group)."""
    if not dist_on():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
