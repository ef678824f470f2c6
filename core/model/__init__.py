"""The decoder-only transformer (dense and MoE), its presets and KV-cache sampling.

Names load on first use (posttrain.core.lazy): `posttrain.core.model.config` (ModelConfig) imports without torch.
"""

from posttrain.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "KVCache": "posttrain.core.model.model",
    "MoEArgs": "posttrain.core.model.args",
    "ModelArgs": "posttrain.core.model.args",
    "PRESETS": "posttrain.core.model.args",
    "Transformer": "posttrain.core.model.model",
    "build_model": "posttrain.core.model.model",
    "get_preset": "posttrain.core.model.args",
})
