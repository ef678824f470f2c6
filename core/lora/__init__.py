"""LoRA, DoRA and QLoRA adapters written here (the runtime never imports peft).

    layer.py   LoRALinear: a frozen nn.Linear (dense or NF4) plus named low-rank adapters
    model.py   apply_lora(model, LoRAConfig), named adapters, disable_adapter, merging, state dicts
    config.py  LoRAConfig, the schema apply_lora reads (torch-free)

Names load on first use (posttrain.core.lazy), so `from posttrain.core.lora.config import LoRAConfig` needs no torch.
"""

from posttrain.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "LoRAConfig": "posttrain.core.lora.config",
    "LoRALinear": "posttrain.core.lora.layer",
    "OUTPUT_HEADS": "posttrain.core.lora.layer",
    "PlainLoRA": "posttrain.core.lora.layer",
    "adapter_config": "posttrain.core.lora.model",
    "adapter_names": "posttrain.core.lora.model",
    "adapter_state_dict": "posttrain.core.lora.model",
    "add_adapter": "posttrain.core.lora.model",
    "apply_lora": "posttrain.core.lora.model",
    "count_trainable": "posttrain.core.lora.model",
    "delete_adapter": "posttrain.core.lora.model",
    "disable_adapter": "posttrain.core.lora.model",
    "load_adapter_state_dict": "posttrain.core.lora.model",
    "lora_modules": "posttrain.core.lora.model",
    "lora_parameters": "posttrain.core.lora.model",
    "merge_lora": "posttrain.core.lora.model",
    "merged_state_dict": "posttrain.core.lora.model",
    "route_adapters": "posttrain.core.lora.model",
    "set_adapter": "posttrain.core.lora.model",
    "unmerge_lora": "posttrain.core.lora.model",
})
