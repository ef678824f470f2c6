"""Several LoRA adapters trained in one job: per-token routing on packed rows, the Trainer's
per-adapter groups, the data's routing column, and resume. References: each document run alone
with its adapter active (plain fp32 torch), and single-adapter models trained on only their
examples."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from posttrain.core.data.encode import Document
from posttrain.core.data.packing import collate_padding_free
from posttrain.core.lora import apply_lora, lora_parameters, route_adapters, set_adapter
from posttrain.core.model import build_model, get_preset
from posttrain.core.objectives import sft_objective
from posttrain.core.optim import OptimConfig
from posttrain.core.trainer import Trainer
from posttrain.stages.adapters import routed

NAMES = ["a", "b", "c"]


def model_with(names, seed=0, **lora):
    model = build_model(get_preset("debug"), seed=seed)
    torch.manual_seed(seed + 1)
    apply_lora(model, adapter_name=names, **{"rank": 4, "alpha": 8, **lora})
    with torch.no_grad():  # B starts at 0: give it values so every adapter changes the output
        for p in lora_parameters(model):
            if p.ndim == 2 and (p == 0).all():
                p.normal_(0, 0.05)
    return model


def docs_for(adapters, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, a in enumerate(adapters):
        n = 5 + (7 * i) % 11
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append(Document(ids, [-100] * 2 + ids[2:], a))
    return out


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_row_routes_each_document_to_its_adapter(checkpointing):
    """One (1, T) packed row of documents for a, b, c and one for none (-1): logits and gradients
    equal each document run alone with its adapter active (or with the adapters disabled)."""
    from posttrain.core.lora import disable_adapter
    from posttrain.core.parallel.data_parallel import apply_activation_checkpointing

    model = model_with(NAMES)
    docs = docs_for([0, 2, 1, None, 0, 1])
    batch = collate_padding_free(docs)
    assert batch["adapter_ids"].shape == batch["input_ids"].shape
    assert batch["sequence_adapters"].tolist() == [0, 2, 1, -1, 0, 1]
    ref = copy.deepcopy(model)
    if checkpointing:  # the recompute in backward must route as the forward did
        apply_activation_checkpointing(list(model.layers))
    w = torch.randn(batch["input_ids"].shape[1], 512, generator=torch.Generator().manual_seed(3))

    with route_adapters(model, batch["adapter_ids"], NAMES):
        logits = model(batch["input_ids"], batch["position_ids"])[0]
    (logits * w).sum().backward()

    start = 0
    for d in docs:
        n = len(d)
        ids = torch.tensor([d.input_ids])
        if d.adapter is None:
            with disable_adapter(ref):
                alone = ref(ids)[0]
        else:
            set_adapter(ref, NAMES[d.adapter])
            alone = ref(ids)[0]
        torch.testing.assert_close(logits[start:start + n], alone, rtol=1e-5, atol=1e-5)
        if d.adapter is not None:  # the base alone has no trainable part
            (alone * w[start:start + n]).sum().backward()
        start += n
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    for n, p in ref.named_parameters():
        if p.requires_grad:  # fp32, summed in another order (measured: <= 6e-7 of the largest entry, 2 threads)
            scale = float(p.grad.abs().max())
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5 * scale, msg=n)


def test_routing_refuses_unknown_ids_and_restores():
    model = model_with(["a", "b"])
    with pytest.raises(ValueError, match="indices"):
        with route_adapters(model, torch.tensor([[0, 2]])):
            pass
    with route_adapters(model, torch.tensor([[0, 1, -1]])):
        pass
    assert all(m.routing is None for m in model.modules() if hasattr(m, "routing"))


def _optim(**kw):
    return OptimConfig(**{"lr": 1e-2, "warmup_steps": 0, "schedule": "constant", "max_grad_norm": 0.5,
                          "weight_decay": 0.1, **kw})


def _capture(trainer):
    """The gradients the optimizer steps with (after normalization and clipping), by name."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    seen = {}
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: seen.update(
        {names[id(p)]: None if p.grad is None else p.grad.clone() for g in opt.param_groups for p in g["params"]}))
    return seen


def _lora_state(model, name):
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{name}" in n and "lora_" in n}


