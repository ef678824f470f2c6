"""KTO on unpaired data ({prompt, completion, label}, TRL's KTOTrainer format): the objective on a
real collated batch against the paper's formula on full logits and against TRL's
KTOTrainer._compute_loss fed the same per-token log-probs; z0 averaged over two gloo ranks; the
rows' validation; and short DPO-stage runs on an unpaired JSONL and on data prep's output."""

from __future__ import annotations

import json
import logging
import math
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from posttrain.core.tracking import TrackingConfig

OFF = TrackingConfig(enabled=False, log_every=1)
sg = torch.sigmoid


# --------------------------------------------------------------------------- a batch, scored by hand


def _examples(seed=3, n=6):
    from posttrain.core.data.encode import UnpairedExample

    g = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(5, 200, (k,), generator=g).tolist()  # noqa: E731
    out = []
    for i in range(n):
        c = ids(2 + (3 * i) % 5)
        out.append(UnpairedExample(ids(2 + i % 3), c, c, label=i % 3 != 1))
    return out


def _seq_logp(model, prompt, completion):
    """log p(completion | prompt), summed, from the model's full logits (no fused head)."""
    ids = torch.tensor([prompt + completion])
    logp = model(ids).float()[0, :-1].log_softmax(-1)
    tgt = ids[0, 1:]
    return logp.gather(-1, tgt[:, None])[:, 0][len(prompt) - 1:].sum()


def _per_token(model, prompt, completion, width):
    """TRL's layout: per-token log-probs (width - 1,) of one right-padded row, 0 off the completion."""
    ids = torch.tensor([prompt + completion])
    logp = model(ids).float()[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    row = torch.zeros(width - 1, dtype=logp.dtype)
    row[len(prompt) - 1: len(prompt) + len(completion) - 1] = logp[len(prompt) - 1:]
    return row


@pytest.fixture(scope="module")
def models():
    from posttrain.core.model import build_model, get_preset

    return build_model(get_preset("debug"), seed=0).eval(), build_model(get_preset("debug"), seed=1).eval()


def test_objective_matches_the_paper_on_full_logits_and_trls_kto_trainer(models):
    from trl import KTOTrainer
    from tests.core.test_preference_losses import _LM, _fake_self

    from posttrain.core.data.packing import collate_unpaired
    from posttrain.core.objectives import kto_objective, pair_logps

    policy, ref_model = models
    ex = _examples()
    n, beta, wd, wu = len(ex), 0.3, 1.4, 0.6
    batch = collate_unpaired(ex)
    reference = lambda b: pair_logps(ref_model, b)[0]  # noqa: E731
    out = kto_objective(beta, reference, wd, wu)(policy, batch)

    # the paper (eq. 7) written out: completion i-1 with prompt i for z0 (TRL's rotation)
    with torch.no_grad():
        r = torch.stack([_seq_logp(policy, e.prompt_ids, e.completion_ids)
                         - _seq_logp(ref_model, e.prompt_ids, e.completion_ids) for e in ex]).double()
        kl_comp = [ex[-1].completion_ids] + [e.completion_ids for e in ex[:-1]]
        r_kl = torch.stack([_seq_logp(policy, e.prompt_ids, c) - _seq_logp(ref_model, e.prompt_ids, c)
                            for e, c in zip(ex, kl_comp)]).double()
    z0 = max(0.0, float(r_kl.mean()))
    label = torch.tensor([e.label for e in ex])
    paper = torch.where(label, wd * (1 - sg(beta * (r - z0))), wu * (1 - sg(beta * (z0 - r))))
    assert out.num_tokens == n
    torch.testing.assert_close(out.loss_sum.detach().double() / n, paper.mean(), rtol=2e-4, atol=2e-5)
    assert out.metrics["rewards/kto_kl"] == pytest.approx(z0, abs=1e-4)
    assert out.metrics["rewards/chosen"] == pytest.approx(float(beta * r[label].mean()), abs=1e-4)
    assert out.metrics["rewards/rejected"] == pytest.approx(float(beta * r[~label].mean()), abs=1e-4)

    # TRL's KTOTrainer on the same per-token log-probs (padded rows, its own KL rotation of the ids)
    W = max(len(e.prompt_ids) + len(e.completion_ids) for e in ex + [
        types.SimpleNamespace(prompt_ids=e.prompt_ids, completion_ids=c) for e, c in zip(ex, kl_comp)])
    with torch.no_grad():
        tok = torch.stack([_per_token(policy, e.prompt_ids, e.completion_ids, W) for e in ex]).double()
        kl_tok = torch.stack([_per_token(policy, e.prompt_ids, c, W) for e, c in zip(ex, kl_comp)]).double()
        ref = torch.stack([_per_token(ref_model, e.prompt_ids, e.completion_ids, W) for e in ex]).double().sum(1)
        ref_kl = torch.stack([_per_token(ref_model, e.prompt_ids, c, W) for e, c in zip(ex, kl_comp)]).double().sum(1)
    mask = torch.zeros(n, W, dtype=torch.long)
    for i, e in enumerate(ex):
        mask[i, len(e.prompt_ids): len(e.prompt_ids) + len(e.completion_ids)] = 1
    ids, kl_ids = torch.zeros_like(mask), torch.ones_like(mask)
    lm = _LM({id(ids): (tok, None), id(kl_ids): (kl_tok, None)})
    me = _fake_self(lm, beta=beta, loss_type="kto", calculate_KL=True, desirable_weight=wd, undesirable_weight=wu,
                    args=types.SimpleNamespace(gradient_checkpointing_kwargs=None))
    me._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, me)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(mask), "completion_mask": mask, "label": label,
              "ref_logps": ref, "ref_KL_logps": ref_kl, "KL_input_ids": kl_ids,
              "KL_attention_mask": torch.ones_like(mask), "KL_completion_mask": mask}
    theirs = KTOTrainer._compute_loss(me, lm, inputs, False)
    torch.testing.assert_close(out.loss_sum.detach().double() / n, theirs, rtol=2e-4, atol=2e-5)
    assert me._metrics["train"]["kl"][-1] == pytest.approx(z0, abs=1e-4)
    # TRL's rewards/chosen, rewards/rejected are the same means
    assert me._metrics["train"]["rewards/chosen"][-1] == pytest.approx(out.metrics["rewards/chosen"], abs=1e-4)
    assert me._metrics["train"]["rewards/rejected"][-1] == pytest.approx(out.metrics["rewards/rejected"], abs=1e-4)


