"""DPO (offline and on-policy) and distillation on the user's own files: JSONL, Parquet and saved
`datasets` directories in every TRL format, tokenized as a hand computation says, split by
data.val_fraction where the data names no split; on-policy rewards from a verifier entry point of
this module, the built-in exact match (the reference standing in as chosen) and a judge model; bad
rows and bad verifiers named before training starts.

The verifiers below are entry points (`test_user_data:length_reward`): pytest puts this directory
on sys.path, and the slow multi-process test puts it on the ranks' PYTHONPATH.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tests.support.data_fixtures import make_tokenizer, write_jsonl, write_parquet

from posttrain.core.data.errors import DataError
from posttrain.core.data.formats import validate_row
from posttrain.core.data.split import assign_split, split_key
from posttrain.core.losses import IGNORE_INDEX
from posttrain.core.tracking import TrackingConfig
from posttrain.stages.common import StageError
from posttrain.stages.config import DistillConfig, DPOConfig

OFF = TrackingConfig(enabled=False)
TESTS = Path(__file__).resolve().parent
USER = lambda text: [{"role": "user", "content": text}]  # noqa: E731
BOT = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
WORDS = "the a model blue red question four two what answer".split()

# ------------------------------------------------------------------------------- verifiers (entry points)

SEEN_ROWS: list[dict] = []


def length_reward(prompt: str, completion: str, row: dict) -> float:
    SEEN_ROWS.append((prompt, dict(row)))
    return float(len(completion))


def raising_reward(prompt, completion, row):
    raise ValueError("boom")


def text_reward(prompt, completion, row):
    return "good"


def rank1_raises(prompt, completion, row):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank one fails")
    return float(len(completion))


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes: more threads only add contention on a shared machine (10x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    make_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from posttrain.registry.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tok_dir)


def model_dir(path: Path, seed: int = 0, tokenizer=None, **overrides) -> str:
    """A debug-preset checkpoint directory (HF format) with the test tokenizer beside the weights."""
    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.hf import save_pretrained

    save_pretrained(build_model(get_preset("debug", **overrides), seed=seed), path)
    (tokenizer or make_tokenizer()).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {"student": model_dir(root / "student", seed=1), "judge": model_dir(root / "judge", seed=2),
            "teacher": model_dir(root / "teacher", seed=3, hidden_size=96, intermediate_size=256)}


def dpo_cfg(tmp_path: Path, sources, *, model=None, tok_dir=None, data=None, **kw) -> DPOConfig:
    model = model or {"name_or_path": "debug", "tokenizer": tok_dir}
    data = {"sources": [str(s) for s in sources], "micro_batch_size": 2, "max_seq_len": 128, "val_fraction": 0.0,
            **(data or {})}
    kw.setdefault("max_steps", 2)
    return DPOConfig(output_dir=str(tmp_path / "dpo"), model=model, data=data, tracking=OFF, eval_interval=0,
                     optim={"lr": 1e-3, "warmup_steps": 1}, **kw)


@pytest.fixture
def spy(monkeypatch):
    """What the DPO stage trained on (pair_loader's pairs) and validated on (reward_accuracy's)."""
    import posttrain.stages.dpo as dpo

    seen: dict[str, list] = {}
    loader, accuracy = dpo.pair_loader, dpo.reward_accuracy

    def pair_loader(pairs, *a, **k):
        seen["train"] = list(pairs)
        return loader(pairs, *a, **k)

    def reward_accuracy(model, pairs, *a, **k):
        seen["val"] = list(pairs)
        return accuracy(model, pairs, *a, **k)

    monkeypatch.setattr(dpo, "pair_loader", pair_loader)
    monkeypatch.setattr(dpo, "reward_accuracy", reward_accuracy)
    return seen


# ------------------------------------------------------------------------------------- hand tokenizing


def chat(tok, messages, gen=False) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=gen)


def text(tok, s: str) -> list[int]:
    return tok.encode(s) + [tok.eos_id]  # plain text: the completion ends with EOS


def hand_pair(tok, row: dict) -> tuple[tuple | None, tuple, tuple]:
    """(prompt ids, or None for plain text; prompt + chosen ids; prompt + rejected ids) of a preference row."""
    c, r = row["chosen"], row["rejected"]
    if "prompt" not in row:  # implicit prompt
        got = (chat(tok, c[:-1], True), chat(tok, c), chat(tok, r)) if isinstance(c, list) else \
            (None, text(tok, c), text(tok, r))
    elif isinstance(row["prompt"], str):
        got = None, text(tok, row["prompt"] + c), text(tok, row["prompt"] + r)
    else:
        p = row["prompt"]
        got = chat(tok, p, True), chat(tok, p + c), chat(tok, p + r)
    return tuple(got[0]) if got[0] is not None else None, tuple(got[1]), tuple(got[2])


def as_tuple(pair) -> tuple:
    return tuple(pair.prompt_ids), tuple(pair.prompt_ids + pair.chosen_ids), tuple(pair.prompt_ids + pair.rejected_ids)


def trained(ids, labels) -> list[int]:
    return [t for t, label in zip(ids, labels) if label != IGNORE_INDEX]


def pref_rows(kind: str, n: int, seed: int) -> list[dict]:
    rows = []
    for i in range(n):
        q = f"what is {WORDS[(i + seed) % len(WORDS)]} plus {i + 7 * seed}"
        good, bad = f"four {i}", f"blue red {seed}"
        if kind == "conv":
            rows.append({"prompt": USER(q), "chosen": BOT(good), "rejected": BOT(bad), "id": i})
        elif kind == "plain":
            rows.append({"prompt": q + " =", "chosen": " " + good, "rejected": " " + bad})
        elif kind == "implicit_conv":
            rows.append({"chosen": USER(q) + BOT(good), "rejected": USER(q) + BOT(bad)})
        else:  # implicit plain
            rows.append({"chosen": f"{q} answer: {good}", "rejected": f"{q} answer: {bad}"})
    return rows


FMT = {"conv": "preference", "plain": "preference", "implicit_conv": "implicit_preference",
       "implicit_plain": "implicit_preference"}


# ------------------------------------------------------------------------------------------ offline DPO


def test_offline_dpo_trains_on_the_pairs_of_every_format(tmp_path, tok, tok_dir, spy):
    """Pairs from JSONL (explicit and implicit prompts, messages and plain strings), Parquet and a
    saved DatasetDict are exactly the hand-tokenized chosen/rejected; rows of files that name no
    split go to validation by data.val_fraction (a hash of the prompt), a DatasetDict's by its split."""
    import datasets

    files = {kind: write_jsonl(tmp_path / f"{kind}.jsonl", pref_rows(kind, 6, seed)) for seed, kind in
             enumerate(FMT)}
    parquet_rows = pref_rows("plain", 5, seed=7)
    files["parquet"] = write_parquet(tmp_path / "pairs.parquet", parquet_rows)
    dd_train, dd_val = pref_rows("conv", 3, seed=8), pref_rows("conv", 2, seed=9)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(dd_train),
                          "validation": datasets.Dataset.from_list(dd_val)}).save_to_disk(str(tmp_path / "dd"))
    cfg = dpo_cfg(tmp_path, [*files.values(), tmp_path / "dd"], tok_dir=tok_dir, data={"val_fraction": 0.4})
    from posttrain.stages.dpo import run

    m = run(cfg)["metrics"]

    want: dict[str, list] = {"train": [], "validation": []}
    sources = [(FMT[k], pref_rows(k, 6, s)) for s, k in enumerate(FMT)] + [("preference", parquet_rows)]
    for fmt, rows in sources:
        for row in rows:
            want[assign_split(split_key(validate_row(row, fmt)), 0.4)].append(hand_pair(tok, row))
    want["train"] += [hand_pair(tok, r) for r in dd_train]
    want["validation"] += [hand_pair(tok, r) for r in dd_val]
    assert want["train"] and want["validation"]
    for split, key in (("train", "train"), ("validation", "val")):
        got = [as_tuple(p) for p in spy[key]]
        assert sorted(g[1:] for g in got) == sorted(w[1:] for w in want[split]), split
        prompts = {w[1:]: w[0] for w in want[split]}
        assert all(prompts[g[1:]] in (None, g[0]) for g in got)  # message prompts end at the generation prompt
    for p in spy["train"]:  # the loss is on the completion and its end-of-turn token, nothing else
        for ids, labels in ((p.chosen_ids, p.chosen_labels), (p.rejected_ids, p.rejected_labels)):
            assert tok.decode(trained(ids, labels)).endswith("<|im_end|>")
            assert trained(ids, labels)[0] == ids[0]
    assert m["steps"] == 2 and m["train_pairs"] == len(want["train"]) and "val/accuracy" in m
    assert m["data/kept"] == sum(len(r) for _, r in sources) + 5 and m["data/dropped"] == 0


