"""Stages on the tiny default: the distillation and DPO modes in-process, and under torchrun with
2 processes a stage that is killed and restarted resumes, and a malformed input file fails naming
the file and line."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from posttrain.core.tracking import TrackingConfig
from posttrain.stages.config import DataPrepConfig, DistillConfig, DPOConfig, SFTConfig
from posttrain.stages.launch.config import LauncherConfig

OFF = TrackingConfig(enabled=False)
DATA = {"batch_tokens": 512, "max_seq_len": 128}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Data prep, then a short SFT of a student and of a (wider) teacher."""
    from posttrain.stages.data_prep import prepare
    from posttrain.stages.sft import run as sft

    root = tmp_path_factory.mktemp("stages")
    prepare(DataPrepConfig(output_dir=str(root / "data"), synthetic_size=240, tracking=OFF))
    common = dict(data={**DATA, "sources": [str(root / "data")]}, tracking=OFF, max_steps=8, eval_interval=4,
                  optim={"lr": 3e-3, "warmup_steps": 1})
    student = sft(SFTConfig(output_dir=str(root / "student"), **common))
    teacher = sft(SFTConfig(output_dir=str(root / "teacher"), model={
        "name_or_path": "debug", "overrides": {"hidden_size": 96, "intermediate_size": 256}}, **common))
    assert student["metrics"]["val/loss"] < student["metrics"]["val/loss_initial"]
    assert teacher["metrics"]["val/loss"] < teacher["metrics"]["val/loss_initial"]
    return root


def distill_cfg(root: Path, out: str, **kw) -> DistillConfig:
    return DistillConfig(output_dir=str(root / out), model={"name_or_path": str(root / "student")},
                         teacher={"name_or_path": str(root / "teacher")},
                         data={**DATA, "sources": [str(root / "data")]}, tracking=OFF, max_steps=6,
                         eval_interval=3, optim={"lr": 2e-3, "warmup_steps": 1}, **kw)


@pytest.mark.parametrize("mode,sampler", [("online", "static"), ("on_policy", "static"), ("on_policy", "engine")])
def test_distillation_lowers_student_kl(prepared, mode, sampler):
    """GKD's student samples from the static sampler or through the engine (sampler: engine)."""
    from posttrain.stages.distill import run

    m = run(distill_cfg(prepared, f"distill-{mode}-{sampler}", mode=mode, on_policy_ratio=0.5, max_new_tokens=8,
                        sampler=sampler))["metrics"]
    assert m["val/kl"] < m["val/kl_initial"]
    assert 0 < m["time/teacher_frac"] < 1
    if mode == "on_policy":
        assert m["on_policy/samples"] > 0


def test_offline_distillation_caches_teacher_topk(prepared):
    from posttrain.stages.distill import run

    cfg = distill_cfg(prepared, "distill-offline", mode="offline", top_k=16)
    first = run(cfg)["metrics"]
    (cache,) = (prepared / "distill-offline" / "teacher_cache").glob("top16-*")
    chunks = sorted(cache.glob("chunk-*.safetensors"))
    assert (cache / "complete").exists() and len(chunks) > 1  # one file per chunk of documents
    stamps = {c: c.stat().st_mtime_ns for c in chunks}
    second = run(cfg)["metrics"]
    assert {c: c.stat().st_mtime_ns for c in chunks} == stamps  # reused, not recomputed
    assert first["val/kl"] < first["val/kl_initial"] and second["val/kl"] == pytest.approx(first["val/kl"])
    # A run killed while scoring left some chunks: the next scores only the missing ones; and a
    # student with other settings (here its learning rate) reads the same cache.
    chunks[1].unlink()
    (cache / "complete").unlink()
    other = cfg.model_copy(update={"output_dir": str(prepared / "distill-offline-2"), "teacher_cache": str(cache.parent),
                                   "optim": cfg.optim.model_copy(update={"lr": 1e-3})})
    third = run(other)["metrics"]
    assert (cache / "complete").exists() and chunks[1].exists()
    assert {c: c.stat().st_mtime_ns for c in chunks if c != chunks[1]} == {c: t for c, t in stamps.items()
                                                                         if c != chunks[1]}
    assert not (prepared / "distill-offline-2" / "teacher_cache").exists()
    assert third["val/kl"] < third["val/kl_initial"]


