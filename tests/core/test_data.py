"""posttrain.core.data: sources, row validation messages, label masks, truncation, packing held to the model
(packed forward == separate forwards), preference batching, resumable sharded sampling, splits.

Tolerances: packed vs separate forwards run the same fp32 ops with a different attention mask
(block-diagonal vs causal), so they agree to ~1e-6; 1e-5 is the brief's bound.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from tests.support.data_fixtures import conv, data_config, make_tokenizer, sft_rows, write_jsonl, write_parquet

from posttrain.core import losses as L
from posttrain.core.data import (
    BatchSampler, DataError, Document, assign_split, build_loader, collate_padded, collate_padding_free,
    collate_preference, content_hash, detect_format, load_data, load_documents, pack, sequence_sums,
    split_key, validate_row,
)
from posttrain.core.model import build_model, get_preset

IGN = -100
F32 = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(get_preset("debug"), seed=0).eval()


def load(tmp_path, rows, tok, name="train.jsonl", **cfg):
    path = write_jsonl(tmp_path / name, rows)
    return load_data(data_config([path], **cfg), tok)


def runs(tok, doc: Document) -> list[str]:
    """Decoded runs of consecutive labelled tokens."""
    out, cur = [], []
    for t, lab in zip(doc.input_ids, doc.labels):
        if lab != IGN:
            assert lab == t
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out + ([tok.decode(cur)] if cur else [])


# --------------------------------------------------------------------------------------- sources


def test_jsonl_parquet_and_datasets_dir_give_the_same_documents(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    rows = sft_rows(12)
    # A message with an extra key in one row only: Parquet/Arrow fill it with null in all others,
    # which must read as absent (a None content or name would otherwise reach the template).
    rows[3]["messages"][0]["name"] = "alice"
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    parquet = write_parquet(tmp_path / "a.parquet", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    loaded = [load_data(data_config([p]), tok)["train"] for p in (jsonl, parquet, tmp_path / "saved")]
    assert len(loaded[0]) == 12
    assert loaded[0] == loaded[1] == loaded[2]
    both = load_data(data_config([jsonl, parquet]), tok)
    assert both["train"] == loaded[0] + loaded[1] and both.stats.kept == 24


def test_saved_dataset_dict_keeps_its_splits(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    rows = sft_rows(9)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:6]),
                          "validation": datasets.Dataset.from_list(rows[6:])}).save_to_disk(str(tmp_path / "dd"))
    data = load_data(data_config([tmp_path / "dd"], val_fraction=0.5), tok)
    assert len(data["train"]) == 6 and len(data["validation"]) == 3  # no hash split on top


@pytest.mark.parametrize("row, fmt, reply", [
    (conv("hi", "hello"), "messages", "hello"),
    ({"prompt": "2+2=", "completion": " 4"}, "prompt_completion", " 4"),
    ({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]},
     "prompt_completion", "yo"),
    ({"prompt": "q", "chosen": "a", "rejected": "b"}, "preference", None),
    ({"chosen": "q a", "rejected": "q b"}, "implicit_preference", None),
])
def test_formats_detected_and_labelled(tmp_path, tok, row, fmt, reply):
    assert detect_format(row.keys()) == fmt
    data = load(tmp_path, [row], tok)
    assert data.task == ("sft" if reply else "preference")
    if reply:
        (doc,) = data["train"]
        assert runs(tok, doc) == [reply + "<|im_end|>"]


def load_rows(path: str, format: str = "auto", on_bad_row: str = "error"):
    """Validated, untokenized rows (what data prep's first pass sees): (task, rows, drops)."""
    import dataclasses

    from posttrain.core.data import DropStats, for_each_example

    rows, stats = [], DropStats()
    task = for_each_example([path], format, on_bad_row, stats, lambda _, ex: rows.append(dataclasses.asdict(ex)))
    return task, rows, stats.dropped


def test_forced_format_reports_the_missing_field(tmp_path, tok):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "completion": "b"}])
    assert load_data(data_config([path], format="sft"), tok).task == "sft"  # still prompt/completion
    with pytest.raises(DataError, match=r"train.jsonl line 1, field chosen: missing"):
        load_data(data_config([path], format="preference"), tok)
    write_parquet(tmp_path / "t.parquet", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=r"t.parquet row 0, field messages: missing"):
        load_rows(str(tmp_path / "t.parquet"), format="messages")  # the finer format names work here