def test_tokenizer_comes_from_model_tokenizer_or_the_model_dir(tmp_path, models, tok):
    from posttrain.stages.recipe import policy_tokenizer

    src = write_jsonl(tmp_path / "p.jsonl", pref_rows("conv", 2, 0))
    from_dir = policy_tokenizer(dpo_cfg(tmp_path, [src], model={"name_or_path": models["student"]}))
    assert from_dir.backend.get_vocab() == tok.backend.get_vocab() and from_dir.chat_template == tok.chat_template
    with pytest.raises(StageError, match="set model.tokenizer to a tokenizer directory"):
        policy_tokenizer(dpo_cfg(tmp_path, [src], model={"name_or_path": "debug"}))
    with pytest.raises(StageError, match=r"model.tokenizer='.*nowhere': no tokenizer.json there"):
        policy_tokenizer(dpo_cfg(tmp_path, [src], model={"name_or_path": models["student"],
                                                         "tokenizer": str(tmp_path / "nowhere")}))


def test_bad_preference_rows_are_named_before_training_or_counted(tmp_path, tok_dir):
    from posttrain.stages.dpo import run

    rows = pref_rows("conv", 4, 0)
    bad = write_jsonl(tmp_path / "bad.jsonl", rows[:2] + [{**rows[2], "rejected": 5}] + rows[3:])
    with pytest.raises(DataError, match=r"bad.jsonl line 3, field rejected: expected a list of messages"):
        run(dpo_cfg(tmp_path, [bad], tok_dir=tok_dir))
    assert not (tmp_path / "dpo" / "manifest.json").exists() and not (tmp_path / "dpo" / "model").exists()
    table = write_parquet(tmp_path / "bad.parquet", [{"prompt": "a", "chosen": " b", "rejected": " c"},
                                                     {"prompt": "a", "chosen": " b", "rejected": " b"}])
    with pytest.raises(DataError, match=r"bad.parquet row 1, field rejected: identical to chosen"):
        run(dpo_cfg(tmp_path, [table], tok_dir=tok_dir))
    m = run(dpo_cfg(tmp_path, [bad], tok_dir=tok_dir, data={"on_bad_row": "skip"}, max_steps=1))["metrics"]
    assert m["data/kept"] == 3 and m["data/dropped/wrong_type"] == 1 and m["train_pairs"] == 3
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"messages": USER("hi") + BOT("hello")}])
    with pytest.raises(DataError, match="sft.jsonl: holds sft rows; this stage needs preference rows"):
        run(dpo_cfg(tmp_path, [sft], tok_dir=tok_dir))


