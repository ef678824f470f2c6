"""posttrain.core.lora and posttrain.core.quant: LoRA, rsLoRA, DoRA, QLoRA against direct formulas and against peft."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from posttrain.core.lora.config import LoRAConfig
from posttrain.core.lora import (
    LoRALinear, adapter_config, adapter_names, adapter_state_dict, apply_lora, count_trainable,
    delete_adapter, disable_adapter, load_adapter_state_dict, lora_modules, lora_parameters,
    merge_lora, route_adapters, set_adapter, unmerge_lora,
)
from posttrain.core.quant import NF4_CODE, NF4Weight, dequantize_nf4, nf4_linear, quantize_nf4

H = 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        self.attn = nn.ModuleDict({n: nn.Linear(H, H, bias=(n == "q_proj")) for n in names})
        self.mlp = nn.ModuleDict({"up_proj": nn.Linear(H, 2 * H), "down_proj": nn.Linear(2 * H, H)})
        self.norm = nn.LayerNorm(H)

    def forward(self, x):
        a = self.attn
        h = self.norm(x)
        x = x + a["o_proj"](a["q_proj"](h) * torch.sigmoid(a["k_proj"](h)) + a["v_proj"](h))
        return x + self.mlp["down_proj"](F.gelu(self.mlp["up_proj"](self.norm(x))))


class Tiny(nn.Module):
    """A small decoder-shaped stack: names like layers.0.attn.q_proj, an lm_head to exclude."""

    def __init__(self, n_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.lm_head = nn.Linear(H, 16, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def randomize(model, scale=0.1, seed=1):
    """Give every adapter non-zero B (and a non-trivial DoRA magnitude)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(model):
            for p in m.lora_B.values():
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            for p in m.lora_magnitude.values():
                p.mul_(1 + 0.2 * torch.rand(p.shape, generator=g))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_base_names_and_values_unchanged():
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = apply_lora(model, targets="all-linear", rank=4)
    assert "lm_head" not in wrapped and len(wrapped) == 12
    after = model.state_dict()
    assert set(before) <= set(after)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert isinstance(model.layers[0].attn["q_proj"], LoRALinear)
    assert "layers.0.attn.q_proj.lora_A.default" in after
    # The base Parameter object is reused, not copied.
    q = model.layers[0].attn["q_proj"]
    assert q.weight.data_ptr() == after["layers.0.attn.q_proj.weight"].data_ptr()


def test_target_forms():
    cases = [(["q_proj", "v_proj"], 4), (r"layers\.1\..*_proj", 6), (["layers.0.mlp.up_proj"], 1)]
    for targets, n in cases:
        assert len(apply_lora(Tiny(), targets=targets)) == n
    assert "lm_head" in apply_lora(Tiny(), targets="all-linear", exclude=())
    assert len(apply_lora(Tiny(), targets="all-linear", exclude=["down_proj", "lm_head"])) == 10
    with pytest.raises(ValueError, match="no nn.Linear"):
        apply_lora(Tiny(), targets=["nope"])
    with pytest.raises(TypeError, match="unknown LoRA option"):
        apply_lora(Tiny(), rnak=4)

    model = Tiny()
    cfg = LoRAConfig(rank=2, alpha=4.0, targets=["o_proj"], use_rslora=True)
    assert apply_lora(model, cfg) == ["layers.0.attn.o_proj", "layers.1.attn.o_proj"]
    m = model.layers[0].attn["o_proj"]
    assert m.lora_A["default"].shape == (2, H)
    assert m.scaling["default"] == pytest.approx(4 / math.sqrt(2))


def test_config_object_globs_and_several_adapters():
    cfg = LoRAConfig(enabled=True, rank=4, alpha=8, targets=["attn.*"], use_dora=True,
                            quantize_base="nf4", double_quant=True, adapter_names=["a", "b"])
    model = Tiny()
    wrapped = apply_lora(model, cfg)
    assert len(wrapped) == 8 and all(".attn." in n for n in wrapped)
    assert adapter_names(model) == ["a", "b"] and model.layers[0].attn["q_proj"].quantized
    assert model.layers[0].attn["q_proj"].active_adapter == "a"
    assert len(apply_lora(Tiny(), LoRAConfig(targets=["all-linear"]))) == 12
    assert len(apply_lora(Tiny(), targets=["re:layers\\.0\\..*"])) == 6