def test_mixed_tasks_and_unknown_sources_are_refused(tmp_path, tok):
    sft = write_jsonl(tmp_path / "sft.jsonl", [conv("a", "b")])
    pref = write_jsonl(tmp_path / "pref.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(DataError, match=r"pref.jsonl: holds preference rows but .*sft.jsonl holds sft"):
        load_data(data_config([sft, pref]), tok)
    with pytest.raises(DataError, match=r"nope.jsonl: does not exist"):
        load_data(data_config([tmp_path / "nope.jsonl"]), tok)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"x.csv: unsupported file type"):
        load_data(data_config([tmp_path / "x.csv"]), tok)


# -------------------------------------------------------------------------------------- bad rows

GOOD = conv("what is two plus two", "four")
BAD_ROWS = [  # (line 17 of train.jsonl, expected message after "train.jsonl line 17", reason)
    ('{"messages": [', ": invalid JSON (Expecting value at column 15)", "invalid_json"),
    ("[1, 2]", ": expected a JSON object with the fields of format 'messages', got array [1, 2]", "not_an_object"),
    ({"msgs": []}, ", field messages: missing (the row has fields: msgs)", "missing_field"),
    ({"messages": "hi"}, ", field messages: expected a list of messages, got string 'hi'", "wrong_type"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]},
     ", field messages[1].content: expected a string, got integer 5", "wrong_type"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]},
     ", field messages[1].content: missing", "missing_field"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "bot", "content": "x"}]},
     ", field messages[2].role: expected one of system/user/assistant/tool, got 'bot'", "unknown_role"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "assistant", "content": "b"}]},
     ", field messages[2].role: 'assistant' cannot follow 'assistant'", "role_order"),
    ({"messages": [{"role": "assistant", "content": "a"}]},
     ", field messages[0].role: 'assistant' cannot start a conversation", "role_order"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "q2"}]},
     ", field messages[2].role: must end with an assistant turn", "role_order"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
     ", field messages[1].content: empty assistant reply", "empty_content"),
    ('{"messages": [{"role": "user", "content": "\\ud800x"}, {"role": "assistant", "content": "a"}]}',
     ", field messages[0].content: lone surrogate '\\ud800' at character 0", "invalid_unicode"),
    (conv("word " * 200, "four"),
     ", field messages: 811 tokens > max_seq_len=128, and truncation='right' leaves no trained tokens",
     "too_long"),
]


@pytest.mark.parametrize("bad, message, reason", BAD_ROWS, ids=[r for *_, r in BAD_ROWS])
def test_bad_row_named_by_file_line_and_field_or_counted(tmp_path, tok, bad, message, reason):
    rows = [GOOD] * 16 + [bad] + [GOOD] * 3
    with pytest.raises(DataError) as info:
        load(tmp_path, rows, tok)
    assert "train.jsonl line 17" + message in str(info.value)
    assert info.value.row == 17 and info.value.reason == reason
    data = load(tmp_path, rows, tok, on_bad_row="skip")
    assert data.stats.kept == 19 and dict(data.stats.dropped) == {reason: 1}
    assert len(data["train"]) == 19 and "line 17" in data.stats.examples[reason][0]


def test_undecodable_bytes_and_template_errors(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"messages": "\xff"}\n')
    with pytest.raises(DataError, match=r"train.jsonl line 2: not UTF-8 at byte 14"):
        load_data(data_config([path]), tok)
    template = "{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom') }}{% endif %}" \
               "{{ m['content'] }}{% endfor %}"
    rows = [GOOD, conv("boom", "x")]
    with pytest.raises(DataError, match=r"line 2, field messages: tokenizing failed: ChatTemplateError.*no boom"):
        load(tmp_path, rows, tok, chat_template=template)


@pytest.mark.parametrize("bad, message, reason", [
    ({"prompt": "q", "completion": ""}, "field completion: empty completion", "empty_content"),
    ({"prompt": "q", "completion": ["a"]}, "field completion: expected a string (the prompt is a string)",
     "wrong_type"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "completion": "b"},
     "field prompt[1].role: a prompt must end with a user or tool turn", "role_order"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "b"}]},
     "field completion[0].role: 'user' cannot follow 'user'", "role_order"),
])
def test_prompt_completion_bad_rows(tmp_path, tok, bad, message, reason):
    with pytest.raises(DataError, match="line 2, " + re.escape(message)):
        load(tmp_path, [{"prompt": "q", "completion": "a"}, bad], tok)
    assert dict(load(tmp_path, [{"prompt": "q", "completion": "a"}, bad], tok, on_bad_row="skip").stats.dropped) \
        == {reason: 1}


