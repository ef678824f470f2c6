"""Generation engine: paged KV cache, continuous batching, per-request sampling.

Names load on first use (core.lazy), as in core.model.
"""

from core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "BlockManager": "core.generation.paged",
    "Completion": "core.generation.sampling",
    "Engine": "core.generation.engine",
    "ForwardBatch": "core.generation.runner",
    "ModelRunner": "core.generation.runner",
    "PagedKVCache": "core.generation.paged",
    "RequestOutput": "core.generation.sampling",
    "RequestParams": "core.generation.sampling",
})
