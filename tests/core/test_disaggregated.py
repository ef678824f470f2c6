"""Disaggregated generation (core/generation/remote.py, stages/generators.py): generator worker
processes beside the trainer. Checked here: after a sync the workers sample token for token (and
log-prob for log-prob) what the engine samples on the trainer's own model, full or LoRA-only sync,
requests spread over two workers, each result tagged with its weights' version; a worker SIGKILLed
while generating or between rounds is restarted and the round completes with the same samples; a
hung worker is restarted after timeout_s and, beyond max_restarts, the trainer gets a clear error;
a worker that cannot build its model fails the start naming the error. The GRPO stage with
disaggregated sampling reproduces colocated engine sampling exactly (one process, and under FSDP
over 2 gloo ranks), and with prefetch 1 round k+1's samples are one round old, reweighted as
configured, also across a worker killed mid-stage."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from posttrain.core.generation.engine import engine_generate
from posttrain.core.generation.remote import Disaggregated, GeneratorError, Request, WorkerSpec
from posttrain.core.lora import LoRAConfig, apply_lora
from posttrain.core.model import build_model, get_preset
from posttrain.core.model.generate import SamplingParams
from posttrain.stages.config import GenerationConfig, GRPOConfig

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
PARAMS = dict(max_new_tokens=6, temperature=1.0, seed=5)
LORA = LoRAConfig(enabled=True, rank=4, alpha=8, targets=["q_proj", "v_proj"])


def build(seed: int, lora: bool = False) -> torch.nn.Module:  # a worker's model (module level: picklable)
    model = build_model(get_preset("debug"), seed=seed)
    if lora:
        apply_lora(model, LORA)
    return model


def broken() -> torch.nn.Module:
    raise OSError("no checkpoint at /nowhere")


def trainer_model(lora: bool = False) -> torch.nn.Module:
    model = build(0, lora)
    torch.manual_seed(1)
    with torch.no_grad():  # weights no worker could have built itself
        for name, p in model.named_parameters():
            if not lora or "lora_" in name:
                p.add_(0.05 * torch.randn_like(p))
    return model


def reference(model, prompts=PROMPTS, n=2):
    return [(g.tokens, g.logprobs) for g in engine_generate(model, prompts, SamplingParams(**PARAMS), n=n)]


def flat(results):
    return [(g.tokens, g.logprobs) for r in results for g in r.generations]


def same(got, want) -> bool:
    """Token for token, and log-probs within float32 rounding (a worker's torch may use another
    thread count, so another summation order, than this process)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.slow
def test_workers_sample_what_the_trainer_would_and_survive_kills():
    """Full sync to 2 workers built from other weights: their samples are the trainer's engine's
    bit for bit; a worker killed mid-request and one killed between rounds are restarted and sent
    the last version, and the answers stay the same."""
    model = trainer_model()
    remote = Disaggregated(model, WorkerSpec(functools.partial(build, 7), threads=1), lead=True, workers=2,
                           timeout_s=60)
    try:
        stats = remote.sync(3)
        assert stats.bytes > 0 and stats.transport == "shm"  # workers on this host: the shared-memory ring
        want = reference(model)
        ids = remote.submit([Request(PROMPTS[:2], PARAMS, 2), Request(PROMPTS[2:], PARAMS, 2)])
        results = remote.collect(ids)
        assert [r.worker for r in results] == [0, 1] and [r.version for r in results] == [3, 3]
        assert same(flat(results), want)
        ids = remote.submit([Request(PROMPTS, PARAMS, 2)])
        remote.pool.kill(0)  # while it generates
        results = remote.collect(ids)
        assert same(flat(results), want) and results[0].version == 3
        assert remote.pool.events == ["worker 0: its process exited (exit code -9); restarted"]
        remote.pool.kill(1)
        time.sleep(0.5)
        with torch.no_grad():
            model.norm.weight.mul_(1.5)
        remote.sync(4)  # the dead worker's group fails; it is restarted and sent version 4
        assert "worker 1: weight sync failed" in remote.pool.events[-1]
        results = remote.collect(remote.submit([Request(PROMPTS, PARAMS, 2)] * 2))
        assert [r.version for r in results] == [4, 4] and same(flat(results[1:]), reference(model))
    finally:
        remote.close()
    assert all(not w.proc.is_alive() for w in remote.pool.workers)


