"""The evaluation stage on the user's own rows, every metric against a value computed here by hand.

Three tiny random models (HF format, the debug preset, built locally) share the test BPE tokenizer.
Their greedy generations are computed here with posttrain.core.model.generate on the same prompts, and the
data's reference answers are written from them, so each exact match, normalized match and win rate
is known by construction. Log-probabilities (perplexity, preference accuracy, the judge) are
recomputed with a plain full-logits forward of each sequence alone; sampled generations (pass@k) are
replayed with the stage's documented seeds and scored with the test verifier (tests/support/eval_verifiers.py).
"""

from __future__ import annotations

import functools
import json
import math
import re
import string
from pathlib import Path

import pytest
import torch

from posttrain.core.tracking import TrackingConfig, clean_key
from tests.support.data_fixtures import make_tokenizer, write_jsonl, write_parquet
from posttrain.stages.config import EvalConfig

OFF = TrackingConfig(enabled=False)
NEW = 6  # max_new_tokens

PROMPTS = [  # (prompt, completion, task)
    ([{"role": "user", "content": "what is two plus four"}], "four", "add"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the model learns"}], "to answer", "add"),
    ([{"role": "user", "content": "blue red"}], "red", "add"),
    ([{"role": "user", "content": "question what is"}], "the question", "sub"),
    ([{"role": "user", "content": "a model answer"}], "blue", "sub"),
    ("the user asks", " assistant", "sub"),
]
PAIRS = [  # (prompt, chosen, rejected, task)
    ([{"role": "user", "content": "two plus two"}], "four", "blue red", "add"),
    ([{"role": "user", "content": "what is red"}], "a question", "the model", "add"),
    ([{"role": "user", "content": "model"}], "answer", "what", "sub"),
    ("the assistant", " learns", " is blue", "sub"),
]


# ------------------------------------------------------------------------------------ by hand


@functools.lru_cache(maxsize=8)
def load(path: Path):
    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.tokenizer import Tokenizer

    return load_pretrained(path).eval(), Tokenizer.from_pretrained(path)


def prompt_ids(tok, prompt) -> list[int]:
    return tok.encode(prompt) if isinstance(prompt, str) else tok.apply_chat_template(prompt, add_generation_prompt=True)


def generations(path: Path, prompts: list, temperature: float = 0.0, seed: int | None = None) -> list[str]:
    from posttrain.core.model.generate import SamplingParams, generate

    model, tok = load(path)
    params = SamplingParams(max_new_tokens=NEW, temperature=temperature, stop_token_ids=tuple(sorted(tok.eos_ids)),
                            seed=seed)
    return [tok.decode(g.tokens, skip_special_tokens=True)
            for g in generate(model, [prompt_ids(tok, p) for p in prompts], params, pad_id=tok.pad_id)]


@torch.no_grad()
def completion_logprob(model, tok, prompt, completion) -> tuple[float, int]:
    """Summed log-prob of the completion's tokens given the prompt, and their number: full logits."""
    ids, mask = tok.encode_prompt_completion(prompt, completion)
    logp = model(torch.tensor([ids])).float()[0].log_softmax(-1)
    scored = [t for t in range(1, len(ids)) if mask[t]]
    return sum(float(logp[t - 1, ids[t]]) for t in scored), len(scored)


def normalized(text: str) -> str:
    text = str(text).lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def ws(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Three random debug-preset models (peaky init, so greedy choices are clear) saved in HF format."""
    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.hf import save_pretrained

    root = tmp_path_factory.mktemp("evaluate")
    tok = make_tokenizer()
    for name, seed, preset in (("alpha", 1, "debug"), ("beta", 2, "debug"), ("judge", 3, "debug"),
                               ("moe", 4, "debug-moe")):
        save_pretrained(build_model(get_preset(preset, initializer_range=0.2), seed=seed), root / name)
        tok.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def user_data(tiny):
    """A raw JSONL of prompt/completion rows and preference pairs, the references written from the
    models' greedy generations: {"file", "alpha", "beta", "refs"}."""
    prompts = [p for p, _, _ in PROMPTS]
    a, b = generations(tiny / "alpha", prompts), generations(tiny / "beta", prompts)
    assert all(ws(x) and ws(x) != ws(y) for x, y in zip(a, b)), (a, b)
    # alpha right on rows 0, 4, 5 (5 up to whitespace), beta on row 1; row 3 matches alpha's only
    # after normalization (punctuation); row 2 matches nobody.
    refs = [a[0], b[1], "zzz nothing", a[3] + " !!", a[4], "  " + a[5].replace(" ", "   ") + " "]
    rows = [{"prompt": p, "completion": c, "task": t, "answer": r} for (p, c, t), r in zip(PROMPTS, refs)]
    rows += [{"prompt": p, "chosen": c, "rejected": r, "task": t} for p, c, r, t in PAIRS]
    return {"file": write_jsonl(tiny / "eval.jsonl", rows), "alpha": a, "beta": b, "refs": refs}


@pytest.fixture(scope="module")
def side_by_side(tiny, user_data):
    """alpha and beta on the user's JSONL, metrics=None, selected by exact match, tracked in MLflow."""
    from posttrain.stages.evaluate import run

    tracking = TrackingConfig(tracking_uri=f"sqlite:///{tiny}/mlflow.db", experiment="eval-test")
    cfg = EvalConfig(output_dir=str(tiny / "side"), models=[f"{tiny / 'alpha'}/", str(tiny / "beta")],
                     data=[str(user_data["file"])], max_new_tokens=NEW, select={"metric": "exact_match"},
                     tracking=tracking)
    return cfg, run(cfg)


# ------------------------------------------------------------------------------------ generation metrics


def test_exact_and_normalized_match_and_their_breakdowns(side_by_side, user_data):
    _, manifest = side_by_side
    res = manifest["results"]
    refs = user_data["refs"]
    em = {m: [float(ws(c) == ws(r)) for c, r in zip(user_data[m], refs)] for m in ("alpha", "beta")}
    assert em["alpha"] == [1, 0, 0, 0, 1, 1] and em["beta"] == [0, 1, 0, 0, 0, 0]  # by construction
    nm = {m: [float(normalized(c) == normalized(r)) for c, r in zip(user_data[m], refs)] for m in ("alpha", "beta")}
    assert nm["alpha"][3] == 1.0
    for m in ("alpha", "beta"):
        assert res[m]["exact_match"] == pytest.approx(sum(em[m]) / 6)
        assert res[m]["normalized_match"] == pytest.approx(sum(nm[m]) / 6)
        assert res[m]["exact_match/task=add"] == pytest.approx(sum(em[m][:3]) / 3)
        assert res[m]["exact_match/task=sub"] == pytest.approx(sum(em[m][3:]) / 3)
        assert res[m]["normalized_match/task=sub"] == pytest.approx(sum(nm[m][3:]) / 3)
    assert "reward" not in res["alpha"] and not any(k.startswith("pass@") for k in res["alpha"])


def test_win_rate_by_exact_match(side_by_side):
    """Per prompt alpha vs beta by exact match: won 0, 4, 5; lost 1; tied 2, 3 (both wrong)."""
    res = side_by_side[1]["results"]
    assert res["alpha"]["win_rate/beta"] == pytest.approx((1 + 0 + 0.5 + 0.5 + 1 + 1) / 6)
    assert res["alpha"]["win_rate/beta/task=add"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert res["alpha"]["win_rate/beta/task=sub"] == pytest.approx((0.5 + 1 + 1) / 3)
    assert res["beta"]["win_rate/alpha"] == pytest.approx(1 - 4 / 6)


def test_perplexity_and_preference_accuracy_by_hand(side_by_side, tiny):
    res = side_by_side[1]["results"]
    for name in ("alpha", "beta"):
        model, tok = load(tiny / name)
        scored = [completion_logprob(model, tok, p, c) for p, c, _ in PROMPTS]
        nll = -sum(s for s, _ in scored) / sum(n for _, n in scored)
        assert res[name]["nll"] == pytest.approx(nll, rel=1e-5)
        assert res[name]["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)
        add = scored[:3]
        assert res[name]["nll/task=add"] == pytest.approx(-sum(s for s, _ in add) / sum(n for _, n in add), rel=1e-5)
        wins = [completion_logprob(model, tok, p, c)[0] > completion_logprob(model, tok, p, r)[0] for p, c, r, _ in PAIRS]
        assert res[name]["preference_accuracy"] == pytest.approx(sum(wins) / 4)
        assert res[name]["preference_accuracy/task=sub"] == pytest.approx(sum(wins[2:]) / 2)


def test_outputs_manifest_selected_and_samples(side_by_side, tiny, user_data):
    cfg, manifest = side_by_side
    out = Path(cfg.output_dir)
    assert manifest["selected"] == {"model": f"{tiny / 'alpha'}/", "name": "alpha", "metric": "exact_match",
                                    "mode": "max", "value": 0.5}
    assert manifest["models"] == {"alpha": f"{tiny / 'alpha'}/", "beta": str(tiny / "beta")}
    assert set(manifest["results"]) == {"alpha", "beta"}
    # metrics: models[0]'s unprefixed, every other model's under models/<name>/
    assert manifest["metrics"]["exact_match"] == manifest["results"]["alpha"]["exact_match"]
    assert manifest["metrics"]["models/beta/perplexity"] == manifest["results"]["beta"]["perplexity"]
    assert json.loads((out / "manifest.json").read_text())["selected"]["name"] == "alpha"
    results = json.loads((out / "results.json").read_text())
    assert results["results"] == manifest["results"] and results["selected"] == manifest["selected"]
    assert results["counts"] == {"prompts": 6, "samples_per_prompt": 1, "completions": 6, "pairs": 4,
                                 "bad_rows_skipped": 0}
    samples = json.loads((out / "samples.json").read_text())
    assert len(samples) == 12 and set(manifest["outputs"]) == {"results", "samples"}
    first = next(s for s in samples if s["model"] == "beta" and s["index"] == 1)
    assert first["completion"] == user_data["beta"][1] and first["reference"] == user_data["refs"][1]
    assert first["score"] == 1.0 and first["group"] == "add" and first["prompt"] == "the model learns"


def test_one_mlflow_run_per_model_under_the_stage_run(side_by_side):
    from mlflow import MlflowClient

    cfg, manifest = side_by_side
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name("eval-test")
    runs = client.search_runs([exp.experiment_id])
    stage = client.get_run(manifest["mlflow_run_id"])
    assert stage.data.tags["posttrain.selected_model"] == "alpha"
    assert stage.data.metrics["exact_match"] == 0.5 and "models/beta/exact_match" in stage.data.metrics
    nested = {r.data.tags["posttrain.eval_model"]: r for r in runs if "posttrain.eval_model" in r.data.tags}
    assert set(nested) == {"alpha", "beta"}
    assert {n: r.info.run_id for n, r in nested.items()} == manifest["mlflow_model_runs"]
    for name, r in nested.items():
        assert r.data.tags["mlflow.parentRunId"] == stage.info.run_id
        assert r.data.params["model"] == manifest["models"][name]
        # the same keys for both models (up to the other's name in win_rate), MLflow-cleaned
        assert r.data.metrics["exact_match/task_add"] == manifest["results"][name]["exact_match/task=add"]
        keys = {k for k in r.data.metrics if not k.startswith("win_rate")}
        assert keys == {clean_key(k) for k in manifest["results"][name] if not k.startswith("win_rate")}
        table = json.loads(Path(client.download_artifacts(r.info.run_id, "samples_table.json")).read_text())
        assert len(table["data"]) == 6 and "completion" in table["columns"]
    artifacts = {a.path for a in client.list_artifacts(stage.info.run_id)}
    assert {"results.json", "samples.json", "samples_table.json", "comparison_table.json"} <= artifacts
    # the comparison table: one row per model, in evaluation order, each metric a column
    table = json.loads(Path(client.download_artifacts(stage.info.run_id, "comparison_table.json")).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [r["model"] for r in rows] == manifest["order"]
    for r in rows:
        assert r["path"] == manifest["models"][r["model"]]
        assert r["exact_match"] == pytest.approx(manifest["results"][r["model"]]["exact_match"], rel=1e-9)  # 10 digits in JSON
    # the per-model bookkeeping runs sample no system metrics (the stage run around them does)
    assert not any(k.startswith("system/") for r in nested.values() for k in r.data.metrics)


# ------------------------------------------------------------------------------------ sampling, pass@k, judge


def test_reward_and_pass_at_k_from_sampled_generations(tiny):
    from posttrain.core.manifest import digest
    from tests.support.eval_verifiers import reward
    from posttrain.stages.evaluate import run

    rows = [{"prompt": p, "bonus": int(i == 2), "task": t} for i, (p, _, t) in enumerate(PROMPTS[:4])]
    src = write_jsonl(tiny / "prompts.jsonl", rows)
    cfg = EvalConfig(output_dir=str(tiny / "sampled"), models=[str(tiny / "alpha")], data=[str(src)],
                     verifier="tests.support.eval_verifiers:reward", temperature=1.0, num_samples=4, pass_k=[1, 2, 4],
                     batch_size=3, max_new_tokens=NEW, seed=7, tracking=OFF)
    m = run(cfg)["results"]["alpha"]
    assert set(m) >= {"reward", "pass@1", "pass@2", "pass@4"} and "exact_match" not in m
    # Replay: batch b (first row s) repetition k samples with seed int(sha256([seed, s, k])[:15], 16).
    samples = json.loads((tiny / "sampled" / "samples.json").read_text())
    by_prompt: dict[int, list[str]] = {}
    for batch in (range(0, 3), range(3, 4)):
        for k in range(4):
            seed = int(digest([7, batch.start, k])[:15], 16)
            for i, text in zip(batch, generations(tiny / "alpha", [PROMPTS[i][0] for i in batch], 1.0, seed)):
                by_prompt.setdefault(i, []).append(text)
    assert [(s["index"], s["completion"]) for s in samples] == [(i, t) for i in range(4) for t in by_prompt[i]]
    assert any(len(set(v)) > 1 for v in by_prompt.values())  # the repetitions differ
    scores = {i: [reward("", t, rows[i]) for t in texts] for i, texts in by_prompt.items()}
    assert m["reward"] == pytest.approx(sum(map(sum, scores.values())) / 16)
    counts = [sum(s == 1.0 for s in v) for v in scores.values()]
    assert counts[2] == 4  # the bonus row always passes
    for k in (1, 2, 4):
        expected = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in counts) / 4
        assert m[f"pass@{k}"] == pytest.approx(expected)
    assert m["reward/task=add"] == pytest.approx(sum(map(sum, [scores[0], scores[1], scores[2]])) / 12)


def test_the_engine_sampler_gives_the_static_greedy_results_and_samples_with_shared_prompts(
        tiny, user_data, side_by_side):
    """sampler: engine (posttrain.core.generation): greedy, every metric and sample equal to the static
    sampler's; sampled (n = 4 a prompt in one call), seeded per sample, so a rerun repeats it."""
    from posttrain.stages.evaluate import run

    cfg, static = side_by_side
    got = run(cfg.model_copy(update={"output_dir": str(tiny / "side-engine"), "sampler": "engine",
                                     "tracking": OFF}))
    assert got["results"] == static["results"]
    same = lambda d: [(x["model"], x["index"], x["completion"]) for x in  # noqa: E731
                      json.loads((tiny / d / "samples.json").read_text())]
    assert same("side-engine") == same("side")
    rows = [{"prompt": p, "bonus": int(i == 2), "task": t} for i, (p, _, t) in enumerate(PROMPTS[:4])]
    src = write_jsonl(tiny / "prompts-engine.jsonl", rows)
    sampled = EvalConfig(output_dir=str(tiny / "sampled-engine"), models=[str(tiny / "alpha")], data=[str(src)],
                         verifier="tests.support.eval_verifiers:reward", temperature=1.0, num_samples=4, pass_k=[1, 4],
                         batch_size=3, max_new_tokens=NEW, seed=7, tracking=OFF, sampler="engine")
    first = run(sampled)["results"]["alpha"]
    again = run(sampled.model_copy(update={"output_dir": str(tiny / "sampled-engine-2")}))["results"]["alpha"]
    assert first == again and first["pass@4"] >= first["pass@1"] > 0
    texts = [x["completion"] for x in json.loads((tiny / "sampled-engine" / "samples.json").read_text())]
    assert len(texts) == 16 and len(set(texts)) > 4  # 4 samples of each of 4 prompts, not one repeated
    with pytest.raises(ValueError, match=r"sampler: 'engine' needs the model whole on each rank or split by tp, "
                                         r"but parallel sets pp=2"):
        EvalConfig(models=[str(tiny / "alpha")], data=[str(src)], sampler="engine", parallel={"pp": 2})


def test_win_rate_by_judge_likelihood(tiny, user_data):
    from posttrain.stages.evaluate import run

    cfg = EvalConfig(output_dir=str(tiny / "judged"), models=[str(tiny / "alpha"), str(tiny / "beta")],
                     data=[str(user_data["file"])], judge=str(tiny / "judge"), metrics=["win_rate"],
                     max_new_tokens=NEW, tracking=OFF)
    res = run(cfg)["results"]
    assert set(res["alpha"]) == {"win_rate/beta", "win_rate/beta/task=add", "win_rate/beta/task=sub"}
    judge, tok = load(tiny / "judge")

    def mean_ll(prompt, text):
        s, n = completion_logprob(judge, tok, prompt, text)
        return s / n

    outcomes = []
    for (p, _, _), a, b in zip(PROMPTS, user_data["alpha"], user_data["beta"]):
        la, lb = mean_ll(p, a), mean_ll(p, b)
        outcomes.append(1.0 if la > lb else 0.5 if la == lb else 0.0)
    assert res["alpha"]["win_rate/beta"] == pytest.approx(sum(outcomes) / 6)
    assert res["alpha"]["win_rate/beta/task=sub"] == pytest.approx(sum(outcomes[3:]) / 3)
    samples = json.loads((tiny / "judged" / "samples.json").read_text())
    assert samples[0]["judge"] == pytest.approx(mean_ll(PROMPTS[0][0], user_data["alpha"][0]), rel=1e-5)


def test_parquet_files_are_read_as_the_users_rows(tiny):
    from posttrain.stages.evaluate import run

    chat = [(p, c, t) for p, c, t in PROMPTS if not isinstance(p, str)]
    comp = write_parquet(tiny / "comp.parquet", [{"prompt": p, "completion": c, "task": t} for p, c, t in chat])
    pairs = write_parquet(tiny / "pairs.parquet", [{"prompt": p, "chosen": c, "rejected": r}
                                                   for p, c, r, _ in PAIRS if not isinstance(p, str)])
    m = run(EvalConfig(output_dir=str(tiny / "pq"), models=[str(tiny / "alpha")], data=[str(comp), str(pairs)],
                       metrics=["perplexity", "preference_accuracy"], tracking=OFF))["results"]["alpha"]
    model, tok = load(tiny / "alpha")
    scored = [completion_logprob(model, tok, p, c) for p, c, _ in chat]
    assert m["nll"] == pytest.approx(-sum(s for s, _ in scored) / sum(n for _, n in scored), rel=1e-5)
    wins = [completion_logprob(model, tok, p, c)[0] > completion_logprob(model, tok, p, r)[0]
            for p, c, r, _ in PAIRS if not isinstance(p, str)]
    assert m["preference_accuracy"] == pytest.approx(sum(wins) / 3)


# ------------------------------------------------------------------------------------ errors before models load


@pytest.fixture
def no_model_loads(monkeypatch):
    import posttrain.stages.evaluate

    def refuse(*a, **kw):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(posttrain.stages.evaluate, "load_model", refuse)


@pytest.mark.parametrize("rows,kw,expected", [
    ([{"prompt": "hi", "task": "x"}], {"metrics": ["exact_match"]}, [r"bad\.jsonl line 1", "'answer'", "reference_column"]),
    ([{"prompt": "hi", "answer": "1"}, {"prompt": "ho"}], {}, [r"bad\.jsonl line 2: no 'answer' field"]),
    ([{"prompt": "hi", "answer": "1"}], {"metrics": ["perplexity"]}, [r"bad\.jsonl", "carries a completion"]),
    ([{"prompt": "hi", "answer": "1"}], {"metrics": ["preference_accuracy"]}, [r"bad\.jsonl", "chosen and rejected"]),
    ([{"prompt": "hi", "answer": "1"}, '{"prompt": "oops"'], {}, [r"bad\.jsonl line 2", "JSON"]),
    ([{"messages": [{"role": "bot", "content": "x"}]}], {}, [r"bad\.jsonl line 1", r"messages\[0\]\.role"]),
    ([{"prompt": "hi", "answer": "1"}], {"verifier": "no_such_module_xyz:f"}, ["no_such_module_xyz"]),
    ([{"prompt": "hi", "answer": "1", "task": "add"}], {"select": {"metric": "exact_match/task=mul"}},
     ["select.metric", r"exact_match/task=add"]),
])
def test_bad_data_is_a_clear_error_before_any_model_loads(tiny, tmp_path, no_model_loads, rows, kw, expected):
    from posttrain.stages.common import StageError
    from posttrain.stages.evaluate import run

    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(StageError) as err:
        run(EvalConfig(output_dir=str(tmp_path / "out"), models=[str(tiny / "alpha")], data=[str(src)],
                       tracking=OFF, **kw))
    for pattern in expected:
        assert re.search(pattern, str(err.value)), str(err.value)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_bad_rows_can_be_skipped_and_counted(tiny, tmp_path):
    from posttrain.stages.evaluate import run

    src = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "hi", "answer": "1"}, '{"prompt": ', {"prompt": "ho",
                                                                                                 "answer": "2"}])
    m = run(EvalConfig(output_dir=str(tmp_path / "out"), models=[str(tiny / "alpha")], data={
        "sources": [str(src)], "on_bad_row": "skip"}, metrics=["exact_match"], max_new_tokens=2, tracking=OFF))
    assert m["counts"]["bad_rows_skipped"] == 1 and m["counts"]["prompts"] == 2


def test_a_missing_model_is_named_before_any_model_loads(tiny, user_data, tmp_path, no_model_loads):
    from posttrain.stages.common import StageError
    from posttrain.stages.evaluate import run

    with pytest.raises(StageError, match="no_such_dir"):
        run(EvalConfig(output_dir=str(tmp_path), models=[str(tiny / "alpha"), str(tmp_path / "no_such_dir")],
                       data=[str(user_data["file"])], tracking=OFF))


def test_a_verifier_failing_mid_run_is_a_stage_error(tiny, user_data, tmp_path):
    from posttrain.stages.common import StageError
    from posttrain.stages.evaluate import run

    with pytest.raises(StageError, match=r"eval\.jsonl line 1: verifier .*not a number"):
        run(EvalConfig(output_dir=str(tmp_path), models=[str(tiny / "alpha")], data=[str(user_data["file"])],
                       verifier="tests.support.eval_verifiers:broken", metrics=["reward"], max_new_tokens=2, tracking=OFF))


# ------------------------------------------------------------------------------------ config and aggregation


@pytest.mark.parametrize("kw,match", [
    ({"metrics": ["reward"]}, "set verifier"),
    ({"metrics": ["win_rate"]}, "win_rate compares models"),
    ({"judge": "j"}, "at least 2 models"),
    ({"models": ["a", "b"], "judge": "j", "metrics": ["exact_match"]}, "judge only decides win_rate"),
    ({"select": {"metric": "perplexity"}}, "select.mode: min"),
    ({"select": {"metric": "win_rate/x"}}, "cannot rank every model"),
    ({"select": {"metric": "bleu"}}, "not a metric"),
    ({"select": {"metric": "exact_match"}, "metrics": ["perplexity"]}, "needs 'exact_match' in metrics"),
    ({"select": {"metric": "exact_match/lang=en"}}, "group_by='task'"),
    ({"pass_k": [0]}, "k must be >= 1"),
    ({"metrics": []}, "computes nothing"),
    ({"verifier": "just_a_name"}, "module:function"),
])
def test_metric_combinations_are_refused_when_the_config_loads(kw, match):
    with pytest.raises(ValueError, match=match):
        EvalConfig(**kw)


def test_pass_at_k_on_known_counts():
    from posttrain.stages.evaluation.metrics import GenRecord, generation_metrics

    recs = [GenRecord(["x"] * 5, primary=[1.0] * c + [0.0] * (5 - c)) for c in (0, 2, 5)]
    m = generation_metrics(recs, ["pass@k"], [1, 2, 5])
    assert m["pass@1"] == pytest.approx((0 + 0.4 + 1) / 3)
    assert m["pass@2"] == pytest.approx((0 + (1 - 3 / 10) + 1) / 3)  # 1 - C(3,2)/C(5,2)
    assert m["pass@5"] == pytest.approx((0 + 1 + 1) / 3)
    partial = generation_metrics([GenRecord(["x"], primary=[0.5])], ["pass@k"], [1])
    assert partial["pass@1"] == 0.0  # a score below 1 does not pass


def test_win_rates_by_verifier_scores_with_ties_and_groups():
    from posttrain.stages.evaluation.metrics import GenRecord, with_win_rates

    def recs(*scores):
        return [GenRecord(["x"] * len(s), primary=list(s)) for s in scores]

    gen = {"a": recs([1.0, 0.0], [0.5], [0.2], [1.0]), "b": recs([0.0, 0.0], [0.5], [0.9], [0.0]),
           "c": recs([0.5, 0.5], [0.5], [0.2], [1.0])}
    results: dict = {"a": {}, "b": {}, "c": {}}
    with_win_rates(results, gen, ["x", "x", "y", None], "task", by_judge=False)
    assert results["a"]["win_rate/b"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert results["a"]["win_rate/c"] == pytest.approx(0.5)  # mean 0.5 vs 0.5, then ties
    assert results["a"]["win_rate/b/task=x"] == pytest.approx(0.75) and results["a"]["win_rate/b/task=y"] == 0.0
    assert results["b"] == {"win_rate/a": pytest.approx(1 - 2.5 / 4), "win_rate/a/task=x": pytest.approx(0.25),
                            "win_rate/a/task=y": 1.0}


def test_selection_and_names():
    from posttrain.stages.evaluation.metrics import select_model
    from posttrain.stages.evaluation.plan import model_names

    assert model_names(["runs/sft", "runs/dpo/", "other/sft", "debug", "x/sft-2"]) == \
        ["sft", "dpo", "sft-2", "debug", "sft-2-2"]
    results = {"a": {"nll": 2.0}, "b": {"nll": 1.0}, "c": {"nll": 1.0}, "d": {}}
    assert select_model(results, list(results), ["pa", "pb", "pc", "pd"], "nll", "min")["model"] == "pb"
    assert select_model(results, list(results), ["pa", "pb", "pc", "pd"], "nll", "max")["name"] == "a"


# ------------------------------------------------------------------------------------ ranks


# Each layout the ranks test runs: name -> (its parallel settings, the two models). The layouts share
# launches (test_stage_parallel.torchrun_batch): one torchrun of 2 ranks runs the evaluate stages of
# the 2-rank layouts one after another, one of 4 the 4-rank one.
EVAL_LAYOUTS = {
    "data_parallel": ({}, ("alpha", "beta")),   # replicas; 3 batches: the ranks take 2 and 1
    "tp": ({"tp": 2}, ("alpha", "beta")),       # both ranks every batch, the models split over them
    "fsdp": ({"dp_shard": 2}, ("alpha", "beta")),  # each model sharded (FSDP), the ranks' batches in lockstep
    "ep": ({"ep": 2}, ("moe", "alpha")),        # an MoE's experts spread over the ranks (the dense one sharded)
    "pp": ({"pp": 2}, ("alpha", "moe")),        # each model in 2 pipeline stages: forwards and decoding stage by stage
    "cp": ({"cp": 2}, ("alpha", "beta")),       # sharded over the cp ranks (whole rows each), in lockstep
    # 4 ranks: 2 stages, each sharded over the 2 cp ranks (rows whole), the stage walk in lockstep
    "pp_cp": ({"pp": 2, "cp": 2}, ("alpha", "moe")),
}


def eval_common(tiny: Path, data: Path, models: tuple[str, ...]) -> dict:
    return dict(models=[str(tiny / m) for m in models], data=[str(data)], batch_size=2, temperature=1.0,
                num_samples=2, pass_k=[1, 2], max_new_tokens=NEW, tracking=OFF)


@pytest.fixture(scope="module")
def ranks_work(tmp_path_factory):
    return tmp_path_factory.mktemp("eval_ranks")


@pytest.fixture(scope="module")
def launched(tiny, user_data, ranks_work, request):
    """The asked-for layouts of EVAL_LAYOUTS under torchrun, one launch per world size: {layout:
    [] or why its launch did not finish it}; outputs in ranks_work/<layout>."""
    from tests.stages.test_stage_parallel import Launched, asked_for, torchrun_batch

    from posttrain.stages.launch.config import LauncherConfig

    wanted = asked_for(request, EVAL_LAYOUTS)
    nprocs = {n: 4 if len(EVAL_LAYOUTS[n][0]) > 1 else 2 for n in wanted}
    out = {}
    for nproc in sorted(set(nprocs.values())):
        configs = {n: EvalConfig(output_dir=str(ranks_work / n), launcher=LauncherConfig(nproc_per_node=nproc),
                                 parallel=EVAL_LAYOUTS[n][0], **eval_common(tiny, user_data["file"], EVAL_LAYOUTS[n][1]))
                   for n in wanted if nprocs[n] == nproc}
        out.update(torchrun_batch(configs, nproc, ranks_work / f".batch-{nproc}"))
    return Launched(out)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(EVAL_LAYOUTS))
def test_two_processes_give_the_single_process_metrics(tiny, user_data, tmp_path, launched, ranks_work, layout):
    """Sampled generations, perplexity and pairs over 2 (4) torchrun ranks equal one process's: the same
    samples, the same metrics (log-probs to float rounding). Sharded (FSDP, EP), every forward is
    collective: a rank out of batches runs filler forwards, and decoding goes on until both ranks'
    rows are done."""
    from tests.stages.test_stage_parallel import stage_log

    from posttrain.stages.evaluate import run
    from posttrain.stages.evaluation.plan import model_names

    parallel, models = EVAL_LAYOUTS[layout]
    one = run(EvalConfig(output_dir=str(tmp_path / "one"), **eval_common(tiny, user_data["file"], models)))
    launched[layout]  # raises with the launch's output if it did not finish this layout
    log = stage_log(ranks_work / f".batch-{4 if len(parallel) > 1 else 2}", layout)
    assert ("ranks in lockstep" in log) == (set(parallel) & {"dp_shard", "ep", "cp"} != set())  # sharded, or not
    assert log.count("split into pipeline stages") == (len(models) if "pp" in parallel else 0)
    two = json.loads((ranks_work / layout / "manifest.json").read_text())
    first, second = (model_names([str(tiny / m) for m in models]))
    assert set(two["results"][first]) == set(one["results"][first]) >= {"pass@2", "perplexity", f"win_rate/{second}"}
    for name in (first, second):
        for k, v in one["results"][name].items():
            # generation metrics are equal; log-probs up to float summation order (threads per rank)
            assert two["results"][name][k] == pytest.approx(v, rel=1e-6), k
    samples = lambda d: [(s["model"], s["index"], s["completion"]) for s in  # noqa: E731
                         json.loads((d / "samples.json").read_text())]
    assert samples(tmp_path / "one") == samples(ranks_work / layout)
