"""The model, LoRA and the losses import and train on the CPU where Triton is not installed
(pyproject makes Triton Linux-only): only kernels/jit/ imports Triton, on a kernel's first launch.

The check runs in a fresh interpreter whose import system refuses `triton` and every submodule
of it, as an interpreter without the package would, before anything of the project is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


SCRIPT = textwrap.dedent("""
    import importlib.abc
    import sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())

    import torch

    import posttrain.core.lora
    import posttrain.core.losses
    import posttrain.core.model
    import posttrain.kernels
    from posttrain.core.model import build_model, get_preset
    from posttrain.kernels.dispatch import triton_available, use_triton

    assert not triton_available()
    x = torch.zeros(2, 3)
    assert not use_triton(x), "use_triton must say no without Triton, even under TRITON_INTERPRET=1"

    torch.manual_seed(0)
    model = build_model(get_preset("debug"))
    ids = torch.randint(0, model.args.vocab_size, (2, 16))
    labels = ids.clone()
    labels[:, :4] = posttrain.core.losses.IGNORE_INDEX
    loss = model(ids, head=lambda h, w: posttrain.kernels.fused_linear_cross_entropy(h, w, labels, chunk_size=8))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and all(g is not None and torch.isfinite(g).all() for g in grads)

    posttrain.core.lora.apply_lora(model, rank=4, alpha=8, targets="all-linear")
    logits = model(ids)
    posttrain.core.losses.cross_entropy(logits, labels).backward()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.grad is not None for p in lora)

    assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules), "triton was imported"
    assert not any(m.startswith("posttrain.kernels.jit") for m in sys.modules), "Triton device code was imported"
    print("ok")
""")


@pytest.mark.slow
def test_model_lora_and_losses_run_without_triton(tmp_path):
    # TRITON_INTERPRET=1 would make use_triton choose the kernels on CPU tensors if Triton were
    # there: the finder must be what keeps them off.
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("POSTTRAIN_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