@pytest.mark.slow
def test_lora_only_sync_moves_the_adapters_alone():
    model = trainer_model(lora=True)
    remote = Disaggregated(model, WorkerSpec(functools.partial(build, 0, True), threads=1), lead=True,
                           lora_only=True, timeout_s=60)
    try:
        stats = remote.sync(1)
        adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
        assert stats.bytes == adapters
        assert same(flat(remote.collect(remote.submit([Request(PROMPTS, PARAMS, 2)]))), reference(model))
    finally:
        remote.close()


@pytest.mark.slow
def test_a_worker_that_cannot_build_fails_the_start_naming_why():
    with pytest.raises(GeneratorError, match=r"worker 0 did not manage to build its model: raised OSError: "
                                             r"no checkpoint at /nowhere"):
        Disaggregated(build(0), WorkerSpec(broken), lead=True, timeout_s=60)


@pytest.mark.slow
def test_a_hung_worker_is_restarted_then_the_trainer_gets_an_error():
    """SIGSTOP: no answer within timeout_s, so it is killed and restarted (the request answered by
    the new one); hung again beyond max_restarts: GeneratorError, and no process is left behind."""
    model = trainer_model()
    remote = Disaggregated(model, WorkerSpec(functools.partial(build, 7), threads=1), lead=True, timeout_s=4,
                           max_restarts=1)
    remote.sync(1)
    ids = remote.submit([Request(PROMPTS, PARAMS, 2)])
    os.kill(remote.pool.workers[0].proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    assert same(flat(remote.collect(ids)), reference(model))
    assert time.monotonic() - t0 >= 4 and "no answer within timeout_s=4 s" in remote.pool.events[0]
    ids = remote.submit([Request(PROMPTS, PARAMS, 2)])
    os.kill(remote.pool.workers[0].proc.pid, signal.SIGSTOP)
    with pytest.raises(GeneratorError, match=r"generator worker 0 failed 2 times \(max_restarts=1\); last: .*"
                                             r"no answer within timeout_s=4 s"):
        remote.collect(ids)
    assert not remote.pool.workers[0].proc.is_alive()


def test_generation_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"generation.prefetch: 1 makes every sample 1 round\(s\) old, beyond "
                                         r"max_staleness 0 with stale 'drop'"):
        GenerationConfig(mode="disaggregated", prefetch=1, max_staleness=0)
    with pytest.raises(ValueError, match="generation.prefetch: overlapping sampling with training needs mode: "
                                         "disaggregated"):
        GenerationConfig(prefetch=1)
    GenerationConfig(mode="disaggregated", prefetch=1, max_staleness=0, stale="reweight")


# ------------------------------------------------------------------------------------ the stage

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from posttrain.stages.config import DataPrepConfig
    from posttrain.stages.data_prep import prepare
    from tests.stages.test_grpo import OFF

    root = tmp_path_factory.mktemp("disaggregated")
    prepare(DataPrepConfig(output_dir=str(root / "data"), synthetic_size=120, tracking=OFF))
    return root


KW = dict(max_steps=4, eval_interval=0, val_prompts=0, num_iterations=2, beta=0.04, checkpoint={"interval_steps": 0})
DIS = {"mode": "disaggregated", "workers": 2, "threads": 1}


