"""Training primitives: token-exact gradient accumulation, schedules, param groups, NaN skips."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from posttrain.core.optim import OptimConfig
from posttrain.core.losses import chunked_cross_entropy, num_target_tokens
from posttrain.core.model import build_model, get_preset
from posttrain.core.trainer import LossOutput, Trainer, lr_lambda, param_groups


def lm_objective(model, batch):
    labels = batch["labels"]
    loss = model(batch["input_ids"], batch.get("position_ids"),
                 head=lambda h, w: chunked_cross_entropy(h, w, labels, reduction="sum", chunk_size=16))
    return LossOutput(loss, num_target_tokens(labels).sum())


def make_batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for n in (7, 13, 4):  # ragged micro-batches with different numbers of target tokens
        ids = torch.randint(0, 512, (2, n), generator=g)
        labels = ids.clone()
        labels[:, : n // 2] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def test_accumulation_equals_one_big_token_weighted_mean():
    cfg = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", max_grad_norm=None)
    model = build_model(get_preset("debug"))
    ref_model = copy.deepcopy(model)
    batches = make_batches()

    trainer = Trainer(model, cfg, total_steps=1)
    for b in batches:
        trainer.forward_backward(b, lm_objective)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # reference: the mean over all target tokens of all micro-batches, in one autograd graph
    total = sum(num_target_tokens(b["labels"]).sum() for b in batches)
    loss = sum(lm_objective(ref_model, b).loss_sum for b in batches) / total
    loss.backward()
    metrics = trainer.optim_step()
    assert math.isclose(metrics["loss"], loss.item(), rel_tol=1e-6)
    assert metrics["tokens"] == total.item()
    # optim_step scaled the accumulated sums by 1/total before stepping; compare pre-step grads
    for n, p in ref_model.named_parameters():
        assert torch.allclose(grads[n] / total, p.grad, atol=1e-7), n


def test_param_groups_skip_norms_and_biases():
    model = build_model(get_preset("debug").replace(family="qwen2", qkv_bias=True))
    groups = param_groups(model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.ndim >= 2), name
    assert groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedule_shapes(schedule):
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule=schedule, min_lr_ratio=0.1)
    f = lr_lambda(cfg, total_steps=20)
    warm = [f(s) for s in range(4)]
    assert warm == sorted(warm) and warm[-1] < 1.0
    assert f(4) == pytest.approx(1.0)
    end = f(20)
    assert end == pytest.approx(1.0 if schedule == "constant" else 0.1)
    if schedule == "cosine":
        assert f(12) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay


def test_non_finite_step_is_skipped():
    cfg = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant")
    model = build_model(get_preset("debug"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, cfg, total_steps=3)

    def nan_objective(m, batch):
        out = lm_objective(m, batch)
        return LossOutput(out.loss_sum * float("nan"), out.num_tokens)

    trainer.forward_backward(make_batches()[0], nan_objective)
    metrics = trainer.optim_step()
    assert metrics["skipped"] == 1.0 and trainer.step == 0 and trainer.skipped_steps == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None, n
    # the next good step trains normally
    trainer.forward_backward(make_batches()[0], lm_objective)
    assert trainer.optim_step()["skipped"] == 0.0 and trainer.step == 1


def test_training_reduces_loss_and_moe_stats_logged():
    torch.manual_seed(0)
    model = build_model(get_preset("debug-moe"))
    cfg = OptimConfig(lr=3e-3, warmup_steps=0, schedule="constant")
    trainer = Trainer(model, cfg, total_steps=30)
    batch = make_batches()[1]
    first = None
    for _ in range(30):
        trainer.forward_backward(batch, lm_objective)
        m = trainer.optim_step()
        first = first if first is not None else m["loss"]
    assert m["loss"] < first * 0.5
    assert "moe/aux_loss" in m and "moe/layer0_max_load" in m


def test_sampling_a_model_in_training_returns_generations():
    """KV-cache sampling from a model mid-training gives the generations and leaves it training."""
    model = build_model(get_preset("debug"))
    Trainer(model, OptimConfig(), total_steps=1)
    from posttrain.core.model.generate import SamplingParams, generate

    out = generate(model, [[1, 2, 3], [4]], SamplingParams(max_new_tokens=5, temperature=0.0))
    assert [len(g.tokens) for g in out] == [5, 5] and model.training
