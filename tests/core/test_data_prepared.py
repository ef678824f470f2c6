"""Data prep through posttrain.core.data's one path: the labels the Encoder computes survive Parquet into what the
stages train on, one split function and one set of split names, and every DataPrepConfig field
(dedup, min/max tokens, on_bad_row, format, synthetic suite, tokenizer) still does its job."""

from __future__ import annotations

import json

import pytest
import torch
from tests.support.data_fixtures import conv, make_tokenizer, sft_rows, write_jsonl, write_parquet

from posttrain.core.data.config import DataConfig
from posttrain.core.tracking import TrackingConfig
from posttrain.stages.config import DataPrepConfig, DPOConfig
from posttrain.core.data import (DataError, Encoder, collate_preference, load_data, read_documents, read_pairs,
                       read_rows, validate_row)
from posttrain.core.losses import IGNORE_INDEX
from posttrain.stages.common import Dist
from posttrain.stages.data_prep import prepare

OFF = TrackingConfig(enabled=False)
CPU = Dist(0, 1, 0, torch.device("cpu"))
PROMPT = [{"role": "user", "content": "what is two plus two"}]
PREF = {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "four"}],
        "rejected": [{"role": "assistant", "content": "blue red"}]}
SFT = conv("what is two plus two", "four")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    make_tokenizer().save_pretrained(path)
    return str(path)


def run_prep(tmp_path, sources, tok_dir, name="prep", **kw):
    kw.setdefault("val_fraction", 0.0)
    kw.setdefault("test_fraction", 0.0)
    out = tmp_path / name
    return out, prepare(DataPrepConfig(output_dir=str(out), sources=[str(s) for s in sources], synthetic_size=0,
                                       tokenizer=tok_dir, tracking=OFF, **kw))


def test_encoder_labels_survive_parquet_into_the_stages_batches(tmp_path, tok_dir):
    from posttrain.core.data import load_pairs
    from posttrain.stages.training import doc_loader, pair_loader, sft_documents

    tok = make_tokenizer()
    srcs = [write_jsonl(tmp_path / "sft.jsonl", [SFT]), write_jsonl(tmp_path / "pref.jsonl", [PREF])]
    out, manifest = run_prep(tmp_path, srcs, tok_dir)
    assert set(manifest["outputs"]) == {"tokenizer", "sft_train", "preference_train"}
    assert manifest["metrics"]["rows/sft_train"] == manifest["metrics"]["rows/preference_train"] == 1

    encoder = Encoder(tok, 2048, "drop")  # data prep's: max_tokens, over-long rows dropped
    want_doc, want_pair = encoder(validate_row(SFT, "messages")), encoder(validate_row(PREF, "preference"))
    # ChatML renders "\n" after <|im_end|>: inside the completion, never trained. Labels != ids.
    for ids, labels in ((want_pair.chosen_ids, want_pair.chosen_labels), (want_doc.input_ids, want_doc.labels)):
        assert tok.decode(ids[-2:]) == "<|im_end|>\n" and labels[-2:] == [ids[-2], IGNORE_INDEX]
    assert want_pair.chosen_labels != want_pair.chosen_ids and want_pair.rejected_labels != want_pair.rejected_ids

    (doc,) = sft_documents([str(out)], "train", tok, DataConfig(max_seq_len=128))
    ((pair, row),) = load_pairs([str(out)], "train")
    assert doc == want_doc and pair == want_pair
    assert row["prompt"] == PROMPT and row["chosen_labels"] == want_pair.chosen_labels  # the row keeps its fields

    (batch,) = list(pair_loader([pair], DPOConfig(tracking=OFF), CPU, epochs=1))
    assert torch.equal(batch["labels"], collate_preference([want_pair])["labels"])
    (batch,) = list(doc_loader([doc], DataConfig(max_seq_len=128), CPU, epochs=1))
    assert batch["labels"][0].tolist() == [IGNORE_INDEX] + want_doc.labels[1:]


def test_one_split_function_and_one_set_of_split_names(tmp_path, tok_dir):
    rows = sft_rows(80, seed=5)
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    out, manifest = run_prep(tmp_path, [path], tok_dir, val_fraction=0.3, test_fraction=0.2, dedup=False)
    assert {k for k in manifest["outputs"] if k != "tokenizer"} == {"sft_train", "sft_validation", "sft_test"}
    assert {k for k in manifest["metrics"] if k.startswith("rows/")} == \
        {"rows/sft_train", "rows/sft_validation", "rows/sft_test"}
    loaded = load_data(DataConfig(sources=[str(path)], val_fraction=0.3, test_fraction=0.2, max_seq_len=2048),
                       make_tokenizer())
    for split in ("train", "validation", "test"):  # the same rows, documents and labels as posttrain.core.data
        assert read_documents(out, split) == loaded[split] and loaded[split]
    for other in ("dev", "val"):  # one spelling: "validation"
        with pytest.raises(ValueError, match=f"unknown split '{other}'"):
            read_documents(out, other)
    with pytest.raises(DataError, match="data prep produced no preference data"):
        read_pairs(out, "train")