# -------------------------------------------------------------------------------------- on-policy DPO


def prompt_file(path: Path, n: int, answer_key: str = "answer") -> tuple[Path, list[dict]]:
    """Prompts only (messages and plain strings), a conversation and a preference row: any row gives a prompt."""
    rows = []
    for i in range(n):
        q = f"what is {WORDS[i % len(WORDS)]} plus {i}"
        kind = i % 4
        if kind == 0:
            rows.append({"prompt": USER(q), answer_key: f"four {i}", "task": "chat"})
        elif kind == 1:
            rows.append({"prompt": q + " =", answer_key: f" {i}", "task": "text"})
        elif kind == 2:
            rows.append({"messages": USER(q) + BOT("blue"), answer_key: "red", "task": "sft"})
        else:
            rows.append({"prompt": USER(q), "chosen": BOT("four"), "rejected": BOT("two"), answer_key: "four",
                         "task": "pair"})
    return write_jsonl(path, rows), rows


def row_prompt(row: dict):
    return row["messages"][:-1] if "messages" in row else row["prompt"]


def hand_prompt(tok, row: dict) -> list[int]:
    p = row_prompt(row)
    return tok.encode(p) if isinstance(p, str) else chat(tok, p, gen=True)


def records(tmp_path: Path, split: str = "train") -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "dpo" / "on_policy" / f"{split}.jsonl").read_text().splitlines()]