def test_expert_lora_refuses_what_it_cannot_run_when_the_config_loads():
    with pytest.raises(ValueError, match=r"dropout: LoRA on MoE experts .* set dropout to 0"):
        LoRAConfig(enabled=True, experts=True, dropout=0.1)
    with pytest.raises(ValueError, match=r"experts: LoRA on MoE experts takes one plain adapter"):
        LoRAConfig(enabled=True, experts=True, use_dora=True)
    assert LoRAConfig(enabled=True, experts=True).experts


def test_init_variants_and_modules_to_save():
    x = torch.randn(2, 5, H)
    model = Tiny()
    apply_lora(model, targets="all-linear", rank=8, init_lora_weights="gaussian")
    a = model.layers[0].attn["q_proj"].lora_A["default"]
    assert 0.5 / 8 < a.std() < 2 / 8  # peft's N(0, 1/r^2)

    # PiSSA: s B A = top-r SVD part of W, the base keeps the residual; output unchanged.
    model = Tiny()
    ref = model(x)
    w0 = model.layers[0].mlp["up_proj"].weight.clone()
    apply_lora(model, targets="all-linear", rank=4, alpha=8, init_lora_weights="pissa",
               use_dora=True)
    m = model.layers[0].mlp["up_proj"]
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    s = m.scaling["default"]
    torch.testing.assert_close(m.weight + s * m.lora_B["default"] @ m.lora_A["default"], w0)
    sv = torch.linalg.svdvals(w0)
    torch.testing.assert_close(torch.linalg.svdvals(m.weight)[:4], sv[4:8], rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="PiSSA"):
        with disable_adapter(model):
            pass

    model = Tiny()
    apply_lora(model, targets=["q_proj"], modules_to_save=["lm_head"])
    assert model.lm_head.weight.requires_grad
    assert not model.layers[0].mlp["up_proj"].weight.requires_grad
    with pytest.raises(RuntimeError, match="trained in full"):
        with disable_adapter(model):
            pass


def test_zero_init_equals_base_and_only_adapters_train():
    model = Tiny()
    x = torch.randn(2, 5, H)
    ref = model(x)
    apply_lora(model, targets="all-linear", rank=4, alpha=8, use_dora=True)
    torch.testing.assert_close(model(x), ref, rtol=0, atol=1e-6)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert trainable == {n for n, p in model.named_parameters() if ".lora_" in n}
    assert len(list(lora_parameters(model))) == 3 * 12
    n_train, n_total = count_trainable(model)
    assert n_train == sum(p.numel() for p in lora_parameters(model)) and n_total > n_train
    # A is Kaiming-uniform(a=sqrt(5)): bound 1/sqrt(fan_in); B is zero.
    m = model.layers[0].mlp["down_proj"]
    assert m.lora_A["default"].abs().max() <= 1 / math.sqrt(2 * H) and m.lora_A["default"].std() > 0
    assert not m.lora_B["default"].any()


def test_forward_equals_formula_and_rslora():
    base = nn.Linear(H, 24)
    x = torch.randn(3, 7, H)
    for rslora, scale in [(False, 6 / 4), (True, 6 / 2)]:
        lin = LoRALinear(copy.deepcopy(base))
        lin.add_adapter("a", rank=4, alpha=6, use_rslora=rslora)
        assert lin.scaling["a"] == pytest.approx(scale)
        nn.init.normal_(lin.lora_B["a"])
        A, B = lin.lora_A["a"], lin.lora_B["a"]
        expected = x @ base.weight.T + base.bias + scale * (x @ A.T @ B.T)
        torch.testing.assert_close(lin(x), expected)
    # Dropout applies to the LoRA input only: in eval mode there is none, in training it changes y.
    lin = LoRALinear(copy.deepcopy(base))
    lin.add_adapter("a", rank=4, alpha=4, dropout=0.5)
    nn.init.normal_(lin.lora_B["a"])
    lin.eval()
    y_eval = lin(x)
    lin.train()
    assert not torch.allclose(lin(x), y_eval)
    with disable_adapter(lin):
        torch.testing.assert_close(lin(x), base(x))  # base path never sees dropout