def test_gradient_flows_through_the_matched_pairs_only(models):
    """z0 is a constant of the gradient: the loss's gradient is that of kto_loss with z0 fixed."""
    from posttrain.core import preference as P
    from posttrain.core.data.packing import collate_unpaired
    from posttrain.core.objectives import kto_objective, pair_logps

    policy, ref_model = models
    ex = _examples(seed=5)
    batch = collate_unpaired(ex)
    reference = lambda b: pair_logps(ref_model, b)[0]  # noqa: E731
    w = policy.lm_head.weight
    out = kto_objective(0.5, reference)(policy, batch)
    (g_obj,) = torch.autograd.grad(out.loss_sum, w)
    lp = pair_logps(policy, batch)[0]
    with torch.no_grad():
        rf = reference(batch)
    z0 = torch.tensor(out.metrics["rewards/kto_kl"])
    (g_ref,) = torch.autograd.grad(P.kto_loss(lp, rf, batch["desirable"], 0.5, z0).sum(), w)
    torch.testing.assert_close(g_obj, g_ref, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- z0 over data-parallel ranks


def _rank(rank, world, store, examples, q):
    import torch.distributed as dist

    from posttrain.core.data.packing import collate_unpaired
    from posttrain.core.model import build_model, get_preset
    from posttrain.core.objectives import kto_objective, pair_logps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    policy, ref_model = build_model(get_preset("debug"), seed=0).eval(), build_model(get_preset("debug"), seed=1).eval()
    batch = collate_unpaired(examples[rank::world])
    out = kto_objective(0.3, lambda b: pair_logps(ref_model, b)[0], kl_reduce=True)(policy, batch)
    q.put((rank, float(out.loss_sum), out.metrics["rewards/kto_kl"]))
    dist.destroy_process_group()


@pytest.mark.slow
def test_z0_is_averaged_over_data_parallel_ranks_as_trl_gathers_it(tmp_path, models):
    """Two gloo ranks, each with half the examples: z0 = max(0, mean over ranks of each rank's
    mean mismatched log-ratio), as TRL's gather_for_metrics(kl).mean().clamp(min=0); each rank's
    loss is kto_loss of its own examples at that z0."""
    import torch.multiprocessing as mp

    from posttrain.core import preference as P
    from posttrain.core.data.packing import collate_unpaired
    from posttrain.core.objectives import pair_logps

    policy, ref_model = models
    ex = _examples(seed=7, n=8)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, tmp_path / "store", ex, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (loss, kl)) for r, loss, kl in (q.get(timeout=300) for _ in procs))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with torch.no_grad():
        means, parts = [], []
        for r in range(2):
            b = collate_unpaired(ex[r::2])
            kl = b["kto_kl_batch"]
            means.append(float((pair_logps(policy, kl)[0] - pair_logps(ref_model, kl)[0]).mean()))
            parts.append((pair_logps(policy, b)[0], pair_logps(ref_model, b)[0], b["desirable"]))
        z0 = max(0.0, sum(means) / 2)
        for r in range(2):
            assert got[r][1] == pytest.approx(z0, abs=1e-5)
            want = P.kto_loss(*parts[r][:2], parts[r][2], 0.3, torch.tensor(z0)).sum()
            assert got[r][0] == pytest.approx(float(want), rel=1e-4, abs=1e-5)
    assert means[0] != pytest.approx(means[1])  # the ranks' own estimates differ: the average is what counts