@pytest.mark.parametrize("pairs,reference", [("offline", "disable_adapter"), ("on_policy", "precomputed")])
def test_dpo_raises_implicit_reward_accuracy(prepared, pairs, reference):
    from posttrain.stages.dpo import run

    source = prepared / "data"
    if pairs == "on_policy":
        # A user's file of prompts with answers (data prep's SFT rows): its validation pairs are then
        # sampled by the policy too, like the training pairs. (From data prep's output, validation
        # would be its own pairs, whose near-miss rejections on-policy DPO on a model this young,
        # which gets every sample wrong, is not trained to tell apart.)
        source = prompts_file(prepared)
    cfg = DPOConfig(output_dir=str(prepared / f"dpo-{pairs}"), model={"name_or_path": str(prepared / "student")},
                    data={"sources": [str(source)], "micro_batch_size": 8}, tracking=OFF, max_steps=8,
                    eval_interval=4, pairs=pairs, reference=reference, num_samples=4, max_new_tokens=8,
                    optim={"lr": 5e-3, "warmup_steps": 1})
    m = run(cfg)["metrics"]
    assert m["val/accuracy"] > m["val/accuracy_initial"]
    assert m["val/margin"] > m["val/margin_initial"]
    out = prepared / f"dpo-{pairs}"
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "model" / "config.json").exists()
    if reference == "precomputed":
        assert list((out / "reference").glob("ref_logps-*.safetensors"))
    if pairs == "on_policy":  # the file's prompts, exact match against their answer
        assert m["on_policy/pairs"] == m["train_pairs"] > 0 and 0 < m["on_policy/pair_share"] <= 1
        assert m["on_policy/val_pairs"] > 0
        assert (out / "on_policy" / "train.jsonl").exists() and (out / "on_policy" / "validation.jsonl").exists()


def test_on_policy_dpo_samples_through_the_engine(prepared):
    """sampler: engine: the num_samples of each prompt come from one engine call (sharing the
    prompt's KV blocks), ranked into pairs as the static sampler's are; the run trains on them."""
    from posttrain.stages.dpo import run

    out = prepared / "dpo-engine"
    cfg = DPOConfig(output_dir=str(out), model={"name_or_path": str(prepared / "student")},
                    data={"sources": [str(prompts_file(prepared))], "micro_batch_size": 8}, tracking=OFF, max_steps=2,
                    eval_interval=0, pairs="on_policy", reference="precomputed", num_samples=4, max_new_tokens=8,
                    sampler="engine", optim={"lr": 5e-3, "warmup_steps": 1})
    m = run(cfg)["metrics"]
    assert m["on_policy/pairs"] == m["train_pairs"] > 0 and m["steps"] == 2
    rows = [json.loads(line) for line in (out / "on_policy" / "train.jsonl").read_text().splitlines()]
    assert rows and all(r["chosen"] != r["rejected"] for r in rows)


def prompts_file(root: Path) -> Path:
    """Every SFT row data prep wrote, as a JSONL of prompts and answers (a user's prompt file)."""
    import pyarrow.parquet as pq

    path = root / "prompts.jsonl"
    with path.open("w") as f:
        for split in ("train", "validation", "test"):
            for r in pq.read_table(root / "data" / "data" / f"sft_{split}.parquet").to_pylist():
                prompt = [m for m in r["messages"] if m["role"] != "assistant"]
                f.write(json.dumps({"prompt": prompt, "answer": r["answer"], "task": r["task"]}) + "\n")
    return path


def _launch_sft(prepared: Path, out: Path, **kw):
    from posttrain.stages.launch import Launch

    spec = SFTConfig(output_dir=str(out), data={**DATA, "sources": [str(prepared / "data")]}, tracking=OFF,
                     launcher=LauncherConfig(nproc_per_node=2), optim={"lr": 1e-3, "warmup_steps": 1}, **kw)
    return Launch("sft", spec, spec.launcher, workdir=out.parent / f".launch-{out.name}")