def test_dora_forward_equals_paper_formula():
    base = nn.Linear(H, 24)
    lin = LoRALinear(copy.deepcopy(base))
    lin.add_adapter("d", rank=4, alpha=8, use_dora=True)
    torch.testing.assert_close(lin.lora_magnitude["d"], base.weight.norm(dim=1))
    randomize(lin)
    nn.init.normal_(lin.lora_B["d"], std=0.1)
    x = torch.randn(3, 5, H)
    W, s = base.weight, 2.0
    V = W + s * lin.lora_B["d"] @ lin.lora_A["d"]
    W_dora = lin.lora_magnitude["d"][:, None] * V / V.norm(dim=1, keepdim=True)  # m * V / ||V||_c
    torch.testing.assert_close(lin(x), F.linear(x, W_dora, base.bias))
    # Gradients: those of the same formula with the norm detached (paper section 4.3, peft).
    w = torch.randn(3, 5, 24)
    (lin(x) * w).sum().backward()
    params = [lin.lora_A["d"], lin.lora_B["d"], lin.lora_magnitude["d"]]
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    A, B, m = params
    V = W + s * B @ A
    W_detached = m[:, None] * V / V.norm(dim=1, keepdim=True).detach()
    (F.linear(x, W_detached, base.bias) * w).sum().backward()
    for p, g in zip(params, expected):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("use_dora", [False, True])
def test_merge_unmerge(use_dora):
    model = Tiny()
    apply_lora(model, targets="all-linear", rank=4, alpha=8, use_dora=use_dora)
    randomize(model)
    x = torch.randn(2, 5, H)
    base_w = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("weight")}
    y = model(x)
    merge_lora(model, "default")
    torch.testing.assert_close(model(x), y, rtol=0, atol=1e-5)
    q_w = model.layers[0].attn["q_proj"].weight
    assert not torch.equal(q_w, base_w["layers.0.attn.q_proj.weight"])
    with pytest.raises(RuntimeError, match="merged"):
        with disable_adapter(model):
            pass
    unmerge_lora(model, "default")
    for k, v in base_w.items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=1e-6)
    torch.testing.assert_close(model(x), y, rtol=0, atol=1e-5)


def test_disable_adapter_gives_base_output():
    model = Tiny()
    ref = copy.deepcopy(model)
    apply_lora(model, targets="all-linear", rank=4, use_dora=True)
    apply_lora(model, targets=["q_proj"], rank=2, adapter_name="other")
    randomize(model)
    x = torch.randn(2, 5, H)
    assert not torch.allclose(model(x), ref(x))
    with disable_adapter(model):
        assert torch.equal(model(x), ref(x))
    assert not torch.allclose(model(x), ref(x))


def test_multiple_adapters_switch_delete_and_state_dict():
    model = Tiny()
    apply_lora(model, targets=["q_proj", "v_proj"], rank=4)
    apply_lora(model, targets=["q_proj"], rank=2, adapter_name="b")
    assert adapter_names(model) == ["default", "b"]
    randomize(model)
    x = torch.randn(2, 5, H)
    y_default = model(x)  # the first adapter stays active
    set_adapter(model, "b")
    y_b = model(x)
    assert model.layers[0].attn["v_proj"].active_adapter is None  # b does not target v_proj
    assert not torch.allclose(y_b, y_default)

    sd = adapter_state_dict(model, "b")
    assert set(sd) == {f"layers.{i}.attn.q_proj.{k}" for i in (0, 1) for k in ("lora_A", "lora_B")}
    assert adapter_config(model, "b")["rank"] == 2

    other = copy.deepcopy(model)
    delete_adapter(other, "b")
    assert adapter_names(other) == ["default"]
    apply_lora(other, targets=["q_proj"], rank=2, adapter_name="b2")
    load_adapter_state_dict(other, sd, "b2")
    set_adapter(other, "b2")
    torch.testing.assert_close(other(x), y_b)
    with pytest.raises(KeyError, match="missing keys"):
        load_adapter_state_dict(other, adapter_state_dict(model, "default"), "b2")