def test_bad_rows_in_tables_are_named_by_row_index(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    rows = [GOOD] * 3 + [{"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}]
    write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(DataError, match=r"d.parquet row 3, field messages\[1\].role: expected one of"):
        load_data(data_config([tmp_path / "d.parquet"]), tok)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"saved row 3, field messages\[1\].role"):
        load_data(data_config([tmp_path / "saved"]), tok)


def test_unknown_format_and_all_rows_bad(tmp_path, tok):
    with pytest.raises(DataError, match=r"train.jsonl line 1: cannot tell the format from fields \['foo'\]"):
        load(tmp_path, [{"foo": 1}], tok)
    with pytest.raises(DataError, match=r"no usable rows in .*train.jsonl \(kept 0, dropped 2 "):
        load(tmp_path, [{"foo": 1}, "nope"], tok, on_bad_row="skip")


@pytest.mark.parametrize("content", [b"", b"\n\n  \n", b"\xef\xbb\xbf\n"])
def test_empty_files_are_refused_by_name(tmp_path, tok, content):
    (tmp_path / "empty.jsonl").write_bytes(content)
    for mode in ("error", "skip"):
        with pytest.raises(DataError, match=r"no usable rows in .*empty.jsonl \(kept 0, dropped 0\)"):
            load_data(data_config([tmp_path / "empty.jsonl"], on_bad_row=mode), tok)


def test_dedup_counts_duplicates(tmp_path, tok):
    rows = [GOOD, conv("what is two plus two ", "four"), conv("x", "y")]  # whitespace-only variant
    assert load(tmp_path, rows, tok).stats.kept == 3
    data = load(tmp_path, rows, tok, dedup=True)
    assert data.stats.kept == 2 and dict(data.stats.dropped) == {"duplicate": 1}


# ---------------------------------------------------------------------------- labels, truncation


def test_labels_cover_exactly_the_assistant_replies(tmp_path, tok):
    row = conv("what is two", "four", "and blue", "red 🤖", system="be brief")
    (doc,) = load(tmp_path, [row], tok)["train"]
    assert runs(tok, doc) == ["four<|im_end|>", "red 🤖<|im_end|>"]
    assert doc.input_ids == tok.apply_chat_template(row["messages"])
    (all_doc,) = load(tmp_path, [row], tok, mask_prompt=False)["train"]
    assert all_doc.labels == all_doc.input_ids == doc.input_ids


def test_prompt_completion_strings_train_the_completion_and_eos(tmp_path, tok):
    (doc,) = load(tmp_path, [{"prompt": "what is two plus two", "completion": " four"}], tok)["train"]
    assert runs(tok, doc) == [" four<|im_end|>"] and doc.input_ids[-1] == tok.eos_id


def _long_conv():
    return conv("the model " * 20, "blue red " * 5, "what is " * 20, "two plus four " * 4)


def test_truncation_right_and_left(tmp_path, tok):
    (full,) = load(tmp_path, [_long_conv()], tok, max_seq_len=512)["train"]
    n = 64
    assert len(full) > n
    (right,) = load(tmp_path, [_long_conv()], tok, max_seq_len=n, truncation="right")["train"]
    assert right.input_ids == full.input_ids[:n] and right.labels == full.labels[:n]
    (left,) = load(tmp_path, [_long_conv()], tok, max_seq_len=n, truncation="left")["train"]
    assert left.input_ids == full.input_ids[-n:] and left.labels == full.labels[-n:]
    assert runs(tok, left)[-1] == runs(tok, full)[-1] == "two plus four " * 4 + "<|im_end|>"


def test_truncation_drop_and_impossible_left(tmp_path, tok):
    rows = [GOOD, _long_conv()]
    data = load(tmp_path, rows, tok, max_seq_len=64, truncation="drop")  # counted even in error mode
    assert data.stats.kept == 1 and dict(data.stats.dropped) == {"too_long": 1}
    with pytest.raises(DataError, match=r"line 2, field messages: .* truncation='left' keeps the final completion"):
        load(tmp_path, rows, tok, max_seq_len=12, truncation="left")
    assert load(tmp_path, rows, tok, max_seq_len=12, truncation="left", on_bad_row="skip").stats.dropped["too_long"]


def test_preference_rows_and_truncation(tmp_path, tok):
    prompt = [{"role": "user", "content": "what is two plus two " * 6}]
    explicit = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "four"}],
                "rejected": [{"role": "assistant", "content": "blue red blue"}]}
    implicit = {"chosen": prompt + explicit["chosen"], "rejected": prompt + explicit["rejected"]}
    (a,) = load(tmp_path, [explicit], tok)["train"]
    (b,) = load(tmp_path, [implicit], tok)["train"]
    assert a == b
    assert a.chosen.input_ids == tok.apply_chat_template(implicit["chosen"])
    assert runs(tok, a.rejected) == ["blue red blue<|im_end|>"] and runs(tok, a.chosen) == ["four<|im_end|>"]
    n = len(a.prompt_ids)  # room for the prompt and a few completion tokens
    (r,) = load(tmp_path, [explicit], tok, max_seq_len=n + 2, truncation="right")["train"]
    assert r.prompt_ids == a.prompt_ids and r.rejected_ids == a.rejected_ids[:2]
    (l,) = load(tmp_path, [explicit], tok, max_seq_len=n, truncation="left")["train"]
    assert l.rejected_ids == a.rejected_ids and len(l.rejected.input_ids) == n
    assert l.prompt_ids == a.prompt_ids[len(a.prompt_ids) + len(a.rejected_ids) - n:]
    (s,) = load(tmp_path, [{"chosen": "Q: blue? A: yes", "rejected": "Q: blue? A: no"}], tok)["train"]
    assert tok.decode(s.prompt_ids) == "Q: blue? A:" and runs(tok, s.chosen) == [" yes<|im_end|>"]