@pytest.mark.slow
def test_killed_stage_resumes_from_its_checkpoint(prepared):
    out = prepared / "sft-resume"
    job = _launch_sft(prepared, out, max_steps=40, epochs=50, eval_interval=0,
                      checkpoint={"interval_steps": 2, "keep_last": 2}).start()
    deadline = time.time() + 300
    while not list((out / "checkpoints").glob("step-*")) and time.time() < deadline:
        time.sleep(0.5)
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert saved, "no checkpoint was written before the deadline"
    threading.Thread(target=job.cancel).start()
    result = job.wait()
    assert not result.ok and not (out / "manifest.json").exists()
    again = _launch_sft(prepared, out, max_steps=40, epochs=50, eval_interval=0,
                        checkpoint={"interval_steps": 2, "keep_last": 2}).start().wait()
    assert again.ok, Path(again.log_file).read_text()[-3000:]
    log = Path(again.log_file).read_text()
    assert "resumed from step" in log
    assert json.loads((out / "manifest.json").read_text())["metrics"]["steps"] == 40


@pytest.mark.slow
def test_malformed_input_fails_naming_file_and_line(prepared, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "add 1 2"}, {"role": "assistant", "content": "3"}]}
    bad.write_text(json.dumps(good) + "\n" + '{"messages": [{"role": "bot", "content": "x"}]}\n')
    from posttrain.stages.launch import Launch

    spec = SFTConfig(output_dir=str(tmp_path / "out"), tracking=OFF, launcher=LauncherConfig(nproc_per_node=2),
                     model={"name_or_path": "debug", "tokenizer": str(prepared / "data" / "tokenizer")},
                     data={**DATA, "sources": [str(bad)]}, max_steps=2)
    result = Launch("sft", spec, spec.launcher, workdir=tmp_path / ".launch").start().wait()
    assert not result.ok
    log = Path(result.log_file).read_text()
    assert "bad.jsonl line 2" in log and "messages[0].role" in log


def test_dpo_reference_model_is_a_frozen_copy_of_the_start(prepared):
    """reference='model' runs a separate frozen copy of the starting policy. With LoRA (B = 0 at
    the start) that copy computes what the adapter-disabled base computes, so both runs train
    identically; without LoRA (full fine-tuning) it is the only live reference and still works."""
    from posttrain.stages.dpo import run

    def dpo(name, **kw):
        cfg = DPOConfig(output_dir=str(prepared / name), model={"name_or_path": str(prepared / "student")},
                        data={"sources": [str(prepared / "data")], "micro_batch_size": 8}, tracking=OFF,
                        max_steps=4, eval_interval=0, optim={"lr": 5e-3, "warmup_steps": 1}, **kw)
        return run(cfg)["metrics"]

    base = dpo("dpo-ref-base", reference="disable_adapter")
    copy = dpo("dpo-ref-copy", reference="model")
    assert copy["train/loss"] == pytest.approx(base["train/loss"], rel=1e-5)
    assert copy["val/margin"] == pytest.approx(base["val/margin"], rel=1e-4, abs=1e-6)
    full = dpo("dpo-ref-full", reference="model", lora={"enabled": False}, save="full")
    assert full["val/accuracy"] >= full["val/accuracy_initial"] and full["val/margin"] > full["val/margin_initial"]


def test_training_stages_report_throughput_and_step_phases(prepared):
    """Every training stage logs tokens/s and the step-time breakdown (the skeleton's meter)."""
    m = json.loads((prepared / "student" / "manifest.json").read_text())["metrics"]
    assert m["tokens_per_s"] > 0 and m["tokens_per_s_per_device"] == m["tokens_per_s"]
    for phase in ("data", "forward_backward", "optim_step", "evaluate"):
        assert 0 < m[f"time/{phase}_frac"] < 1, phase
    assert m["time/forward_backward_frac"] + m["time/optim_step_frac"] + m["time/data_frac"] < 1.0001
    assert "mfu" not in m  # no known peak FLOP/s on a CPU


