"""The decoder-only transformer (dense and MoE), its presets and KV-cache sampling.

Names load on first use (core.lazy): `core.model.config` (ModelConfig) imports without torch.
"""

from core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "KVCache": "core.model.model",
    "MoEArgs": "core.model.args",
    "ModelArgs": "core.model.args",
    "PRESETS": "core.model.args",
    "Transformer": "core.model.model",
    "build_model": "core.model.model",
    "get_preset": "core.model.args",
})
