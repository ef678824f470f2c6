"""Generation engine: paged KV cache, continuous batching, per-request sampling.

Names load on first use (posttrain.core.lazy), as in posttrain.core.model.
"""

from posttrain.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "BlockManager": "posttrain.core.generation.paged",
    "Completion": "posttrain.core.generation.sampling",
    "Engine": "posttrain.core.generation.engine",
    "ForwardBatch": "posttrain.core.generation.runner",
    "ModelRunner": "posttrain.core.generation.runner",
    "PagedKVCache": "posttrain.core.generation.paged",
    "RequestOutput": "posttrain.core.generation.sampling",
    "RequestParams": "posttrain.core.generation.sampling",
})