def row_of(rec: dict, rows: list[dict]) -> dict:
    return rows[int(rec["where"].rsplit(" ", 1)[1]) - 1]  # "file line N"


def test_on_policy_verifier_ranks_the_samples(tmp_path, tok, tok_dir, spy):
    """A verifier entry point scores every sample; chosen = the first best, rejected = the first
    worst, ties give no pair, and the pairs trained on are the prompt (chat template + generation
    prompt, or plain text) followed by exactly those samples."""
    from posttrain.stages.dpo import run

    SEEN_ROWS.clear()
    src, rows = prompt_file(tmp_path / "prompts.jsonl", 12)
    cfg = dpo_cfg(tmp_path, [src], tok_dir=tok_dir, pairs="on_policy", reward="test_user_data:length_reward",
                  num_samples=3, max_new_tokens=6, max_steps=None)
    m = run(cfg)["metrics"]
    recs = records(tmp_path)
    assert len(recs) == 12 and m["on_policy/prompts"] == 12
    pairs = iter(spy["train"])
    rewards = []
    for rec in recs:
        row = row_of(rec, rows)
        scores = [s["reward"] for s in rec["samples"]]
        rewards += scores
        assert len(scores) == 3
        assert all(s["reward"] == len(s["completion"]) == len(tok.decode(s["tokens"], skip_special_tokens=True))
                   for s in rec["samples"])
        if rec["skipped"] == "tie":
            assert len(set(scores)) == 1
            continue
        assert rec["skipped"] is None
        assert rec["chosen"] == scores.index(max(scores)) and rec["rejected"] == scores.index(min(scores))
        assert scores[rec["chosen"]] > scores[rec["rejected"]]
        pair = next(pairs)
        assert pair.prompt_ids == hand_prompt(tok, row)
        assert pair.chosen_ids == pair.chosen_labels == rec["samples"][rec["chosen"]]["tokens"]
        assert pair.rejected_ids == rec["samples"][rec["rejected"]]["tokens"]
    assert next(pairs, None) is None
    paired = sum(r["skipped"] is None for r in recs)
    assert paired and m["train_pairs"] == m["on_policy/pairs"] == paired
    assert m["on_policy/pair_share"] == pytest.approx(paired / 12)
    assert m["on_policy/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    # the verifier saw the prompt as text (a conversation's last user turn) and the row's columns as text
    def as_text(p):
        return p if isinstance(p, str) else p[-1]["content"]

    assert {(row["task"], prompt) for prompt, row in SEEN_ROWS} == {(r["task"], as_text(row_prompt(r))) for r in rows}
    assert all(row["prompt"] == prompt for prompt, row in SEEN_ROWS)
    by_task = {row["task"]: row for _, row in SEEN_ROWS}
    assert by_task["sft"]["completion"] == "blue" and by_task["sft"]["answer"] == "red"
    assert by_task["pair"]["chosen"] == "four" and by_task["pair"]["rejected"] == "two"


def test_on_policy_builtin_reward_falls_back_to_the_reference(tmp_path, tok, tok_dir, spy):
    """exact_match against `reference_column`: the random policy solves nothing, so every row's
    reference, tokenized as a completion of its prompt, is chosen and the worst sample rejected."""
    from posttrain.stages.dpo import run

    src, rows = prompt_file(tmp_path / "prompts.jsonl", 8, answer_key="gold")
    cfg = dpo_cfg(tmp_path, [src], tok_dir=tok_dir, pairs="on_policy", reward="exact_match",
                  reference_column="gold", num_samples=2, max_new_tokens=4, max_steps=None)
    m = run(cfg)["metrics"]
    recs = records(tmp_path)
    assert all(r["chosen"] == "reference" and r["rejected"] == 0 and r["skipped"] is None for r in recs)
    assert all(s["reward"] == 0.0 for r in recs for s in r["samples"])
    for rec, pair in zip(recs, spy["train"], strict=True):
        row = row_of(rec, rows)
        p = row_prompt(row)
        full = text(tok, p + row["gold"]) if isinstance(p, str) else chat(tok, p + BOT(row["gold"]))
        assert pair.prompt_ids + pair.chosen_ids == full
        assert tok.decode(trained(pair.chosen_ids, pair.chosen_labels)) == row["gold"] + "<|im_end|>"
        assert pair.rejected_ids == rec["samples"][0]["tokens"]
    assert m["on_policy/reference_chosen"] == 8 and m["on_policy/reward_mean"] == 0.0


def test_on_policy_judge_reward_is_its_mean_log_likelihood(tmp_path, tok, tok_dir, models, spy):
    """With a judge, each sample's reward is the judge's mean per-token log-likelihood of it after
    the prompt (checked against a plain forward); validation prompts (val_fraction) are sampled too."""
    from posttrain.registry.hf import load_pretrained
    from posttrain.stages.dpo import run

    src, rows = prompt_file(tmp_path / "prompts.jsonl", 12)
    cfg = dpo_cfg(tmp_path, [src], tok_dir=tok_dir, pairs="on_policy", judge=models["judge"], num_samples=3,
                  max_new_tokens=5, max_steps=None, data={"val_fraction": 0.4})
    m = run(cfg)["metrics"]
    judge = load_pretrained(models["judge"]).eval()
    train, val = records(tmp_path), records(tmp_path, "validation")
    assert train and val and len(train) + len(val) == 12 and m["on_policy/val_prompts"] == len(val)
    for rec in train + val:
        prompt = hand_prompt(tok, row_of(rec, rows))
        for s in rec["samples"]:
            ids = torch.tensor([prompt + s["tokens"]])
            with torch.no_grad():
                logp = judge(ids)[0].float().log_softmax(-1)
            n = len(prompt)
            want = logp[n - 1:-1].gather(1, torch.tensor(s["tokens"])[:, None]).mean().item()
            assert s["reward"] == pytest.approx(want, abs=1e-4)
        scores = [s["reward"] for s in rec["samples"]]
        if rec["skipped"] is None:
            assert rec["chosen"] == scores.index(max(scores)) and rec["rejected"] == scores.index(min(scores))
    assert len(spy["train"]) == sum(r["skipped"] is None for r in train)
    assert len(spy["val"]) == sum(r["skipped"] is None for r in val) == m["on_policy/val_pairs"]


def test_on_policy_validation_pairs_are_the_datas_own_or_sampled(tmp_path, tok, tok_dir, spy):
    """Data prep's SFT output gives prompts for both splits (validation pairs sampled, rows named by
    their Parquet row); a user's preference file gives training prompts and, for validation, its
    own pairs of the val_fraction share, as offline DPO would split and tokenize them."""
    from posttrain.stages.data_prep import prepare
    from posttrain.stages.config import DataPrepConfig
    from posttrain.stages.dpo import run

    sft = [{"messages": USER(f"what is {w} plus {i}") + BOT(f"{i} {w}"), "answer": f"{i} {w}"}
           for i, w in enumerate(WORDS)]
    prep = tmp_path / "prep"
    prepare(DataPrepConfig(output_dir=str(prep), sources=[str(write_jsonl(tmp_path / "sft.jsonl", sft))],
                           synthetic_size=0, tokenizer=tok_dir, val_fraction=0.4, test_fraction=0.0, tracking=OFF))
    prefs = pref_rows("conv", 10, seed=3)
    pref_file = write_jsonl(tmp_path / "pref.jsonl", [{**r, "answer": "four"} for r in prefs])
    cfg = dpo_cfg(tmp_path, [prep, pref_file], tok_dir=tok_dir, pairs="on_policy", num_samples=2, max_new_tokens=3,
                  max_steps=None, data={"val_fraction": 0.5}, reward="test_user_data:length_reward")
    m = run(cfg)["metrics"]
    train, val = records(tmp_path), records(tmp_path, "validation")
    assert {Path(r["where"].split(" row ")[0]).name for r in val} == {"sft_validation.parquet"}
    assert {Path(r["where"].rsplit(" ", 2)[0]).name for r in train} == {"sft_train.parquet", "pref.jsonl"}
    n_train = sum(assign_split(split_key(validate_row(r, "preference")), 0.5) == "train" for r in prefs)
    own = [hand_pair(tok, r)[1:] for r in prefs if assign_split(split_key(validate_row(r, "preference")), 0.5)
           == "validation"]
    assert own and 0 < n_train < len(prefs)
    assert sum("pref.jsonl line" in r["where"] for r in train) == n_train  # its training share only
    got = [as_tuple(p)[1:] for p in spy["val"]]
    assert sorted(got[:len(own)]) == sorted(own)  # the file's own pairs, then the sampled ones
    assert len(got) - len(own) == m["on_policy/val_pairs"] == sum(r["skipped"] is None for r in val) > 0


def test_judge_must_share_the_policys_vocabulary(tmp_path, tok_dir, models):
    from posttrain.stages.dpo import run

    src, _ = prompt_file(tmp_path / "prompts.jsonl", 2)
    with pytest.raises(StageError, match="judge 'debug' has a vocabulary of 640 tokens, the policy 512"):
        run(dpo_cfg(tmp_path, [src], tok_dir=tok_dir, pairs="on_policy",
                    judge={"name_or_path": "debug", "overrides": {"vocab_size": 640}}))
    other = make_tokenizer()
    other.backend.add_tokens(["zzz-new-token"])
    odd = model_dir(tmp_path / "odd-judge", seed=2, tokenizer=other)
    with pytest.raises(StageError, match="judge .*odd-judge' has a different tokenizer"):
        run(dpo_cfg(tmp_path, [src], tok_dir=tok_dir, pairs="on_policy", judge=odd))


@pytest.mark.parametrize("reward,match", [
    ("test_user_data:raising_reward", r"prompts.jsonl line \d+: verifier 'test_user_data:raising_reward' raised "
                                      r"ValueError: boom"),
    ("test_user_data:text_reward", r"prompts.jsonl line \d+: verifier 'test_user_data:text_reward' returned "
                                   r"'good', not a number"),
    ("no_such_module_xyz:f", r"reward: verifier 'no_such_module_xyz:f': cannot import"),
])
def test_bad_verifiers_are_named_with_the_row(tmp_path, tok_dir, reward, match):
    from posttrain.stages.dpo import run

    src, _ = prompt_file(tmp_path / "prompts.jsonl", 4)
    with pytest.raises(StageError, match=match):
        run(dpo_cfg(tmp_path, [src], tok_dir=tok_dir, pairs="on_policy", reward=reward, max_new_tokens=2))
    assert not (tmp_path / "dpo" / "manifest.json").exists()


def test_bad_prompt_rows_are_named_before_sampling_or_counted(tmp_path, tok_dir, monkeypatch):
    import posttrain.stages.on_policy as on_policy
    from posttrain.stages.dpo import run

    rows = [{"prompt": "a =", "answer": " 1"}, {"prompt": "b =", "task": "no answer"}, {"prompt": "c =", "answer": "3"}]
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    sampled = []
    monkeypatch.setattr(on_policy, "sample_pairs", lambda s, prompts, *a: sampled.append(prompts) or ([], []))
    with pytest.raises(DataError, match=r"p.jsonl line 2, field answer: missing: reward 'exact_match' compares"):
        run(dpo_cfg(tmp_path, [src], tok_dir=tok_dir, pairs="on_policy"))
    bad_type = write_jsonl(tmp_path / "q.jsonl", [rows[0], {"prompt": 7, "answer": "x"}])
    with pytest.raises(DataError, match=r"q.jsonl line 2, field prompt: expected a list of messages, got integer 7"):
        run(dpo_cfg(tmp_path, [bad_type], tok_dir=tok_dir, pairs="on_policy"))
    long = write_jsonl(tmp_path / "long.jsonl", [rows[0], {"prompt": "blue red " * 80, "answer": "x"}])
    with pytest.raises(DataError, match=r"long.jsonl line 2, field prompt: the prompt has \d+ tokens, leaving no room"):
        run(dpo_cfg(tmp_path, [long], tok_dir=tok_dir, pairs="on_policy"))
    assert sampled == []  # every error came before any sampling
    with pytest.raises(StageError, match="on-policy sampling gave no pairs"):  # skipped rows, then sampling (stubbed)
        run(dpo_cfg(tmp_path, [src, bad_type], tok_dir=tok_dir, pairs="on_policy", data={"on_bad_row": "skip"}))
    (prompts,) = sampled  # shuffled (data.seed) before sampling
    assert sorted(Path(p.row.where).name for p in prompts) == ["p.jsonl line 1", "p.jsonl line 3", "q.jsonl line 1"]


# --------------------------------------------------------------------------------------- distillation


def sft_sources(tmp_path: Path) -> tuple[list, list[dict]]:
    import datasets

    conv = [{"messages": USER(f"what is {w}") + BOT(f"the {w} model")} for w in WORDS[:4]]
    conv.append({"messages": USER("two") + BOT("four") + USER("and blue") + BOT("red red")})  # multi-turn
    plain = [{"prompt": f"question {w} =", "completion": f" answer {w}"} for w in WORDS[4:8]]
    chat_pc = [{"prompt": USER(f"red {w}"), "completion": BOT(f"blue {w}")} for w in WORDS[:3]]
    datasets.Dataset.from_list(chat_pc).save_to_disk(str(tmp_path / "saved"))
    sources = [write_jsonl(tmp_path / "conv.jsonl", conv), write_parquet(tmp_path / "plain.parquet", plain),
               tmp_path / "saved"]
    return sources, conv + plain + chat_pc


def distill_cfg(tmp_path: Path, sources, models, **kw) -> DistillConfig:
    data = {"sources": [str(s) for s in sources], "micro_batch_size": 2, "max_seq_len": 128, "val_fraction": 0.0,
            "packing": False, **kw.pop("data", {})}
    kw.setdefault("max_steps", 2)
    return DistillConfig(output_dir=str(tmp_path / "distill"), model={"name_or_path": models["student"]},
                         teacher={"name_or_path": models["teacher"]}, data=data, tracking=OFF,
                         eval_interval=0, optim={"lr": 1e-3, "warmup_steps": 1}, **kw)


@pytest.fixture
def distill_spy(monkeypatch):
    import posttrain.stages.distill as distill

    seen: dict[str, list] = {}
    loader, mix = distill.doc_loader, distill.OnPolicyMix

    def doc_loader(docs, *a, **k):
        seen.setdefault("val" if k.get("evaluation") else "train", list(docs))
        return loader(docs, *a, **k)

    class Mix(mix):
        def __init__(self, loader, session, prompts, *rest):
            super().__init__(loader, session, prompts, *rest)
            seen["prompts"] = prompts

    monkeypatch.setattr(distill, "doc_loader", doc_loader)
    monkeypatch.setattr(distill, "OnPolicyMix", Mix)
    return seen


def hand_doc(tok, row: dict) -> list[int]:
    if "messages" in row:
        return chat(tok, row["messages"])
    if isinstance(row["prompt"], str):
        return text(tok, row["prompt"] + row["completion"])
    return chat(tok, row["prompt"] + row["completion"])


def test_distillation_trains_on_the_users_sft_files(tmp_path, tok, models, distill_spy):
    """Messages (JSONL), plain prompt/completion (Parquet) and conversational prompt/completion (a
    saved dataset), tokenized as by hand, with the loss on the replies only; the tokenizer is the
    student directory's."""
    from posttrain.stages.distill import run

    sources, rows = sft_sources(tmp_path)
    m = run(distill_cfg(tmp_path, sources, models, mode="online"))["metrics"]
    docs = distill_spy["train"]
    assert sorted(d.input_ids for d in docs) == sorted(hand_doc(tok, r) for r in rows)
    for d in docs:
        assert tok.decode(trained(d.input_ids, d.labels)).endswith("<|im_end|>") and d.labels != d.input_ids
    assert m["steps"] == 2 and m["data/kept"] == len(rows) and 0 < m["time/teacher_frac"] < 1


def test_on_policy_distillation_prompts_come_from_the_same_rows(tmp_path, tok, models, distill_spy):
    """on_policy samples the student after each row's prompt: every turn before the final reply,
    through the chat template's generation prompt (plain text for string prompts), also with
    mask_prompt=false, where the loss covers every token of the data."""
    from posttrain.stages.distill import run

    sources, rows = sft_sources(tmp_path)
    m = run(distill_cfg(tmp_path, sources, models, mode="on_policy", on_policy_ratio=1.0, max_new_tokens=4,
                        data={"mask_prompt": False}))["metrics"]
    docs, prompts = distill_spy["train"], distill_spy["prompts"]
    want = {tuple(hand_doc(tok, r)): hand_prompt(tok, r) for r in rows}
    assert len(prompts) == len(docs) == len(rows)
    for d, p in zip(docs, prompts):
        assert p == want[tuple(d.input_ids)] and d.input_ids[:len(p)] == p
        assert d.labels == d.input_ids
    assert m["on_policy/samples"] > 0


def test_bad_sft_rows_are_named_before_distillation(tmp_path, models):
    from posttrain.stages.distill import run

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": USER("hi") + BOT("hello")},
                                               {"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"bad.jsonl line 2, field messages\[0\].role: expected one of"):
        run(distill_cfg(tmp_path, [bad], models))
    assert not (tmp_path / "distill" / "manifest.json").exists()
    m = run(distill_cfg(tmp_path, [bad], models, data={"on_bad_row": "skip", "micro_batch_size": 1},
                        max_steps=1))["metrics"]
    assert m["data/kept"] == 1 and m["data/dropped/unknown_role"] == 1


# ------------------------------------------------------------------------------------------ multi-rank


@pytest.mark.slow
def test_on_policy_pairs_are_the_same_on_every_rank_and_for_any_world(tmp_path, tok_dir):
    """Two ranks sample one chunk of prompts each and gather: the pairs (and records) equal one
    process's, training runs in lockstep, and a verifier failing on rank 1 only stops the job with
    its message instead of hanging the other rank."""
    from posttrain.stages.dpo import run
    from posttrain.stages.launch import Launch
    from posttrain.stages.launch.config import LauncherConfig

    src, _ = prompt_file(tmp_path / "prompts.jsonl", 40)
    common = dict(tok_dir=tok_dir, pairs="on_policy", reward="test_user_data:length_reward", num_samples=2,
                  max_new_tokens=4, max_steps=None)
    one = tmp_path / "one"
    run(dpo_cfg(one, [src], **common))
    # this directory (the verifier's module) and what the session's PYTHONPATH holds (tests/conftest.py:
    # the `tests` package the module imports its helpers from)
    launcher = LauncherConfig(nproc_per_node=2, env={"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ["PYTHONPATH"]])})
    two = tmp_path / "two"
    spec = dpo_cfg(two, [src], launcher=launcher, **common)
    result = Launch("dpo", spec, launcher, workdir=tmp_path / ".launch-two").start().wait()
    assert result.ok, Path(result.log_file).read_text()[-3000:]
    assert records(two) == records(one) and len(records(one)) == 40
    m = json.loads((two / "dpo" / "manifest.json").read_text())["metrics"]
    assert m["train_pairs"] == sum(r["skipped"] is None for r in records(one))

    spec = dpo_cfg(tmp_path / "fail", [src], launcher=launcher, **{**common, "reward": "test_user_data:rank1_raises"})
    result = Launch("dpo", spec, launcher, workdir=tmp_path / ".launch-fail").start().wait()
    assert not result.ok
    log = Path(result.log_file).read_text()
    assert "on-policy sampling failed on rank 1" in log and "rank one fails" in log