def test_each_adapter_trains_as_if_alone():
    """A step on a batch mixing a's and b's documents: each adapter's gradient (normalized by its
    own tokens, clipped alone) and update equal those of a model holding that adapter only, trained
    on only its documents, at its own learning rate (adapter_lr). Then a step whose documents all
    go to a leaves b exactly as it was (no gradient, no weight decay, no moment update)."""
    names = ["a", "b"]
    multi = model_with(names)
    trainer = Trainer(multi, _optim(), 4, adapters=names, adapter_lr={"b": 3e-2})
    assert [(g["adapter"], g["lr"]) for g in trainer.optimizer.param_groups] == [("a", 1e-2), ("b", 3e-2)]
    grads = _capture(trainer)
    docs = docs_for([0, 1, 1, 0, 1])
    objective = routed(sft_objective, names)
    for part in (docs[:3], docs[3:]):  # two micro-batches
        trainer.forward_backward(collate_padding_free(part), objective)
    metrics = trainer.optim_step()
    assert metrics["tokens"] == metrics["tokens/a"] + metrics["tokens/b"]

    for i, name in enumerate(names):
        alone = model_with(names)  # same init; then only `name` stays
        for other in names:
            if other != name:
                from posttrain.core.lora import delete_adapter

                delete_adapter(alone, other)
        set_adapter(alone, name)
        single = Trainer(alone, _optim(lr=[1e-2, 3e-2][i]), 4)
        single_grads = _capture(single)
        mine = [Document(d.input_ids, d.labels) for d in docs if d.adapter == i]
        single.forward_backward(collate_padding_free(mine), sft_objective)
        m = single.optim_step()
        assert m["tokens"] == metrics[f"tokens/{name}"]
        assert m["grad_norm"] == pytest.approx(metrics[f"grad_norm/{name}"], rel=1e-5)
        for n, g in single_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-7, msg=n)
        want = dict(alone.named_parameters())
        for n, p in multi.named_parameters():
            if n in want and p.requires_grad:
                torch.testing.assert_close(p, want[n], rtol=1e-5, atol=1e-6, msg=n)  # after an lr 3e-2 step

    b_before = _lora_state(multi, "b")
    b_moments = {n: trainer.optimizer.state[p]["exp_avg"].clone() for n, p in multi.named_parameters()
                 if ".b" in n and "lora_" in n}
    a_before = _lora_state(multi, "a")
    trainer.forward_backward(collate_padding_free(docs_for([0, 0], seed=5)), objective)
    metrics = trainer.optim_step()
    assert metrics["tokens/b"] == 0 and "grad_norm/b" not in metrics
    assert all(grads[n] is None for n in b_before)
    for n, v in _lora_state(multi, "b").items():
        assert torch.equal(v, b_before[n]), n
    for n, p in multi.named_parameters():
        if n in b_moments:
            assert torch.equal(trainer.optimizer.state[p]["exp_avg"], b_moments[n]), n
    assert any(not torch.equal(v, a_before[n]) for n, v in _lora_state(multi, "a").items())


def test_an_adapter_without_examples_yet_resumes_exactly(tmp_path):
    """The checkpoint of a run whose adapter b has had no example yet (the case that made the next
    run fail to resume) loads, and the resumed run ends bit-identical to an uninterrupted one."""
    from posttrain.core.checkpoint import CheckpointManager

    names = ["a", "b"]
    steps = [[0, 0], [0, 0], [1, 0, 1], [1, 1]]  # b's first examples come after the checkpoint

    def run(upto, resume_dir=None):
        model = model_with(names)
        trainer = Trainer(model, _optim(), len(steps), adapters=names)
        manager = CheckpointManager(tmp_path / "ck", trainable_only=True)
        if resume_dir:
            assert trainer.load_state(manager) is not None
        for k in range(trainer.step, upto):
            trainer.forward_backward(collate_padding_free(docs_for(steps[k], seed=k)), routed(sft_objective, names))
            trainer.optim_step()
            if k == 1:
                trainer.save_state(manager)
        manager.close()
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    full = run(len(steps))
    run(3)  # killed after step 3; its checkpoint is step 2's
    resumed = run(len(steps), resume_dir=True)
    for n, v in full.items():
        assert torch.equal(v, resumed[n]), n


def test_objective_needs_routed_batches():
    model = model_with(["a", "b"])
    trainer = Trainer(model, _optim(), 2, adapters=["a", "b"])
    with pytest.raises(ValueError, match="adapter_tokens"):
        trainer.forward_backward(collate_padding_free(docs_for([0])), sft_objective)
    with pytest.raises(ValueError, match="no adapter_ids"):
        routed(sft_objective, ["a", "b"])(model, collate_padding_free([Document([1, 2, 3], [-100, 2, 3])]))