# --------------------------------------------------------------------------- rows


def _write(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    from tests.support.data_fixtures import make_tokenizer

    return make_tokenizer()


def _load(tmp_path, rows, tok, **kw):
    from posttrain.core.data.config import DataConfig
    from posttrain.core.data.dataset import load_data

    src = _write(tmp_path / "kto.jsonl", rows)
    return load_data(DataConfig(sources=[src], format=kw.pop("format", "preference"), val_fraction=0.0, **kw), tok)


GOOD = {"prompt": "2+2?", "completion": "4", "label": True}
CHAT = {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "5"}],
        "label": False}


@pytest.mark.parametrize("fmt", ["preference", "auto"])
def test_unpaired_rows_load_as_kto_examples(tmp_path, tok, fmt):
    from posttrain.core.data.encode import UnpairedExample

    data = _load(tmp_path, [GOOD, {**GOOD, "completion": "5", "label": False}, CHAT], tok, format=fmt)
    assert data.task == "unpaired"
    items = data["train"]
    assert [type(x) for x in items] == [UnpairedExample] * 3 and [x.label for x in items] == [True, False, False]
    for x in items:  # the loss is on the completion only; the prompt ends where it starts
        doc = x.document
        assert len(doc.labels) == len(doc.input_ids) and all(v == -100 for v in doc.labels[:len(x.prompt_ids)])
        assert any(v != -100 for v in x.completion_labels)
    # the same prompt and completion tokenize as the prompt/completion SFT row does
    sft = _load(tmp_path, [{"prompt": "2+2?", "completion": "4"}], tok, format="sft")["train"][0]
    assert items[0].document.input_ids == sft.input_ids and items[0].document.labels == sft.labels


@pytest.mark.parametrize("row, field, match", [
    ({"prompt": "2+2?", "label": True, "completion": None}, "completion", "missing"),
    ({**GOOD, "label": 1}, "label", "expected a JSON boolean .*got integer 1"),
    ({**GOOD, "label": "true"}, "label", "expected a JSON boolean .*got string 'true'"),
    ({**GOOD, "label": None}, "label", "missing"),
    ({**GOOD, "completion": "  "}, "completion", "empty completion"),
    ({**CHAT, "completion": [{"role": "user", "content": "x"}]}, "completion[0].role", "'user' cannot follow"),
    ({**CHAT, "prompt": "2+2?"}, "completion", "expected a string"),
])
def test_bad_unpaired_rows_name_file_line_and_field(tmp_path, tok, row, field, match):
    from posttrain.core.data.errors import DataError

    with pytest.raises(DataError, match=match) as e:
        _load(tmp_path, [GOOD, row], tok)
    assert e.value.source.endswith("kto.jsonl") and e.value.row == 2 and e.value.field == field
    assert f"kto.jsonl line 2, field {field}:" in str(e.value)