def test_dedup_length_filters_and_bad_rows_are_counted(tmp_path, tok_dir):
    tok = make_tokenizer()
    short, long_ = conv("a", "b"), conv("the model " * 40, "blue red " * 20)
    n_short, n_long = (len(tok.apply_chat_template(r["messages"])) for r in (short, long_))
    rows = [SFT, conv(" what is two plus two", "four "), "{not json", short, long_, conv("red blue red", "blue red")]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    kw = dict(min_tokens=n_short + 1, max_tokens=n_long - 1)
    _, m = run_prep(tmp_path, [path], tok_dir, on_bad_row="skip", **kw)
    assert {k: v for k, v in m["metrics"].items() if k.startswith("dropped/")} == {
        "dropped/sft:duplicate": 1, "dropped/sft:invalid_json": 1, "dropped/sft:too_short": 1,
        "dropped/sft:too_long": 1}
    assert m["metrics"]["rows/sft_train"] == 2 and m["drops"] == {k[8:]: v for k, v in m["metrics"].items()
                                                                  if k.startswith("dropped/")}
    assert m["metrics"]["tokens/sft_max"] <= n_long - 1
    _, m = run_prep(tmp_path, [path], tok_dir, name="nodedup", on_bad_row="skip", dedup=False, **kw)
    assert m["metrics"]["rows/sft_train"] == 3 and "dropped/sft:duplicate" not in m["metrics"]
    with pytest.raises(DataError, match=r"s.jsonl line 3: invalid JSON"):
        run_prep(tmp_path, [path], tok_dir, name="strict")
    with pytest.raises(DataError, match=r"s.jsonl line 1, field prompt: missing"):
        run_prep(tmp_path, [path], tok_dir, name="forced", format="preference")


def test_synthetic_suite_and_trained_tokenizer(tmp_path):
    def prep(name, **kw):
        out = tmp_path / name
        return out, prepare(DataPrepConfig(output_dir=str(out), synthetic_size=100, synthetic_tasks=["sort", "max"],
                                           vocab_size=300, tracking=OFF, **kw))

    out, m = prep("a", synthetic_seed=3)
    assert m["metrics"]["vocab_size"] <= 300
    rows = read_rows(out, "sft", "train")
    assert {r["task"] for r in rows} == {"sort", "max"} and all(r["answer"] for r in rows)
    pairs = read_pairs(out, "validation")
    assert pairs and all(r["task"] in ("sort", "max") and p.chosen_labels[-1] == IGNORE_INDEX for p, r in pairs)
    again, _ = prep("b", synthetic_seed=3)
    other, _ = prep("c", synthetic_seed=4)
    assert read_rows(again, "sft", "train") == rows != read_rows(other, "sft", "train")


def test_reader_refuses_parquet_without_labels(tmp_path):
    old = write_parquet(tmp_path / "preference_train.parquet",
                        [{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}])
    with pytest.raises(DataError, match="no chosen_labels, rejected_labels column"):
        read_pairs(old, "train")
    (tmp_path / "manifest.json").write_text(json.dumps({"outputs": {"sft_train": "x.parquet"}}))
    assert read_documents(tmp_path, "test") == []  # prepared, but the split has no rows


def test_raw_sources_are_read_by_the_same_api(tmp_path):
    from posttrain.core.data import load_documents, load_pairs

    tok, cfg = make_tokenizer(), DataConfig(val_fraction=0.0, max_seq_len=2048)
    pref = write_jsonl(tmp_path / "pref.jsonl", [PREF])
    ((pair, row),) = load_pairs([pref], "train", tok, cfg)
    assert pair == Encoder(tok, 2048)(validate_row(PREF, "preference")) and row["chosen_labels"] == pair.chosen_labels
    with pytest.raises(DataError, match="holds preference rows; this stage needs sft rows"):
        load_documents([pref], "train", tok, cfg)
    with pytest.raises(DataError, match="needs a tokenizer and a DataConfig"):
        load_pairs([pref], "train")


