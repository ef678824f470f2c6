"""posttrain.core.data.build_loader, the loader the training stages use: micro_batch_size counts sequences (packed
rows with packing, documents without), batch_tokens replaces it, packing on and off (and padded rows)
give different batch shapes but the same token-weighted loss, batches name their documents
(doc_indices), evaluation sees every document once with lockstep padding across ranks, and the
state resumes mid-epoch."""

from __future__ import annotations

import pytest
import torch
from tests.support.data_fixtures import data_config, make_tokenizer, sft_rows, write_jsonl

from posttrain.core.data import Document, build_loader, load_data
from posttrain.core.model import build_model, get_preset
from posttrain.core.objectives import sft_objective
from posttrain.stages.common import Dist

MAX_LEN = 64


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[Document]:
    path = write_jsonl(tmp_path_factory.mktemp("loader") / "s.jsonl", sft_rows(48, seed=3))
    return load_data(data_config([path], max_seq_len=MAX_LEN), make_tokenizer())["train"]


def cfg(**kw):
    return data_config([], max_seq_len=MAX_LEN, **kw)


def tokens_of(batch) -> list[int]:
    return batch["input_ids"][batch["attention_mask"] == 1].tolist() if "attention_mask" in batch \
        else batch["input_ids"][0].tolist()


def test_micro_batch_size_counts_sequences(docs):
    off = build_loader(docs, cfg(packing=False, micro_batch_size=5))
    batches = list(off)
    assert [len(b["doc_indices"]) for b in batches] == [5] * (len(docs) // 5) + [len(docs) % 5]
    for b in batches:  # one document per sequence, padding-free: (1, T) with a boundary per document
        assert b["input_ids"].shape == (1, sum(len(docs[i]) for i in b["doc_indices"]))
        assert len(b["cu_seqlens"]) == len(b["doc_indices"]) + 1
    on = build_loader(docs, cfg(packing=True, micro_batch_size=2))
    rows = on.groups
    assert all(sum(len(docs[i]) for i in row) <= MAX_LEN for row in rows) and max(map(len, rows)) > 1
    assert all(len(units) == 2 for units in on.sampler.batches(0)[:-1])  # 2 packed rows per micro step
    for units, b in zip(on.sampler.batches(0), on):
        assert b["doc_indices"] == [i for u in units for i in rows[u]]
        assert b["input_ids"].shape[1] <= 2 * MAX_LEN
    assert len(build_loader(docs, cfg(packing=True, micro_batch_size=5))) < len(off)  # more documents per step
    padded = next(iter(build_loader(docs, cfg(packing=False, micro_batch_size=5), padding_free=False)))
    assert padded["input_ids"].shape == (5, max(len(docs[i]) for i in padded["doc_indices"]))


def test_batch_tokens_replaces_micro_batch_size(docs):
    def batches(**kw):
        return [b["doc_indices"] for b in build_loader(docs, cfg(batch_tokens=3 * MAX_LEN, **kw))]

    assert batches(micro_batch_size=1) == batches(micro_batch_size=64)
    for b in build_loader(docs, cfg(batch_tokens=3 * MAX_LEN)):
        assert b["input_ids"].shape[1] <= 3 * MAX_LEN
    assert batches(micro_batch_size=1) != [b["doc_indices"] for b in build_loader(docs, cfg(micro_batch_size=1))]


def test_packing_on_and_off_give_other_shapes_but_the_same_loss(docs):
    torch.manual_seed(0)
    model = build_model(get_preset("debug"), seed=0).eval()
    layouts = {"packed": (cfg(packing=True, micro_batch_size=2), True),
               "one per sequence": (cfg(packing=False, micro_batch_size=3), True),
               "padded": (cfg(packing=False, micro_batch_size=3), False),
               "packed + padded": (cfg(packing=True, micro_batch_size=2), False)}
    losses, shapes = {}, {}
    with torch.no_grad():
        for name, (c, padding_free) in layouts.items():
            total = n = 0.0
            seen = []
            for b in build_loader(docs, c, padding_free=padding_free):
                out = sft_objective(model, b)
                total, n = total + float(out.loss_sum), n + float(out.num_tokens)
                seen += b["doc_indices"]
                assert tokens_of(b) == [t for i in b["doc_indices"] for t in docs[i].input_ids]
            assert sorted(seen) == list(range(len(docs)))  # every document once per epoch
            losses[name] = total / n
            shapes[name] = tuple(b["input_ids"].shape for b in build_loader(docs, c, padding_free=padding_free))
    assert len(set(shapes.values())) == len(shapes)
    ref = losses["packed"]
    assert all(abs(v - ref) < 1e-5 * ref for v in losses.values()), losses


@pytest.mark.parametrize("packing", [True, False])
def test_evaluation_sees_every_document_once_in_lockstep(docs, packing):
    c = cfg(packing=packing, micro_batch_size=3)
    loaders = [build_loader(docs, c, rank=r, world_size=4, evaluation=True, lockstep=True) for r in range(4)]
    per_rank = [list(loader) for loader in loaders]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(loaders[0])
    counted = [i for batches in per_rank for b in batches if not b.get("padding") for i in b["doc_indices"]]
    assert sorted(counted) == list(range(len(docs)))
    global_batches = len(loaders[0].sampler.global_batches(0))
    assert sum(b.get("padding", False) for batches in per_rank for b in batches) == -global_batches % 4
    # training: shuffled, and the ragged tail is dropped so ranks stay in lockstep
    train = [build_loader(docs, c, rank=r, world_size=4, num_epochs=1) for r in range(4)]
    assert len({len(t) for t in train}) == 1 and len(train[0]) == global_batches // 4
    assert [b["doc_indices"] for b in build_loader(docs, c)] != [b["doc_indices"] for b in
                                                              build_loader(docs, c, evaluation=True)]


def test_packed_loader_resumes_mid_epoch(docs):
    c = cfg(packing=True, micro_batch_size=2)
    full = [b["doc_indices"] for b in build_loader(docs, c, rank=1, world_size=2, num_epochs=2)]
    first = build_loader(docs, c, rank=1, world_size=2, num_epochs=2)
    it = iter(first)
    head = [next(it)["doc_indices"] for _ in range(3)]
    second = build_loader(docs, c, rank=1, world_size=2, num_epochs=2)
    second.load_state_dict(first.state_dict())
    assert head + [b["doc_indices"] for b in second] == full


def test_stage_doc_loader_honours_the_data_config(docs):
    from posttrain.stages.training import doc_loader

    cpu = Dist(0, 1, 0, torch.device("cpu"))
    loader = doc_loader(docs, cfg(packing=False, micro_batch_size=4), cpu, epochs=1)
    assert [len(b["doc_indices"]) for b in loader][:-1] == [4] * (len(loader) - 1)
    evaluation = doc_loader(docs, cfg(packing=True, micro_batch_size=2), cpu, epochs=1, evaluation=True)
    assert sorted(i for b in evaluation for i in b["doc_indices"]) == list(range(len(docs)))
