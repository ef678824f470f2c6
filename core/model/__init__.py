"""The decoder-only transformer (dense and MoE), its presets and KV-cache sampling."""

from core.model.args import PRESETS, ModelArgs, MoEArgs, get_preset
from core.model.model import KVCache, Transformer, build_model

__all__ = ["PRESETS", "KVCache", "ModelArgs", "MoEArgs", "Transformer", "build_model", "get_preset"]