# ------------------------------------------------------------------------------------------ data


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(i, adapter=None):
    r = {"prompt": f"what is {i}?", "completion": f"it is {i}."}
    return r if adapter is None else {**r, "adapter": adapter}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from posttrain.stages.data_prep import train_tokenizer

    return train_tokenizer([f"what is {i}? it is {i}." for i in range(50)], 300,
                           tmp_path_factory.mktemp("tok"))


def test_raw_rows_are_routed_by_column_or_source(tmp_path, tok):
    from posttrain.core.data import load_splits
    from posttrain.core.data.config import DataConfig
    from posttrain.core.data.routing import AdapterRouting

    mixed = _rows(tmp_path / "mixed.jsonl", [_row(i, "ab"[i % 2]) for i in range(10)])
    only_b = _rows(tmp_path / "b.jsonl", [_row(i) for i in range(10, 14)])
    routing = AdapterRouting(("a", "b"), "adapter", {"b": [str(only_b)]})
    cfg = DataConfig(sources=[str(mixed), str(only_b)], val_fraction=0.0)
    docs = load_splits(cfg.sources, "sft", ["train"], tok, cfg, routing=routing)["train"]
    assert [d.adapter for d in docs] == [i % 2 for i in range(10)] + [1] * 4
    batch = collate_padding_free(docs[:3])
    assert batch["adapter_ids"][0, :len(docs[0])].tolist() == [0] * len(docs[0])


@pytest.mark.parametrize("row,field,message", [
    (_row(3, "c"), "adapter", "string 'c' is not an adapter being trained"),
    (_row(3), "adapter", "missing: with several adapters"),
])
def test_a_bad_adapter_names_file_row_and_field(tmp_path, tok, row, field, message):
    from posttrain.core.data import DataError, load_splits
    from posttrain.core.data.config import DataConfig
    from posttrain.core.data.routing import AdapterRouting

    path = _rows(tmp_path / "bad.jsonl", [_row(1, "a"), _row(2, "b"), row])
    cfg = DataConfig(sources=[str(path)], val_fraction=0.0)
    with pytest.raises(DataError) as e:
        load_splits(cfg.sources, "sft", ["train"], tok, cfg, routing=AdapterRouting(("a", "b")))
    assert str(e.value).startswith(f"{path} line 3, field {field}: {message}")
    skip = cfg.model_copy(update={"on_bad_row": "skip"})
    assert len(load_splits(cfg.sources, "sft", ["train"], tok, skip, routing=AdapterRouting(("a", "b")))["train"]) == 2


def test_data_prep_keeps_the_adapter_column(tmp_path):
    """Data prep writes the routing column to its Parquet; a stage reading its output routes by it,
    and a row naming an unknown adapter fails naming the Parquet file, row and field."""
    import pyarrow.parquet as pq

    from posttrain.core.data import DataError, load_splits
    from posttrain.core.data.routing import AdapterRouting
    from posttrain.core.tracking import TrackingConfig
    from posttrain.stages.config import DataPrepConfig
    from posttrain.stages.data_prep import prepare

    src = _rows(tmp_path / "rows.jsonl", [_row(i, "ab"[i % 3 == 0]) for i in range(30)])
    prepare(DataPrepConfig(output_dir=str(tmp_path / "prep"), sources=[str(src)], synthetic_size=0,
                           val_fraction=0.0, test_fraction=0.0, tracking=TrackingConfig(enabled=False)))
    table = pq.read_table(tmp_path / "prep" / "data" / "sft_train.parquet").to_pylist()
    assert sorted(r["adapter"] for r in table) == sorted("ab"[i % 3 == 0] for i in range(30))
    docs = load_splits([str(tmp_path / "prep")], "sft", ["train"], routing=AdapterRouting(("a", "b")))["train"]
    assert [d.adapter for d in docs] == [int(r["adapter"] == "b") for r in table]
    with pytest.raises(DataError, match=r"sft_train.parquet row 0, field adapter: string '(a|b)' is not"):
        load_splits([str(tmp_path / "prep")], "sft", ["train"], routing=AdapterRouting(("x", "y")))
