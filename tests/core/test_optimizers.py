"""optim.name: every optimizer resumes bit-exactly from a checkpoint and lowers the debug model's
loss; Muon's split and step against Keller Jordan's formula written out; the refusals."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from posttrain.core.checkpoint import CheckpointManager
from posttrain.core.model import build_model, get_preset
from posttrain.core.optim import OptimConfig
from posttrain.core.optimizers import MuonWithAdamW, build_optimizer, state_bytes
from posttrain.core.trainer import Trainer
from tests.core.test_trainer import lm_objective, make_batches

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
NAMES = [
    pytest.param({"name": "adamw"}, id="adamw"),
    pytest.param({"name": "adamw", "fused": True}, id="adamw-fused"),
    pytest.param({"name": "adafactor", "lr": 3e-2}, id="adafactor"),  # lr relative to each weight's RMS
    pytest.param({"name": "muon"}, id="muon"),
    pytest.param({"name": "adamw8bit"}, id="adamw8bit",
                 marks=pytest.mark.skipif(not HAS_TORCHAO, reason="torchao not installed (pip install 'posttrain[optim]')")),
]
STEPS = 6


def optim_cfg(**kw) -> OptimConfig:
    return OptimConfig(**{"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.1, **kw})


def run(kw: dict, manager: CheckpointManager | None = None, stop: int = STEPS, resume: bool = False, seed: int = 0):
    """Train STEPS steps (batches cycle); save after step 3; stop early at `stop` (a killed job)."""
    torch.manual_seed(seed)
    model = build_model(get_preset("debug"))
    trainer = Trainer(model, optim_cfg(**kw), total_steps=STEPS)
    if resume:
        assert trainer.load_state(manager) is not None
    batches, losses = make_batches(), []
    for k in range(trainer.step, stop):
        trainer.forward_backward(batches[k % 3], lm_objective)
        losses.append(trainer.optim_step()["loss"])
        if manager is not None and k == 2:
            trainer.save_state(manager)
    if manager is not None:
        manager.close()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, trainer


@pytest.mark.parametrize("kw", NAMES)
@pytest.mark.slow
def test_resume_is_bit_exact_and_the_loss_falls(tmp_path, kw):
    full_losses, full, trainer = run(kw)
    assert full_losses[-1] < full_losses[0] - 0.3, full_losses
    assert state_bytes(trainer.optimizer) > 0
    run(kw, CheckpointManager(tmp_path), stop=4)
    # A fresh process: other init; model, optimizer state and schedule all come from the checkpoint.
    resumed_losses, resumed, _ = run(kw, CheckpointManager(tmp_path), resume=True, seed=123)
    assert resumed_losses == full_losses[3:]
    for n, v in full.items():
        assert torch.equal(v, resumed[n]), n


def test_muon_takes_the_hidden_matrices_only():
    model = build_model(get_preset("debug").replace(tie_embeddings=False))
    opt = build_optimizer(model, optim_cfg(name="muon"))
    assert isinstance(opt, MuonWithAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    rest = {names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    assert muon == {n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")}
    assert {"embed.weight", "lm_head.weight", "norm.weight"} <= rest and not muon & rest


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's zeropower_via_newtonschulz5 (github.com/KellerJordan/Muon, muon.py), as written there."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g.bfloat16()
    if g.size(-2) > g.size(-1):
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = x @ x.mT
        B = b * A + c * A @ A
        x = a * x + B @ x
    if g.size(-2) > g.size(-1):
        x = x.mT
    return x


def test_muon_step_is_the_published_formula():
    """Two steps of one hidden matrix against the formula written out: momentum, Nesterov,
    Newton-Schulz, decoupled decay, the shape's lr scale (match_rms_adamw: 0.2 sqrt(max(A, B)))."""
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(48, 80, bias=False))  # A=80 > B=48
    w0 = lin[0].weight.detach().clone()
    cfg = optim_cfg(name="muon", lr=0.02, weight_decay=0.1)
    opt = build_optimizer(lin, cfg)
    w, buf = w0.clone(), torch.zeros_like(w0)
    for _ in range(2):
        g = torch.randn_like(w0)
        lin[0].weight.grad = g.clone()
        opt.step()
        buf = 0.95 * buf + g
        update = newton_schulz(g + 0.95 * buf).float()
        w = w * (1 - cfg.lr * cfg.weight_decay) - cfg.lr * 0.2 * math.sqrt(80) * update
        # bf16 Newton-Schulz: the two evaluation orders agree to bf16's precision only
        torch.testing.assert_close(lin[0].weight.detach(), w, atol=2e-3, rtol=0)
        w = lin[0].weight.detach().clone()  # compare each step from the same point


def test_state_bytes_per_parameter():
    """AdamW keeps two fp32 moments (8 bytes per parameter); Muon one momentum on the matrices;
    Adafactor a row and a column per matrix."""
    model = build_model(get_preset("debug"))
    n = sum(p.numel() for p in model.parameters())
    sizes = {}
    for name in ("adamw", "adafactor", "muon"):
        trainer = Trainer(build_model(get_preset("debug")), optim_cfg(name=name), total_steps=1)
        sizes[name] = state_bytes(trainer.optimizer) / n
    assert 8 <= sizes["adamw"] < 8.01
    assert 4 < sizes["muon"] < 8 and sizes["adafactor"] < 0.5


def test_refusals():
    with pytest.raises(ValueError, match="fused"):
        OptimConfig(name="adafactor", fused=True)


def test_adamw8bit_without_torchao_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # what an environment without it imports
    with pytest.raises(ImportError, match="pip install"):
        build_optimizer(build_model(get_preset("debug")), optim_cfg(name="adamw8bit"))