def test_per_example_routing_matches_single_adapter_runs():
    model = Tiny()
    apply_lora(model, targets="all-linear", rank=4, alpha=8)
    b_cfg = dict(targets=["q_proj", "up_proj"], rank=8, alpha=8, use_rslora=True, use_dora=True)
    apply_lora(model, adapter_name="b", **b_cfg)
    apply_lora(model, targets=["v_proj"], rank=2, adapter_name="c")
    randomize(model)
    names = adapter_names(model)
    x = torch.randn(5, 3, H)
    ids = torch.tensor([0, 1, 1, 2, 0])
    w = torch.randn(5, 3, 16)

    with route_adapters(model, ids):
        y = model(x)
    (y * w).sum().backward()
    routed = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    for b in range(5):  # each example alone, its adapter active
        set_adapter(model, names[ids[b]])
        yb = model(x[b : b + 1])
        torch.testing.assert_close(y[b : b + 1], yb, rtol=1e-5, atol=1e-6)
        (yb * w[b : b + 1]).sum().backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(routed[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)

    with route_adapters(model, ["default", "b", "b", "c", "default"]):  # by name
        torch.testing.assert_close(model(x), y)
    assert all(m.routing is None for _, m in lora_modules(model))
    with pytest.raises(ValueError, match="indices"):
        with route_adapters(model, [0, 3]):
            pass


# --- parity against peft -------------------------------------------------------------------------


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize(
    "targets,rslora,dora",
    [
        (["q_proj", "v_proj"], False, False),
        ("all-linear", True, False),
        (["q_proj", "v_proj", "down_proj"], False, True),
    ],
)
def test_parity_with_peft(targets, rslora, dora):
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    ours = copy.deepcopy(base)
    wrapped = apply_lora(ours, targets=targets, rank=4, alpha=8, use_rslora=rslora, use_dora=dora)
    randomize(ours, scale=0.2)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                          use_rslora=rslora, use_dora=dora)
    theirs = peft.get_peft_model(copy.deepcopy(base), cfg)
    inner = theirs.base_model.model
    assert sorted(wrapped) == sorted(n for n, m in inner.named_modules() if hasattr(m, "lora_A"))
    pairs = []  # (our parameter, peft's parameter)
    for name, m in lora_modules(ours):
        pm = inner.get_submodule(name)
        pairs += [(m.lora_A["default"], pm.lora_A["default"].weight)]
        pairs += [(m.lora_B["default"], pm.lora_B["default"].weight)]
        if dora:
            pairs += [(m.lora_magnitude["default"], pm.lora_magnitude_vector["default"].weight)]
    with torch.no_grad():
        for ours_p, peft_p in pairs:
            peft_p.copy_(ours_p)

    ids = torch.randint(0, 128, (2, 9))
    y_ours, y_peft = ours(ids).logits, theirs(input_ids=ids).logits
    torch.testing.assert_close(y_ours, y_peft, rtol=0, atol=1e-5)
    assert not torch.allclose(y_ours, base(ids).logits, atol=1e-3)  # the adapters matter
    F.cross_entropy(y_ours.flatten(0, 1), ids.flatten()).backward()
    F.cross_entropy(y_peft.flatten(0, 1), ids.flatten()).backward()
    for ours_p, peft_p in pairs:
        torch.testing.assert_close(ours_p.grad, peft_p.grad, rtol=1e-4, atol=1e-6)
    with disable_adapter(ours), theirs.disable_adapter():
        y_ours, y_peft = ours(ids).logits, theirs(input_ids=ids).logits
        torch.testing.assert_close(y_ours, y_peft, rtol=0, atol=1e-5)
        torch.testing.assert_close(y_ours, base(ids).logits, rtol=0, atol=1e-5)


# --- NF4 / QLoRA ---------------------------------------------------------------------------------


def test_nf4_table_and_nearest_code_error():
    assert NF4_CODE.shape == (16,) and NF4_CODE[0] == -1 and NF4_CODE[7] == 0 and NF4_CODE[15] == 1
    assert torch.all(NF4_CODE[1:] > NF4_CODE[:-1])
    w = torch.randn(48, 100)  # 4800 values: not a multiple of 64, the tail block is padded
    t = quantize_nf4(w)
    deq = dequantize_nf4(t)
    assert deq.shape == w.shape and deq.dtype == w.dtype
    # Every value maps to the code nearest to w / absmax of its block.
    flat = F.pad(w.flatten(), (0, -w.numel() % 64)).view(-1, 64)
    absmax = flat.abs().amax(1, keepdim=True)
    candidates = NF4_CODE[None, None, :] * absmax[..., None]  # (blocks, 1, 16)
    best = (flat[..., None] - candidates).abs().amin(-1).flatten()[: w.numel()].view_as(w)
    torch.testing.assert_close((deq - w).abs(), best, rtol=0, atol=1e-6)
    assert torch.equal(t.absmax, absmax.flatten())
    # Block maxima are exact (code +-1).
    i = w.abs().argmax()
    assert deq.flatten()[i] == w.flatten()[i]


