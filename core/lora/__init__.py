"""LoRA, DoRA and QLoRA adapters written here (the runtime never imports peft).

    layer.py   LoRALinear: a frozen nn.Linear (dense or NF4) plus named low-rank adapters
    model.py   apply_lora(model, LoRAConfig), named adapters, disable_adapter, merging, state dicts
    config.py  LoRAConfig, the schema apply_lora reads (torch-free)

Names load on first use (core.lazy), so `from core.lora.config import LoRAConfig` needs no torch.
"""

from core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "LoRAConfig": "core.lora.config",
    "LoRALinear": "core.lora.layer",
    "OUTPUT_HEADS": "core.lora.layer",
    "PlainLoRA": "core.lora.layer",
    "adapter_config": "core.lora.model",
    "adapter_names": "core.lora.model",
    "adapter_state_dict": "core.lora.model",
    "add_adapter": "core.lora.model",
    "apply_lora": "core.lora.model",
    "count_trainable": "core.lora.model",
    "delete_adapter": "core.lora.model",
    "disable_adapter": "core.lora.model",
    "load_adapter_state_dict": "core.lora.model",
    "lora_modules": "core.lora.model",
    "lora_parameters": "core.lora.model",
    "merge_lora": "core.lora.model",
    "merged_state_dict": "core.lora.model",
    "route_adapters": "core.lora.model",
    "set_adapter": "core.lora.model",
    "unmerge_lora": "core.lora.model",
})