# ---------------------------------------------------------------------------------------- packing


def test_pack_strategies():
    assert pack([6, 5, 4, 3, 2], 10, "ffd") == [[0, 2], [1, 3, 4]]
    assert pack([6, 5, 4, 3, 2], 10, "greedy") == [[0], [1, 2], [3, 4]]
    with pytest.raises(ValueError, match="document 1 has 11 tokens"):
        pack([3, 11], 10)


def _docs(tmp_path, tok, n=5, mask_prompt=True):
    return load(tmp_path, sft_rows(n, seed=1), tok, mask_prompt=mask_prompt)["train"]


def test_padding_free_batch_layout(tmp_path, tok):
    docs = _docs(tmp_path, tok, mask_prompt=False)  # every label set: the boundary must be forced
    b = collate_padding_free(docs)
    lens = [len(d) for d in docs]
    starts = torch.tensor([0] + lens).cumsum(0)
    assert b["input_ids"].shape == (1, sum(lens)) and b["cu_seqlens"].dtype == torch.int32
    assert b["cu_seqlens"].tolist() == starts.tolist() and b["max_seqlen"] == max(lens)
    assert b["position_ids"][0].tolist() == [p for n in lens for p in range(n)]
    assert all(b["labels"][0, s] == IGN for s in starts[:-1].tolist())  # no cross-document target
    assert b["num_target_tokens"] == sum(n - 1 for n in lens) == L.num_target_tokens(b["labels"]).item()


def test_packed_forward_equals_separate_forwards(tmp_path, tok, model):
    docs = _docs(tmp_path, tok)
    with torch.no_grad():
        alone = [model(torch.tensor([d.input_ids]))[0] for d in docs]
        b = collate_padding_free(docs)
        packed = model(b["input_ids"], position_ids=b["position_ids"])[0]
        cu = b["cu_seqlens"].tolist()
        for i, logits in enumerate(alone):
            torch.testing.assert_close(packed[cu[i]:cu[i + 1]], logits, **F32)
        # padded: two packed rows, the second shorter, right-padded
        rows = [[0, 1, 2], [3, 4]]
        p = collate_padded([[docs[i] for i in row] for row in rows], pad_id=tok.pad_id)
        out = model(p["input_ids"], position_ids=p["position_ids"], attention_mask=p["attention_mask"])
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                torch.testing.assert_close(out[r, start:start + len(docs[i])], alone[i], **F32)
                start += len(docs[i])
        assert p["attention_mask"].sum() == sum(len(d) for d in docs)
        # cu_seqlens over the flattened (B*L) tokens marks exactly the position resets, pads included
        starts = (p["position_ids"].flatten() == 0).nonzero().flatten()
        assert p["cu_seqlens"][:-1].tolist() == starts.tolist() and p["cu_seqlens"][-1] == p["input_ids"].numel()
        assert (p["labels"][p["attention_mask"] == 0] == IGN).all()