def test_nf4_sizes_and_double_quant():
    w = torch.randn(256, 1024, dtype=torch.bfloat16)
    t, tdq = quantize_nf4(w), quantize_nf4(w, double_quant=True)
    assert t.packed.dtype == torch.uint8 and t.packed.numel() == w.numel() // 2
    assert t.bits_per_weight == pytest.approx(4.5)
    assert tdq.bits_per_weight == pytest.approx(4.127, abs=1e-3)
    assert tdq.nbytes < t.nbytes and tdq.absmax.dtype == torch.int8
    # Double quant error on the scales is at most half an int8 step of each 256-block's range.
    err = (tdq.block_absmax() - t.absmax).abs().view(-1, 256)
    assert torch.all(err <= tdq.absmax_scale[:, None] / 254 + 1e-6)
    diff = dequantize_nf4(tdq, torch.float32) - dequantize_nf4(t, torch.float32)
    rel = diff.norm() / w.float().norm()
    assert rel < 1e-2 and dequantize_nf4(tdq).dtype == torch.bfloat16


def test_nf4_module_buffers_keep_fp32_scales():
    mod = NF4Weight(quantize_nf4(torch.randn(64, 64), double_quant=True))
    assert set(dict(mod.named_buffers())) == {"packed", "absmax", "absmax_scale", "absmax_offset"}
    before = mod.dequantize()
    mod.to(torch.bfloat16)
    assert mod.absmax_scale.dtype == torch.float32 and torch.equal(mod.dequantize(), before)


@pytest.mark.parametrize("double_quant", [False, True])
def test_qlora_equals_lora_on_dequantized_weight(double_quant):
    base = nn.Linear(H, 48)
    q = LoRALinear(copy.deepcopy(base), quantize=True, double_quant=double_quant)
    assert isinstance(q.weight, NF4Weight) and q.quantized
    dense = nn.Linear(H, 48)
    with torch.no_grad():
        dense.weight.copy_(q.weight.dequantize()), dense.bias.copy_(base.bias)
    d = LoRALinear(dense)
    for lin in (q, d):
        lin.add_adapter("a", rank=4, alpha=8, use_dora=True)
    randomize(q), randomize(d)
    with torch.no_grad():
        d.lora_A["a"].copy_(q.lora_A["a"])
    x1 = torch.randn(3, 5, H, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    torch.testing.assert_close(q(x1), d(x2), rtol=1e-5, atol=1e-6)
    q(x1).square().sum().backward()
    d(x2).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for n in ("lora_A", "lora_B", "lora_magnitude"):
        q_grad, d_grad = getattr(q, n)["a"].grad, getattr(d, n)["a"].grad
        torch.testing.assert_close(q_grad, d_grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="NF4"):
        q.merge("a")


def test_nf4_linear_saves_no_dense_weight():
    t = quantize_nf4(torch.randn(128, 64))
    x = torch.randn(4, 64, requires_grad=True)
    saved = []
    pack = lambda s: saved.append(s.shape) or s  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        y = nf4_linear(x, t)
    assert (128, 64) not in saved
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 128) @ dequantize_nf4(t))


def test_qlora_apply_and_count():
    model = Tiny()
    apply_lora(model, targets="all-linear", rank=4, quantize_base="nf4")
    sd = model.state_dict()
    assert "layers.0.attn.q_proj.weight.packed" in sd and "layers.0.attn.q_proj.bias" in sd
    assert not model.lm_head.weight.requires_grad  # excluded head stays dense and frozen
    assert count_trainable(model)[1] == sum(p.numel() for p in Tiny().parameters()) + sum(
        p.numel() for p in lora_parameters(model)
    )
    x = torch.randn(2, 3, H)
    model(x).sum().backward()
    with pytest.raises(ValueError, match="quantize_base"):
        apply_lora(model, targets="all-linear", adapter_name="dense")


@pytest.mark.parametrize("shape,double_quant", [((64, 64), False), ((96, 64), True), ((40, 200), True),
                                                ((128, 48), False)])
def test_nf4_shards_dequantize_to_slices_of_the_whole_weight(shape, double_quant):
    """Tensor parallelism's cut of an NF4 weight (posttrain.core.quant.nf4_shard), by rows or columns into
    2 or 4: each part dequantizes to exactly its slice of the whole dequantized weight, also where
    the cut splits a 64-value block (the part's blocks are then smaller, under the same scale)."""
    from posttrain.core.quant import dequantize_nf4, nf4_shard, quantize_nf4

    t = quantize_nf4(torch.randn(shape, generator=torch.Generator().manual_seed(0)), double_quant=double_quant)
    whole = dequantize_nf4(t)
    for dim in (0, 1):
        for parts in (2, 4):
            for i in range(parts):
                assert torch.equal(dequantize_nf4(nf4_shard(t, dim, parts, i)), whole.chunk(parts, dim)[i])
    with pytest.raises(ValueError, match="cannot split"):
        nf4_shard(t, 0, 7, 0)
