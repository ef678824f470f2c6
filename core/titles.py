"""Human titles for config fields and schemas, as the Prefect run form shows them.

pydantic's own titles capitalize each word of the field name ("Sft Teacher", "Lora", "Lock Wait S");
these keep acronyms as they are written (SFT, LoRA, MLflow), spell out the terse keys (`lr`,
`tp`) with the key itself in brackets, and capitalize only the first word:

    field_title("sft_teacher")  -> "SFT teacher"
    field_title("lr")           -> "Learning rate"
    field_title("tp")           -> "Tensor parallel (tp)"
    field_title("lock_wait_s")  -> "Lock wait (s)"
    model_title(LoRAConfig)     -> "LoRA"
"""

from __future__ import annotations

import re
from typing import Any

ACRONYMS = {w.lower(): w for w in (
    "SFT", "DPO", "GRPO", "DAPO", "KD", "GKD", "LoRA", "QLoRA", "rsLoRA", "DoRA", "MLflow", "FSDP", "HSDP", "DDP", "TP", "PP",
    "CP", "EP", "DP", "KV", "NF4", "FP4", "FP8", "BF16", "GPU", "GPUs", "CPU", "CPUs", "URI", "URL", "ID", "IDs",
    "LR", "HF", "KL", "JSD", "RPO", "SimPO", "IPO", "API", "JSON", "YAML", "IANA", "MoE", "RoPE", "EMA", "PEFT",
    "NCCL", "CUDA", "SSH", "DAG", "UI", "I/O", "TTL", "KTO")}
ACRONYMS.update({"mlflow": "MLflow", "rdzv": "rendezvous", "nproc": "processes", "num": "number of"})

# Keys whose words say too little on their own: the title in full, the key after it.
SPELLED_OUT = {
    "lr": "Learning rate",
    "tp": "Tensor parallel (tp)",
    "pp": "Pipeline parallel (pp)",
    "cp": "Context parallel (cp)",
    "ep": "Expert parallel (ep)",
    "dp_replicate": "Data parallel, replicated (dp_replicate)",
    "dp_shard": "Data parallel, sharded (dp_shard)",
    "name_or_path": "Name or path",
    "nproc_per_node": "Processes per node",
    "nnodes": "Nodes (hosts)",
    "eps": "Epsilon",
    "optim": "Optimizer",
    "parallel": "Parallel layout",
    "dtype": "Data type (dtype)",
    "top_k": "Top-k",
    "top_p": "Top-p",
    "pass_k": "pass@k",
    "ld_alpha": "Length-desensitized DPO alpha (ld_alpha)",
    "use_weighting": "WPO weighting (use_weighting)",
    "f_divergence_type": "f-divergence (f_divergence_type)",
    "f_alpha_divergence_coef": "f-divergence alpha (f_alpha_divergence_coef)",
    "discopop_tau": "DiscoPOP tau",
    "qat": "Quantization-aware training (qat)",
    "precision": "Precision (mixed: bf16, fp16, fp8)",
    "fp8_emulate": "Emulate fp8 (testing)",
}
_UNITS = {"s": "(s)", "ms": "(ms)", "mb": "(MB)", "gb": "(GB)"}


def _word(w: str) -> str:
    return ACRONYMS.get(w.lower(), w)


def field_title(name: str, info: Any = None) -> str:
    """The form title of the field (or section) `name`; `info` (pydantic's FieldInfo) is unused."""
    if name in SPELLED_OUT:
        return SPELLED_OUT[name]
    parts = [p for p in name.split("_") if p]
    if not parts:
        return name
    if len(parts) > 1 and parts[-1] in _UNITS:
        parts[-1] = _UNITS[parts[-1]]
    words = [_word(p) for p in parts]
    first = words[0]
    if first == first.lower():  # a plain word (not an acronym, which keeps its case): capitalized
        first = first[:1].upper() + first[1:]
    return " ".join([first, *words[1:]])


_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z0-9]+|[A-Z]+")


def model_title(cls: type) -> str:
    """A schema's title from its class name: LoRAConfig -> "LoRA", DPONode -> "DPO node"."""
    name = cls.__name__.removesuffix("Config") or cls.__name__
    # An acronym written mixed-case at the start (LoRA, MLflow) is kept whole; CamelCase splits the rest.
    head = next((a for a in sorted(ACRONYMS.values(), key=len, reverse=True)
                 if name.startswith(a) and not a.isupper()), "")
    words = ([head] if head else []) + [w.lower() for w in _CAMEL.findall(name[len(head):])]
    return field_title("_".join(words)) if not head else " ".join([head, *(_word(w) for w in words[1:])])