def test_packed_loss_equals_token_weighted_loss_of_documents(tmp_path, tok, model):
    docs = _docs(tmp_path, tok, mask_prompt=False)
    w = model.output_weight
    with torch.no_grad():
        b = collate_padding_free(docs)
        h = model.hidden_states(b["input_ids"], position_ids=b["position_ids"])
        packed = L.chunked_cross_entropy(h, w, b["labels"], reduction="sum", chunk_size=64) / b["num_target_tokens"]
        sums, count = 0.0, 0
        for d in docs:
            labels = torch.tensor([d.labels])
            h = model.hidden_states(torch.tensor([d.input_ids]))
            sums += L.chunked_cross_entropy(h, w, labels, reduction="sum")
            count += L.num_target_tokens(labels).item()
        torch.testing.assert_close(packed, sums / count, **F32)
        # the test has teeth: concatenated labels without the forced -100 score across boundaries
        naive = torch.tensor([[t for d in docs for t in d.labels]])
        assert L.num_target_tokens(naive).item() == count + len(docs) - 1


def test_preference_batch_gives_per_sequence_logps_of_separate_forwards(tmp_path, tok, model):
    rows = [{"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": c}],
             "rejected": [{"role": "assistant", "content": r}]}
            for q, c, r in [("what is two plus two", "four", "blue"), ("red?", "red is red", "no"),
                            ("question", "the answer is 42", "the model")]]
    pairs = load(tmp_path, rows, tok)["train"]
    with torch.no_grad():
        want = torch.stack([L.sequence_logps(model(torch.tensor([d.input_ids])), torch.tensor([d.labels]))[0]
                            for d in [p.chosen for p in pairs] + [p.rejected for p in pairs]])
        for padding_free in (True, False):
            b = collate_preference(pairs, padding_free=padding_free, pad_id=tok.pad_id)
            n = b["num_pairs"]
            kw = {} if padding_free else {"attention_mask": b["attention_mask"]}
            logits = model(b["input_ids"], position_ids=b["position_ids"], **kw)
            got = sequence_sums(L.token_logps(logits, b["labels"]), b["sequence_ids"], 2 * n)
            torch.testing.assert_close(got, want, **F32)  # chosen 0..n-1, then rejected
    assert (want < 0).all() and n == 3


# --------------------------------------------------------------------------------------- sampling


def _lengths(n=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 100, (n,), generator=g).tolist()


@pytest.mark.parametrize("budget", [{"micro_batch_size": 4}, {"batch_tokens": 150}])
@pytest.mark.parametrize("k", [0, 3, 5, 9, 14])
def test_sampler_resumes_exactly(budget, k):
    make = lambda: BatchSampler(_lengths(), rank=1, world_size=2, seed=7, num_epochs=3, **budget)
    full = list(make())
    s = make()
    it = iter(s)
    head = [next(it) for _ in range(k)]
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(s.state_dict())))  # states survive JSON
    assert head + list(resumed) == full
    assert len(full) == 3 * len(s) and full[: len(s)] != full[len(s): 2 * len(s)]  # reshuffled per epoch


@pytest.mark.parametrize("budget", [{"micro_batch_size": 3}, {"batch_tokens": 120}])
def test_rank_shards_cover_every_batch_once(budget):
    lengths = _lengths()
    ref = BatchSampler(lengths, seed=3, **budget)
    every = ref.global_batches(0)
    shards = [list(BatchSampler(lengths, rank=r, world_size=3, seed=3, drop_last=False, **budget)) for r in range(3)]
    assert sorted(b for s in shards for b in s) == sorted(every)
    assert sorted(i for b in every for i in b) == list(range(len(lengths)))
    even = [list(BatchSampler(lengths, rank=r, world_size=3, seed=3, **budget)) for r in range(3)]
    assert len({len(s) for s in even}) == 1 and len(every) - 3 < 3 * len(even[0]) <= len(every)
    if "batch_tokens" in budget:
        assert all(sum(lengths[i] for i in b) <= 120 or len(b) == 1 for b in every)