def test_paired_and_unpaired_sources_do_not_mix(tmp_path):
    from posttrain.core.data.errors import DataError
    from posttrain.core.data.prepared import data_task

    un = _write(tmp_path / "un.jsonl", [GOOD])
    pair = _write(tmp_path / "pair.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    assert data_task([un]) == "unpaired" and data_task([pair]) == "preference"
    assert data_task([un], "sft") == "preference"  # data.format sft: prompt/completion SFT rows, label ignored
    with pytest.raises(DataError, match="mixes paired preference rows .*pair.jsonl.* unpaired ones .*un.jsonl"):
        data_task([pair, un])


# --------------------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def kto_root(tmp_path_factory):
    """Data prep's synthetic suite (for its tokenizer), and its pairs unpaired into a JSONL as TRL's
    unpair_preference_dataset does: each pair's chosen desirable, its rejected undesirable."""
    from posttrain.core.tasks import make_suite
    from posttrain.stages.config import DataPrepConfig
    from posttrain.stages.data_prep import prepare

    root = tmp_path_factory.mktemp("kto")
    prepare(DataPrepConfig(output_dir=str(root / "data"), synthetic_size=8, tracking=OFF))
    rows = []
    for e in make_suite(120, 0):
        r = e.preference_row()
        rows += [{"prompt": r["prompt"], "completion": r["chosen"], "label": True, "task": r["task"]},
                 {"prompt": r["prompt"], "completion": r["rejected"], "label": False, "task": r["task"]}]
    _write(root / "kto.jsonl", rows)
    return root


def kto_cfg(root: Path, name: str, sources=None, **kw):
    from posttrain.stages.config import DPOConfig

    kw.setdefault("optim", {"lr": 5e-3, "warmup_steps": 1})
    return DPOConfig(output_dir=str(root / name), model={"name_or_path": "debug", "tokenizer": str(root / "data" /
                                                                                                    "tokenizer")},
                     data={"sources": sources or [str(root / "kto.jsonl")], "micro_batch_size": 8,
                           "max_seq_len": 128, "val_fraction": 0.2},
                     tracking=OFF, max_steps=kw.pop("max_steps", 8), eval_interval=4, loss_type="kto", **kw)


@pytest.mark.parametrize("reference", ["disable_adapter", "precomputed"])
def test_dpo_stage_trains_kto_on_unpaired_jsonl(kto_root, reference):
    from tests.stages.test_stage_parallel import in_process

    cfg = kto_cfg(kto_root, f"dpo-{reference}", reference=reference, desirable_weight=1.0, undesirable_weight=1.0)
    records = in_process(cfg)
    m = {k: v for r in records for k, v in r.items()}
    steps = [r for r in records if "loss" in r and r.get("step")]
    assert len(steps) == 8 and all(math.isfinite(r["loss"]) for r in steps)
    assert {"rewards/chosen", "rewards/rejected", "rewards/kto_kl"} <= set(steps[0])
    # held out: the loss falls from 0.5 (policy = reference at the start), desirable above undesirable
    assert m["val/kto_loss_initial"] == pytest.approx(0.5, abs=1e-6)
    assert m["val/kto_loss"] < m["val/kto_loss_initial"]
    assert m["val/chosen_initial"] == pytest.approx(0.0, abs=1e-6) and m["val/margin"] > 0.005
    assert m["val/chosen"] > m["val/rejected"]
    manifest = json.loads((Path(cfg.output_dir) / "manifest.json").read_text())
    assert manifest["metrics"]["train_desirable"] == manifest["metrics"]["train_undesirable"] > 50
    if reference == "precomputed":  # cached once, then read back: a second run is the same run
        cache = sorted((Path(cfg.output_dir) / "reference").glob("ref_logps-*.safetensors"))
        assert len(cache) == 2  # train and validation
        stamp = [c.stat().st_mtime_ns for c in cache]
        again = in_process(kto_cfg(kto_root, f"dpo-{reference}", reference=reference, max_steps=8))
        assert [c.stat().st_mtime_ns for c in cache] == stamp
        assert [r["loss"] for r in again if "loss" in r and r.get("step")] == pytest.approx(
            [r["loss"] for r in steps], rel=1e-5)


def test_dpo_stage_trains_kto_from_data_prep_output(kto_root):
    """Data prep writes unpaired rows as their own Parquet (unpaired_train, ...), which the DPO
    stage reads back with loss_type kto."""
    from posttrain.stages.config import DataPrepConfig
    from posttrain.stages.data_prep import prepare
    from tests.stages.test_stage_parallel import in_process

    out = kto_root / "prep-unpaired"
    manifest = prepare(DataPrepConfig(output_dir=str(out), sources=[str(kto_root / "kto.jsonl")], synthetic_size=0,
                                      tokenizer=str(kto_root / "data" / "tokenizer"), val_fraction=0.2,
                                      tracking=OFF))
    assert {"unpaired_train", "unpaired_validation"} <= set(manifest["outputs"])
    assert not any(k.startswith("preference_") for k in manifest["outputs"])
    import pyarrow.parquet as pq

    table = pq.read_table(out / manifest["outputs"]["unpaired_train"])
    assert {"prompt", "completion", "label", "task", "prompt_ids", "completion_ids", "completion_labels"} <= set(
        table.column_names)
    cfg = kto_cfg(kto_root, "dpo-prep", sources=[str(out)])
    records = in_process(cfg)
    m = {k: v for r in records for k, v in r.items()}
    assert m["val/kto_loss"] < m["val/kto_loss_initial"] and m["val/margin"] > 0


def test_unpaired_loader_resumes_with_the_same_batches_and_mismatched_pairs():
    """The mismatched pairs are built from each micro-batch's own examples at collation, so a
    loader resumed from its state yields the same batches, kto_kl_batch included."""
    from posttrain.core.data import build_loader
    from posttrain.core.data.config import DataConfig

    ex = _examples(seed=9, n=24)
    cfg = DataConfig(micro_batch_size=4, seed=3)
    a = iter(build_loader(ex, cfg, num_epochs=2))
    loader = build_loader(ex, cfg, num_epochs=2)
    it = iter(loader)
    for _ in range(3):
        next(it), next(a)
    state = loader.state_dict()
    resumed = build_loader(ex, cfg, num_epochs=2)
    resumed.load_state_dict(state)
    for want, got in zip([next(a) for _ in range(4)], list(resumed)[:4]):
        assert want["doc_indices"] == got["doc_indices"]
        for key in ("input_ids", "labels", "desirable"):
            assert torch.equal(want[key], got[key])
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(want["kto_kl_batch"][key], got["kto_kl_batch"][key])
        first = ex[got["doc_indices"][0]]  # prompt 0 with the batch's last completion
        last = ex[got["doc_indices"][-1]]
        n = len(first.prompt_ids) + len(last.completion_ids)
        assert got["kto_kl_batch"]["input_ids"][0, :n].tolist() == first.prompt_ids + last.completion_ids


def test_unpaired_rows_need_loss_type_kto(kto_root):
    from posttrain.stages.common import StageError
    from tests.stages.test_stage_parallel import in_process

    cfg = kto_cfg(kto_root, "dpo-sigmoid").model_copy(update={"loss_type": "sigmoid"})
    with pytest.raises(StageError, match="unpaired preference rows .*loss_type: kto only; got loss_type='sigmoid'"):
        in_process(cfg)


def test_one_kind_only_is_warned_as_trl_warns(kto_root, caplog):
    from posttrain.stages.dpo import check_balance
    from posttrain.core.data.encode import UnpairedExample

    cfg = kto_cfg(kto_root, "unused")
    ex = [UnpairedExample([1], [2], [2], True) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="posttrain.dpo"):
        assert check_balance(ex, cfg, "x.jsonl") == {"train_desirable": 4, "train_undesirable": 0}
    assert "x.jsonl has no undesirable examples (label false)" in caplog.text
    caplog.clear()
    ex += [UnpairedExample([1], [3], [3], False)]  # 4 vs 1 with equal weights: TRL's range check warns
    with caplog.at_level(logging.WARNING, logger="posttrain.dpo"):
        check_balance(ex, cfg, "x.jsonl")
    assert "outside [1, 4/3]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain.dpo"):
        check_balance(ex, cfg.model_copy(update={"kto_undesirable_weight": 3.5}), "x.jsonl")
    assert not caplog.text  # 4 * 1 / (1 * 3.5) in [1, 4/3]


def test_trl_weight_names_are_accepted():
    from posttrain.stages.config import DPOConfig

    cfg = DPOConfig(loss_type="kto", desirable_weight=1.33, undesirable_weight=0.5)
    assert (cfg.kto_desirable_weight, cfg.kto_undesirable_weight) == (1.33, 0.5)
    with pytest.raises(ValueError, match="desirable_weight .* same knob"):
        DPOConfig(loss_type="kto", desirable_weight=1.0, kto_desirable_weight=2.0)
