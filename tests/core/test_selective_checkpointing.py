"""model.activation_checkpointing 'every_k': every k-th block recomputes its activations in
backward. Gradients equal those without checkpointing; fewer activations are kept for backward
(counted through torch.autograd.graph.saved_tensors_hooks, which sees what autograd saves outside
the checkpointed blocks: inside them the checkpoint's own hooks keep nothing)."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.core.model import build_model, get_preset
from posttrain.core.model.config import ModelConfig
from posttrain.core.parallel.data_parallel import apply_activation_checkpointing


def saved_bytes_and_grads(model, ids):
    """Bytes autograd keeps for backward (each storage once), and the gradients."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).float().logsumexp(-1).mean()
    loss.backward()
    return sum(storages.values()), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode,every,wrapped", [("full", 1, [0, 1, 2, 3]), ("every_k", 2, [1, 3]),
                                                ("every_k", 4, [3]), (True, 2, [0, 1, 2, 3]), ("none", 2, [])])
def test_every_kth_block_is_checkpointed_with_the_same_gradients_and_fewer_activations(mode, every, wrapped):
    torch.manual_seed(0)
    ref = build_model(get_preset("debug").replace(num_layers=4))
    model = copy.deepcopy(ref)
    k = ModelConfig(activation_checkpointing=mode, activation_checkpointing_every=every).checkpoint_every
    chosen = apply_activation_checkpointing(list(model.layers), k)
    assert [i for i, b in enumerate(model.layers) if any(b is c for c in chosen)] == wrapped
    ids = torch.randint(0, 512, (2, 64))
    ref_bytes, ref_grads = saved_bytes_and_grads(ref, ids)
    bytes_, grads = saved_bytes_and_grads(model, ids)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=0)
    if wrapped:
        assert bytes_ < ref_bytes
    else:
        assert bytes_ == ref_bytes


def test_more_checkpointed_blocks_keep_less():
    torch.manual_seed(0)
    ref = build_model(get_preset("debug").replace(num_layers=4))
    ids = torch.randint(0, 512, (2, 64))
    kept = []
    for every in (0, 4, 2, 1):
        model = copy.deepcopy(ref)
        apply_activation_checkpointing(list(model.layers), every)
        kept.append(saved_bytes_and_grads(model, ids)[0])
    assert kept == sorted(kept, reverse=True) and len(set(kept)) == 4, kept


def test_the_bool_keeps_its_meaning():
    assert ModelConfig().checkpoint_every == 0
    assert ModelConfig(activation_checkpointing=False).checkpoint_every == 0
    assert ModelConfig(activation_checkpointing=True).checkpoint_every == 1
    assert ModelConfig(activation_checkpointing="every_k", activation_checkpointing_every=3).checkpoint_every == 3
    with pytest.raises(ValueError):
        ModelConfig(activation_checkpointing="some")