def run(data: Path, name: str, **kw) -> tuple[dict[int, dict], list[dict]]:
    from tests.stages.test_grpo import grpo_config
    from tests.stages.test_stage_parallel import MODULES, in_process

    MODULES[GRPOConfig] = "posttrain.stages.grpo"
    records = in_process(grpo_config(data, name, **{**KW, **kw}))
    rollouts = [json.loads(x) for x in (data / name / "grpo" / "rollouts.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "grad_norm" in r}, rollouts


def assert_same_steps(a: dict, b: dict, rel: float = 0.0) -> None:
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        for key in ("loss", "grad_norm", "rewards/mean", "tokens"):
            assert b[step][key] == pytest.approx(a[step][key], rel=rel, abs=1e-6 if rel else 0), (step, key)


@pytest.mark.slow
def test_grpo_disaggregated_reproduces_colocated_engine_sampling(data):
    colocated, want = run(data, "colocated", sampler="engine")
    steps, got = run(data, "disaggregated", generation=DIS)
    assert got == want  # every round's samples, rewards and advantages
    assert_same_steps(colocated, steps)
    manifest = json.loads((data / "disaggregated" / "manifest.json").read_text())["metrics"]
    assert manifest["generation/syncs"] == 2 and manifest["generation/restarts"] == 0


@pytest.mark.slow
def test_prefetched_rounds_are_one_round_old_and_survive_a_killed_worker(data):
    """prefetch 1, max_staleness 0, stale reweight (decay 0.5): round 0 is sampled on-policy, round
    1 while round 0 trains, with its weights; so round 0 is the on-policy run's and round 1's
    advantages are half its rewards' z-scores. A worker SIGKILLed while it samples round 1 (by the
    verifier, as round 0 is scored) is restarted: the run is the unkilled one's."""
    from posttrain.core.grpo import group_advantages

    gen = {**DIS, "prefetch": 1, "max_staleness": 0, "stale": "reweight", "stale_decay": 0.5}
    _, on_policy = run(data, "on-policy", generation=DIS)
    steps, rounds = run(data, "prefetch", generation=gen)
    killed_steps, killed = run(data, "prefetch-killed", generation=gen,
                               reward="tests.support.grpo_verifiers:overlap_killing_a_generator")
    assert killed == rounds and json.loads((data / "prefetch-killed" / "manifest.json").read_text())[
        "metrics"]["generation/restarts"] == 1
    assert_same_steps(steps, killed_steps)
    by_round = {r: [x for x in rounds if x["round"] == r] for r in (0, 1)}
    assert by_round[0] == [x for x in on_policy if x["round"] == 0]
    assert [x["samples"] for x in by_round[1]] != [x["samples"] for x in on_policy if x["round"] == 1]
    for r, weight in ((0, 1.0), (1, 0.5)):
        rewards = torch.tensor([[s["reward"] for s in x["samples"]] for x in by_round[r]], dtype=torch.float64)
        got = torch.tensor([[s["advantage"] for s in x["samples"]] for x in by_round[r]], dtype=torch.float64)
        torch.testing.assert_close(got, weight * group_advantages(rewards, True))


@pytest.mark.slow
def test_fsdp_trainer_with_disaggregated_workers_reproduces_one_process(data):
    """The policy sharded over 2 gloo ranks (its LoRA adapters gathered bucket by bucket for each
    sync) and two workers: the one-process colocated engine run, step for step."""
    from tests.stages.test_grpo import grpo_config
    from tests.stages.test_stage_parallel import torchrun_stage

    one, want = run(data, "colocated-ref", sampler="engine", optim={"lr": 5e-3, "warmup_steps": 1,
                                                                   "grad_accum_steps": 2})
    cfg = grpo_config(data, "fsdp-disaggregated", parallel={"dp_shard": 2}, generation=DIS,
                      **{**KW, "optim": {"lr": 5e-3, "warmup_steps": 1, "grad_accum_steps": 1}})
    records = torchrun_stage(cfg, data / ".work-fsdp-dis", 2)
    assert_same_steps(one, {r["step"]: r for r in records if "grad_norm" in r}, rel=1e-4)
    got = [json.loads(x) for x in (data / "fsdp-disaggregated" / "grpo" / "rollouts.jsonl").read_text().splitlines()]
    assert [x["samples"][0]["tokens"] for x in got] == [x["samples"][0]["tokens"] for x in want]


# ------------------------------------------------------- on-policy DPO and GKD through the workers

def dpo_and_gkd(data: Path, generation: dict, tag: str):
    from tests.stages.test_stage_parallel import GKD, ON_POLICY, distill_config, dpo_config, optim

    dpo = dpo_config(data, f"dpo-{tag}", optim=optim(2, lr=5e-3), sampler="engine", generation=generation,
                     **ON_POLICY)
    # every micro-batch sampled: colocated, a step's two batches go through one engine call (each
    # with its own seed); the workers sample them batch by batch; the samples must not differ
    gkd = distill_config(data, f"gkd-{tag}", optim=optim(2), sampler="engine", generation=generation,
                         **{**GKD, "on_policy_ratio": 1.0})
    return dpo, gkd


@pytest.mark.slow
def test_on_policy_dpo_and_gkd_disaggregated_reproduce_colocated_engine_sampling(data):
    """On-policy DPO samples its pairs once (version 0) on two workers; GKD samples every
    micro-batch with the weights of the step being trained (a sync whenever they changed): both
    give the colocated engine's samples, pairs and steps exactly."""
    from tests.stages.test_stage_parallel import assert_same_run, in_process

    runs = {}
    for tag, generation in (("colocated", {}), ("disaggregated", DIS)):
        for cfg in dpo_and_gkd(data, generation, tag):
            runs[type(cfg).__name__, tag] = in_process(cfg)
    same = [(data / f"dpo-{t}" / "on_policy" / "train.jsonl").read_text() for t in ("colocated", "disaggregated")]
    assert same[0] == same[1]  # the same samples, rewards and pairs
    for kind, stage, val in (("DPOConfig", "dpo", ("val/accuracy",)), ("DistillConfig", "gkd", ("val/kl",))):
        assert_same_run(runs[kind, "disaggregated"], runs[kind, "colocated"], data / f"{stage}-disaggregated",
                        data / f"{stage}-colocated", val)
    dpo, gkd = (json.loads((data / f"{s}-disaggregated" / "manifest.json").read_text())["metrics"]
                for s in ("dpo", "gkd"))
    assert dpo["on_policy/generation/syncs"] == 1 and dpo["on_policy/generation/restarts"] == 0
    colocated = json.loads((data / "gkd-colocated" / "manifest.json").read_text())["metrics"]
    assert gkd["on_policy/samples"] == colocated["on_policy/samples"] > 0
    # one sync per optimizer step (4 steps of 2 micro-batches, all sampled)
    assert gkd["on_policy/generation/syncs"] == 4


def test_generation_settings_that_would_do_nothing_are_refused():
    from posttrain.stages.config import DistillConfig, DPOConfig

    with pytest.raises(ValueError, match=r"samples nothing \(pairs: offline\)"):
        DPOConfig(generation=DIS)
    with pytest.raises(ValueError, match=r"samples nothing \(mode: online\)"):
        DistillConfig(generation=DIS)
    with pytest.raises(ValueError, match="prefetch must be 0"):
        DPOConfig(pairs="on_policy", generation={**DIS, "prefetch": 1, "stale": "reweight"})
    with pytest.raises(ValueError, match="parallel.pp=2 is not supported"):
        DistillConfig(mode="on_policy", parallel={"pp": 2}, generation=DIS)


@pytest.mark.slow
def test_gkd_under_fsdp_with_disaggregated_workers_reproduces_colocated(data):
    """Two FSDP ranks, each its own data shard (and sampling seed): the lead gathers both ranks'
    prompts and seeds, the workers sample them, each rank trains on its own; the colocated engine
    run on the same data layout (DDP: the colocated engine needs the model whole on each rank),
    step for step."""
    from tests.stages.test_stage_parallel import GKD, assert_same_run, distill_config, optim, torchrun_stage

    runs = {}
    for tag, generation, parallel in (("colocated", {}, {"dp_replicate": 2}), ("disaggregated", DIS, {"dp_shard": 2})):
        cfg = distill_config(data, f"gkd-fsdp-{tag}", optim=optim(1), parallel=parallel, sampler="engine",
                             generation=generation, **GKD)
        runs[tag] = torchrun_stage(cfg, data / f".work-gkd-fsdp-{tag}", 2)
    assert_same_run(runs["disaggregated"], runs["colocated"], data / "gkd-fsdp-disaggregated",
                    data / "gkd-fsdp-colocated", ("val/kl",))
    metrics = [json.loads((data / f"gkd-fsdp-{t}" / "manifest.json").read_text())["metrics"]
               for t in ("colocated", "disaggregated")]
    assert metrics[0]["on_policy/samples"] == metrics[1]["on_policy/samples"] > 0