def test_the_stages_data_settings_apply_to_prepared_data(tmp_path, tok_dir):
    """data.mask_prompt, truncation and max_seq_len act on data prep's output as on raw rows (the
    stage reads stored tokens: the same Encoder rules, posttrain.core.data.encode.truncate); chat_template,
    which would need re-rendering, is refused with the setting to use instead."""
    tok = make_tokenizer()
    long = conv("the model " * 30, "four")
    out, _ = run_prep(tmp_path, [write_jsonl(tmp_path / "s.jsonl", [SFT, long])], tok_dir, name="sft")
    stored = read_documents(out, "train")
    raw = load_data(DataConfig(sources=[str(tmp_path / "s.jsonl")], val_fraction=0.0, max_seq_len=40,
                               truncation="left"), tok)["train"]
    for truncation, mask_prompt in (("left", True), ("right", True), ("drop", True), ("right", False)):
        cfg = DataConfig(max_seq_len=40, truncation=truncation, mask_prompt=mask_prompt, on_bad_row="skip")
        docs = read_documents(out, "train", cfg)
        want = load_data(cfg.model_copy(update={"sources": [str(tmp_path / "s.jsonl")], "val_fraction": 0.0}),
                         tok)["train"]
        assert docs == want, (truncation, mask_prompt)
    assert len(read_documents(out, "train", DataConfig(max_seq_len=40, truncation="drop"))) == 1
    with pytest.raises(DataError, match=r"sft_train.parquet row 1.*truncation='right' leaves no trained tokens"):
        read_documents(out, "train", DataConfig(max_seq_len=40, truncation="right"))
    assert read_documents(out, "train", DataConfig(max_seq_len=40, truncation="left")) == raw
    assert read_documents(out, "train", DataConfig(max_seq_len=2048)) == stored
    unmasked = read_documents(out, "train", DataConfig(mask_prompt=False))
    assert all(d.labels == d.input_ids for d in unmasked) and stored[0].labels != stored[0].input_ids
    with pytest.raises(DataError, match="data.chat_template.*set data_prep.chat_template"):
        from posttrain.core.data import load_documents

        load_documents(out, "train", tok, DataConfig(chat_template="{{ messages }}"))


def test_prepared_pairs_are_fitted_to_the_stages_max_seq_len(tmp_path, tok_dir):
    tok = make_tokenizer()
    long = {**PREF, "prompt": [{"role": "user", "content": "the model " * 30}]}
    src = write_jsonl(tmp_path / "p.jsonl", [PREF, long])
    out, _ = run_prep(tmp_path, [src], tok_dir)
    for truncation in ("left", "right", "drop"):
        cfg = DataConfig(max_seq_len=40, truncation=truncation, on_bad_row="skip")
        got = [p for p, _ in read_pairs(out, "train", cfg)]
        want = load_data(cfg.model_copy(update={"sources": [str(src)], "val_fraction": 0.0}), tok)["train"]
        assert sorted(map(str, got)) == sorted(map(str, want)), truncation
        assert all(p.longest <= 40 for p in got)


def test_data_prep_chat_template_renders_the_rows_and_travels_with_the_tokenizer(tmp_path, tok_dir):
    from posttrain.registry.tokenizer import Tokenizer

    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ': ' + m['content'] + '<|im_end|>' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant: ' }}{% endif %}")
    (tmp_path / "t.jinja").write_text(template)
    src = write_jsonl(tmp_path / "s.jsonl", [SFT])
    out, _ = run_prep(tmp_path, [src], tok_dir, chat_template=str(tmp_path / "t.jinja"))
    (doc,) = read_documents(out, "train")
    tok = Tokenizer.from_pretrained(out / "tokenizer")
    assert tok.chat_template == template
    assert tok.decode(doc.input_ids).startswith("<|im_start|>user: what is two plus two<|im_end|>")
    default, _ = run_prep(tmp_path, [src], tok_dir, name="default")
    assert read_documents(default, "train") != [doc]


def test_data_prep_keeps_a_user_rows_extra_columns_for_rewards_and_evaluation(tmp_path):
    """A user's reference answer (and other scalar columns) survive data prep, so on-policy rewards
    and evaluation can read them from its output as from the raw file (posttrain.core.data.rows)."""
    import json

    from posttrain.core.data.rows import prompt_rows
    from posttrain.stages.config import DataPrepConfig
    from posttrain.stages.data_prep import prepare

    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                  {"role": "assistant", "content": f"a{i}"}],
                                     "answer": f"a{i}", "id": i}) + "\n" for i in range(40)))
    prepare(DataPrepConfig(sources=[str(f)], synthetic_size=0, output_dir=str(tmp_path / "out"),
                           val_fraction=0.1, test_fraction=0.2))
    rows = prompt_rows([str(tmp_path / "out")], "test")
    assert rows and all(r.fields["answer"] == f"a{r.fields['id']}" for r in rows)
    assert all(r.prompt == [{"role": "user", "content": f"q{r.fields['id']}"}] for r in rows)

    p = tmp_path / "p.jsonl"  # only preference data prepared: prompt_rows without a task finds it
    p.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": f"a{i}", "rejected": "no"}) + "\n" for i in range(40)))
    prepare(DataPrepConfig(sources=[str(p)], synthetic_size=0, output_dir=str(tmp_path / "pref"),
                           val_fraction=0.1, test_fraction=0.2))
    pairs = prompt_rows([str(tmp_path / "pref")], "test")
    assert pairs and all(r.is_pair for r in pairs)