def test_mfu_is_reported_against_a_known_peak():
    import torch

    from posttrain.core.model import get_preset
    from posttrain.core.monitor import ThroughputMeter, flops_per_token

    fpt = flops_per_token(get_preset("debug"), 128)
    meter = ThroughputMeter(fpt, torch.device("cpu"), world_size=2, peak=1e12)
    meter.add_tokens(1000)
    with meter.phase("teacher"):
        pass
    out = meter.report()
    assert out["tokens_per_s"] == pytest.approx(2 * out["tokens_per_s_per_device"])
    assert out["mfu"] == pytest.approx(out["tokens_per_s_per_device"] * fpt / 1e12)
    assert 0 <= out["time/teacher_frac"] < 1
    assert meter.totals()["tokens_per_s"] < out["tokens_per_s"] * 10  # the run's totals keep counting


def test_evaluation_samples_differ_across_repetitions(prepared):
    """num_samples > 1 draws each repetition from its own seed (it reused one, repeating a sample)."""
    from posttrain.stages.config import EvalConfig
    from posttrain.stages.evaluate import run

    out = prepared / "eval-samples"
    m = run(EvalConfig(output_dir=str(out), models=[str(prepared / "student")], data=str(prepared / "data"),
                       tracking=OFF, max_examples=4, num_samples=3, pass_k=[1, 3], temperature=1.0, max_new_tokens=8))
    # data prep's test split: SFT rows (answer: exact match; completion: perplexity) and pairs
    assert {"exact_match", "pass@3", "perplexity", "preference_accuracy"} <= set(m["results"]["student"])
    samples = json.loads((out / "samples.json").read_text())
    by_prompt: dict[str, list[str]] = {}
    for s in samples:
        by_prompt.setdefault(s["prompt"], []).append(s["completion"])
    assert all(len(v) == 3 for v in by_prompt.values()) and by_prompt
    assert any(len(set(v)) > 1 for v in by_prompt.values())


def test_evaluation_refuses_model_parallel_layouts():
    from posttrain.core.config import ConfigError, load_config
    from posttrain.stages.config import EvalConfig

    with pytest.raises(ConfigError, match=r"^parallel\.ep: evaluation under pipeline parallelism \(pp=2\) splits"):
        load_config(EvalConfig, overrides=["parallel.pp=2", "parallel.ep=2"])
    assert load_config(EvalConfig, overrides=["parallel.pp=2", "parallel.dp_shard=2", "parallel.cp=2"]).parallel.cp == 2
    assert load_config(EvalConfig, overrides=["parallel.pp=2", "parallel.tp=2"]).parallel.pp == 2  # stages x tp


def test_parallel_backend_is_the_process_groups(monkeypatch):
    """ParallelConfig.backend decides the process group's backend (it was read after the group
    existed); 'nccl' without CUDA is refused before any group."""
    import torch.distributed as dist

    from posttrain.core.parallel.config import ParallelConfig
    from posttrain.core.parallel.mesh import init_process_group
    from posttrain.stages.common import StageError, start_distributed

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(StageError, match="backend='nccl' needs CUDA"):
        start_distributed(ParallelConfig(backend="nccl", device="cpu"))
    assert not dist.is_initialized()
    try:
        init_process_group(ParallelConfig(backend="gloo"), always=True)
        assert dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


def test_model_kernels_setting_reaches_the_dispatch(prepared, monkeypatch):
    """ModelConfig.kernels is what the stage's ops dispatch on (tests/kernels/test_kernels_dispatch.py shows
    that mode 'torch' keeps every op off the Triton kernels); the environment variable only acts
    where no config set it."""
    from posttrain.kernels import dispatch
    from posttrain.stages.recipe import open_session

    monkeypatch.setenv("POSTTRAIN_KERNELS", "torch")
    try:
        for setting in ("torch", "auto"):
            cfg = SFTConfig(output_dir=str(prepared / "kernels"), tracking=OFF,
                            model={"name_or_path": str(prepared / "student"), "kernels": setting},
                            data={**DATA, "sources": [str(prepared / "data")]})
            open_session("sft", cfg)
            assert dispatch.mode() == setting
    finally:
        dispatch.set_mode(None)