def test_sampler_resume_on_another_world_size_and_guards():
    lengths = _lengths()
    every = BatchSampler(lengths, micro_batch_size=2, seed=1).global_batches(0)
    old = [BatchSampler(lengths, micro_batch_size=2, rank=r, world_size=2, seed=1) for r in range(2)]
    for s in old:
        it = iter(s)
        [next(it) for _ in range(3)]  # 6 global batches consumed
    for r in range(3):
        new = BatchSampler(lengths, micro_batch_size=2, rank=r, world_size=3, seed=1)
        new.load_state_dict(old[r % 2].state_dict())
        assert next(iter(new)) == every[6 + r]
    with pytest.raises(ValueError, match="other data or another seed"):
        BatchSampler(lengths[:-1], micro_batch_size=2, seed=1).load_state_dict(old[0].state_dict())


def test_loader_resumes_with_identical_tensors(tmp_path, tok):
    rows = sft_rows(40, seed=2)
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = data_config([path], max_seq_len=96, micro_batch_size=2)
    data = load_data(cfg, tok)

    def loader(**kw):
        return build_loader(data, cfg, rank=0, world_size=2, num_epochs=2, **kw)

    full = list(loader())
    first = loader()
    it = iter(first)
    for _ in range(5):
        next(it)
    second = loader()
    second.load_state_dict(first.state_dict())
    rest = list(second)
    assert len(rest) == len(full) - 5
    for a, b in zip(rest, full[5:]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                                            for k in a)
    padded = next(iter(loader(padding_free=False)))
    assert padded["input_ids"].shape[0] == 2 and padded["input_ids"].shape[1] <= 96
    assert set(full[0]) >= {"input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "num_target_tokens"}
    assert all(b["input_ids"].shape[1] <= 2 * 96 for b in full)  # two packed rows of <= max_seq_len


# ----------------------------------------------------------------------------------------- splits


def test_hash_split_is_stable_when_rows_are_added(tmp_path, tok):
    rows = sft_rows(600, seed=4)
    split = lambda r: assign_split(split_key(validate_row(r, "messages")), 0.1, 0.1)
    before = [split(r) for r in rows[:300]]
    assert [split(r) for r in rows][:300] == before
    counts = {s: before.count(s) for s in ("train", "validation", "test")}
    assert 15 <= counts["validation"] <= 45 and 15 <= counts["test"] <= 45
    spaced = {"messages": [dict(m, content=" " + m["content"] + "\n") for m in rows[0]["messages"]]}
    assert content_hash(spaced) == content_hash(rows[0])
    data = load(tmp_path, rows[:300], tok, val_fraction=0.1, test_fraction=0.1)
    assert [len(data[s]) for s in ("train", "validation", "test")] == [before.count(s) for s in
                                                                         ("train", "validation", "test")]


def test_rows_sharing_a_prompt_share_a_split(tmp_path, tok):
    rows = [{"prompt": f"question {i}", "chosen": f"yes {i}", "rejected": f"no {j}"}
            for i in range(60) for j in range(2)]
    data = load(tmp_path, rows, tok, val_fraction=0.3)
    assert 10 <= len(data["validation"]) <= 60 and len(data["train"]) + len(data["validation"]) == 120
    for name, split in data.splits.items():
        prompts = {tok.decode(p.prompt_ids) for p in split}
        assert len(split) == 2 * len(prompts)  # both pairs of every prompt, never one per split


def test_load_rows_and_load_documents(tmp_path, tok):
    rows = [{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
             "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}, "bad"]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    task, got, drops = load_rows(str(path), on_bad_row="skip")
    assert task == "preference" and dict(drops) == {"invalid_json": 1}
    assert got == [{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
                    "rejected": [{"role": "assistant", "content": "b"}]}]
    # load_documents (the stages' reader, raw sources or data prep's output) gives one split each
    source, cfg = [str(write_jsonl(tmp_path / "s.jsonl", sft_rows(30)))], data_config([], val_fraction=0.5)
    docs = {s: load_documents(source, s, tok, cfg) for s in ("train", "validation", "test")}
    assert sum(map(len, docs.values())) == 30 and all(isinstance(d, Document) for v in docs.values() for d in v)
    assert docs["train"] and docs["validation"] and not docs["test"]
