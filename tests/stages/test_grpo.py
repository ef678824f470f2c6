"""GRPO: the per-token loss against the formulas written out here and against TRL's GRPOTrainer
loss on the same tensors (values and gradients, each loss_type, with and without clipping and the
KL term), group advantages, the config's checks, the pipeline node kind, and the stage run end to
end on the demo's verifiable data (in this process; and under torchrun with FSDP or TP over 2 gloo
ranks, which must reproduce the one-process steps, and resume bit-exact after a kill)."""

from __future__ import annotations

import json
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.core.grpo import LOSS_TYPES, group_advantages, grpo_token_loss, reduce_loss, zero_std_share
from posttrain.core.tracking import TrackingConfig
from posttrain.stages.config import DataPrepConfig, GRPOConfig

OFF = TrackingConfig(enabled=False, log_every=1)
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ the loss

def tensors(seed: int = 0, B: int = 4, T: int = 6, spread: float = 0.5):
    """logps (requires grad), old and reference log-probs, a completion mask, per-sequence advantages."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logps = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.tensor([T, T - 2, 1, T - 1])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logps, old, ref, mask, adv


def direct(logps, old, ref, mask, adv, loss_type, eps, eps_high, beta, max_len):
    """The formulas, written out token by token (plain Python loops over sequences)."""
    B, T = logps.shape
    seq_losses, total, count = [], 0.0, 0
    for b in range(B):
        terms = []
        for t in range(T):
            if not mask[b, t]:
                continue
            rho = torch.exp(logps[b, t] - old[b, t])
            a = adv[b]
            term = -torch.min(rho * a, torch.clamp(rho, 1 - eps, 1 + eps_high) * a)
            if beta:
                x = ref[b, t] - logps[b, t]
                term = term + beta * (torch.exp(x) - x - 1)
            terms.append(term)
        s = sum(terms)
        seq_losses.append(s / max(len(terms), 1))
        total = total + s
        count += len(terms)
    if loss_type == "grpo":
        return sum(seq_losses) / B
    if loss_type in ("bnpo", "dapo"):
        return total / count
    return total / (B * max_len)


def ours(logps, old, ref, mask, adv, loss_type, eps, eps_high, beta, max_len):
    B, T = logps.shape
    per_token, clipped, kl = grpo_token_loss(logps, old, adv[:, None], ref, eps, eps_high, beta)
    seq = torch.arange(B)[:, None].expand(B, T)
    loss_sum, n = reduce_loss(per_token, mask, seq, B, loss_type, max_len)
    return loss_sum / n, clipped, kl


def trl_loss(logps, old, ref, mask, adv, loss_type, eps, eps_high, beta, max_len):
    """TRL's GRPOTrainer._compute_loss on these tensors: a stand-in trainer whose policy forward
    returns `logps` (one process, no accumulation, token-level importance sampling)."""
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    B, T = logps.shape
    ident = lambda x, **kw: x  # noqa: E731
    fake = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1), loss_type=loss_type,
        epsilon_low=eps, epsilon_high=eps_high, use_vllm=False, vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_len, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        accelerator=types.SimpleNamespace(gather=ident, reduce=ident, gather_for_metrics=ident, num_processes=1),
        _metrics=defaultdict(lambda: defaultdict(list)))
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps.detach()), None)
    inputs = {"prompt_ids": torch.zeros(B, 0, dtype=torch.long), "prompt_mask": torch.zeros(B, 0, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    loss = trl.GRPOTrainer._compute_loss(fake, None, inputs)
    return loss, fake._metrics["train"]


CASES = [(lt, eps, eps_high, beta) for lt in LOSS_TYPES
         for eps, eps_high, beta in [(0.2, 0.2, 0.0), (0.2, 0.28, 0.04)]]


@pytest.mark.parametrize("loss_type,eps,eps_high,beta", CASES)
def test_loss_matches_the_formula_and_trl(loss_type, eps, eps_high, beta):
    logps, old, ref, mask, adv = tensors()
    args = (old, ref, mask, adv, loss_type, eps, eps_high, beta, 6)
    results = {}
    for name, fn in [("ours", ours), ("direct", direct), ("trl", trl_loss)]:
        x = logps.detach().clone().requires_grad_(True)
        out = fn(x, *args)
        loss = out[0] if isinstance(out, tuple) else out
        (grad,) = torch.autograd.grad(loss, x)
        results[name] = (loss.detach(), grad, out)
    for name in ("direct", "trl"):
        torch.testing.assert_close(results["ours"][0], results[name][0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(results["ours"][1], results[name][1], rtol=1e-10, atol=1e-12)
    # the spread of 0.5 in log space puts ratios outside the clip range: some tokens are clipped
    _, clipped, kl = results["ours"][2]
    trl_metrics = results["trl"][2][1]
    assert clipped[mask].any()
    assert float(clipped[mask].double().mean()) == pytest.approx(trl_metrics["clip_ratio/region_mean"][0])
    if beta:
        assert float((kl.detach() * mask).sum() / mask.sum()) == pytest.approx(trl_metrics["kl"][0])


def test_ratio_one_is_the_policy_gradient():
    """One step per round: old = the policy's own log-probs, detached; the loss is -A per token
    and its gradient -A (dapo: / tokens), nothing clipped."""
    logps, _, _, mask, adv = tensors()
    per_token, clipped, _ = grpo_token_loss(logps, logps.detach(), adv[:, None])
    loss_sum, n = reduce_loss(per_token, mask, torch.arange(4)[:, None].expand(4, 6), 4, "dapo", 6)
    (grad,) = torch.autograd.grad(loss_sum / n, logps)
    torch.testing.assert_close(grad, (-adv[:, None] * mask / mask.sum()).expand_as(grad))
    assert not clipped.any()


def test_clipped_tokens_get_no_gradient():
    """num_iterations > 1: where the ratio left the clip range in the direction the advantage
    pushes, the token's gradient is 0; elsewhere it is -A rho."""
    old = torch.zeros(1, 4, dtype=torch.float64)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]], dtype=torch.float64)).requires_grad_(True)
    for a, want_clipped in [(1.0, [True, False, False, False]), (-1.0, [False, True, False, False])]:
        per_token, clipped, _ = grpo_token_loss(logps, old, torch.tensor(a, dtype=torch.float64), epsilon=0.2,
                                                epsilon_high=0.28)
        (grad,) = torch.autograd.grad(per_token.sum(), logps)
        assert clipped[0].tolist() == want_clipped
        rho = torch.exp(logps.detach())
        expect = torch.where(clipped, torch.zeros_like(rho), -a * rho)
        torch.testing.assert_close(grad, expect)
    # clip-higher: a ratio of 1.25 is clipped under epsilon_high=0.2, not under 0.28
    x = torch.log(torch.tensor([[1.25]], dtype=torch.float64))
    assert grpo_token_loss(x, torch.zeros(1, 1), torch.tensor(1.0), 0.2, 0.2)[1].all()
    assert not grpo_token_loss(x, torch.zeros(1, 1), torch.tensor(1.0), 0.2, 0.28)[1].any()


def test_kl_term_is_k3_and_zero_at_the_reference():
    logps, _, ref, mask, adv = tensors()
    zero_adv = torch.zeros_like(adv)[:, None]
    per_token, _, kl = grpo_token_loss(logps, logps.detach(), zero_adv, ref, beta=0.5)
    x = ref - logps.detach()
    torch.testing.assert_close(kl.detach(), torch.exp(x) - x - 1)
    torch.testing.assert_close(per_token.detach(), 0.5 * kl.detach())
    assert (kl >= 0).all()
    (grad,) = torch.autograd.grad(per_token.sum(), logps)
    torch.testing.assert_close(grad, 0.5 * (1 - torch.exp(x)))  # d/dl [e^(r-l) - (r-l) - 1]
    _, _, at_ref = grpo_token_loss(ref, ref, zero_adv, ref, beta=0.5)
    assert at_ref.abs().max() == 0
    with pytest.raises(ValueError, match="reference"):
        grpo_token_loss(logps, logps, zero_adv, None, beta=0.1)


def test_group_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 3.0]])
    a = group_advantages(r)
    for g in range(3):
        want = (r[g] - r[g].mean()) / (r[g].std() + 1e-4)
        torch.testing.assert_close(a[g].float(), want)
    assert a[1].abs().max() == 0  # all-equal rewards teach nothing
    torch.testing.assert_close(group_advantages(r, scale=False).float(), r - r.mean(-1, keepdim=True))
    assert zero_std_share(r) == pytest.approx(1 / 3)
    assert zero_std_share(torch.ones(2, 4)) == 1.0
    # TRL's group normalization (scale_rewards="group"): its nan-aware std, the same epsilon
    utils = pytest.importorskip("trl.trainer.utils")
    trl_adv = (r - r.mean(1, keepdim=True)) / (utils.nanstd(r, dim=1, keepdim=True) + 1e-4)
    torch.testing.assert_close(a.float(), trl_adv)


# ------------------------------------------------------------------------------------- config

def test_config_errors_name_the_key(tmp_path):
    from posttrain.core.config import ConfigError, load_config

    for bad, key in [({"num_generations": 1}, "num_generations: "),
                     ({"epsilon": 0.2, "epsilon_high": 0.1}, "epsilon_high: "),
                     ({"loss_type": "ppo"}, "loss_type: "),
                     ({"parallel": {"pp": 2}}, "parallel.pp: "),
                     ({"prompts_per_step": 3, "num_generations": 3, "optim": {"grad_accum_steps": 2}},
                      "optim.grad_accum_steps: "),
                     ({"lora": {"enabled": True, "adapter_names": ["a", "b"]}}, "lora: ")]:
        path = tmp_path / "grpo.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError) as e:
            load_config(GRPOConfig, path)
        assert str(e.value).startswith(key), (bad, str(e.value))
    cfg = GRPOConfig()
    assert (cfg.beta, cfg.epsilon, cfg.loss_type, cfg.scale_rewards, cfg.num_iterations) == (0.0, 0.2, "dapo", True, 1)


def pipeline_nodes(**grpo) -> dict:
    return {"prep": {"kind": "data_prep", "synthetic_size": 50},
            "sft": {"kind": "sft", "model": "debug", "data": "prep"},
            "rl": {"kind": "grpo", "model": "sft", "data": "prep", **grpo},
            "eval": {"kind": "evaluate", "models": ["rl", "sft"], "data": "prep"}}


def test_grpo_is_a_pipeline_node_kind(tmp_path):
    from posttrain.core.config import ConfigError, load_config
    from posttrain.flows.config import PipelineConfig
    from posttrain.flows.dag import PipelineDAG
    from posttrain.flows.form import form_schema, summary

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"nodes": pipeline_nodes(num_generations=4), "workspace": str(tmp_path)}))
    cfg = load_config(PipelineConfig, path)
    dag = PipelineDAG(cfg)
    assert dag.kind("rl") == "grpo" and set(dag.inputs("rl")) == {"sft", "prep"}
    assert [e.role for e in dag.nodes["rl"].edges if e.src == "sft"] == ["model"]
    schema = form_schema(cfg)
    assert schema["definitions"]["PipelineConfig"]["properties"]["nodes"]["properties"]["rl"]["title"] == "rl (GRPO)"
    props = schema["definitions"]["GRPONode"]["properties"]
    assert props["num_generations"]["title"] == "Number of generations" and props["epsilon_high"]["title"]
    assert "| rl | grpo | sft |" in summary(cfg)
    path.write_text(yaml.safe_dump({"nodes": pipeline_nodes(epsilon_high=0.1)}))
    with pytest.raises(ConfigError, match="nodes.rl.*epsilon_high: 0.1 is below epsilon"):
        load_config(PipelineConfig, path)
    example = load_config(PipelineConfig, ROOT / "configs" / "grpo.yaml")
    assert [n.kind for n in example.nodes.values()].count("grpo") == 1


def test_the_cli_knows_the_stage():
    from posttrain.flows.cli import build_parser
    from posttrain.stages.config import STAGE_CONFIGS

    assert STAGE_CONFIGS["grpo"] is GRPOConfig
    assert build_parser().parse_args(["stage", "grpo"]).name == "grpo"


# ------------------------------------------------------------------------------------ the stage

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from posttrain.stages.data_prep import prepare

    root = tmp_path_factory.mktemp("grpo")
    prepare(DataPrepConfig(output_dir=str(root / "data"), synthetic_size=120, tracking=OFF))
    return root


def grpo_config(root: Path, name: str, **kw) -> GRPOConfig:
    base = dict(output_dir=str(root / name), tracking=OFF, model="debug",
                data={"sources": [str(root / "data")], "max_seq_len": 128}, reward="tests.support.grpo_verifiers:overlap",
                prompts_per_step=4, num_generations=4, max_new_tokens=8, max_steps=4, eval_interval=2,
                val_prompts=8, optim={"lr": 5e-3, "warmup_steps": 1, "grad_accum_steps": 2},
                checkpoint={"interval_steps": 0})
    return GRPOConfig(**{**base, **kw})


def test_stage_runs_end_to_end(data):
    """Clipped updates (2 optimizer steps per round) with a KL to the LoRA base: every step logs the
    rollout and loss metrics, the stage writes its model, adapter, rollouts and manifest."""
    from tests.stages.test_stage_parallel import MODULES, in_process

    MODULES[GRPOConfig] = "posttrain.stages.grpo"
    records = in_process(grpo_config(data, "grpo", num_iterations=2, beta=0.04, loss_type="grpo"))
    steps = {r["step"]: r for r in records if "grad_norm" in r}
    assert sorted(steps) == [1, 2, 3, 4]
    for r in steps.values():
        for key in ("loss", "rewards/mean", "rewards/std", "rewards/zero_std_frac", "clip_fraction", "kl",
                    "completions/mean_length"):
            assert key in r, (key, r)
        assert 0 <= r["rewards/zero_std_frac"] <= 1 and r["kl"] >= 0
    # each round's first step is at its sampling policy (ratio 1, KL 0: LoRA B starts at zero); its second is not
    assert steps[1]["clip_fraction"] == 0 and steps[1]["kl"] == pytest.approx(0, abs=1e-9)
    assert steps[2]["kl"] > 0
    assert steps[1]["rewards/mean"] == steps[2]["rewards/mean"]  # the same samples, twice
    out = data / "grpo"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "grpo" and manifest["metrics"]["steps"] == 4
    assert {"model", "adapter", "tokenizer"} <= set(manifest["outputs"])
    assert "val/reward" in manifest["metrics"] and "val/reward_initial" in manifest["metrics"]
    rounds = [json.loads(line) for line in (out / "grpo" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rounds) == 2 * 4 and all(len(r["samples"]) == 4 for r in rounds)  # 2 rounds x 4 prompts
    for r in rounds:  # advantages sum to ~0 within each group
        assert abs(sum(s["advantage"] for s in r["samples"])) < 1e-6


def test_a_users_prompt_file(data, tmp_path):
    """Prompts-only rows in a user's JSONL (chat prompts with answers, exact match): the file's
    rows split by hash into training and validation prompts, as on-policy DPO reads them."""
    from posttrain.core.tasks import make_suite
    from posttrain.stages.grpo import run

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": e.prompt}], "answer": e.answer}) + "\n"
                            for e in make_suite(80, seed=3)))
    cfg = grpo_config(data, "grpo-user", data={"sources": [str(path)], "max_seq_len": 128, "val_fraction": 0.1},
                      model={"name_or_path": "debug", "tokenizer": str(data / "data" / "tokenizer")},
                      reward="exact_match", max_steps=2)
    m = run(cfg)["metrics"]
    assert m["steps"] == 2 and "val/reward" in m and m["grpo/train_prompts"] < 80
    assert (data / "grpo-user" / "grpo" / "rollouts.jsonl").exists()


def test_bad_rewards_stop_the_stage_naming_them(data):
    from posttrain.stages.common import StageError
    from posttrain.stages.grpo import run

    with pytest.raises(StageError, match=r"^grpo: reward: verifier 'tests.nope:f': cannot import"):
        run(grpo_config(data, "grpo-bad", reward="tests.nope:f"))
    with pytest.raises(StageError, match=r"^grpo: .*row \d+: verifier 'tests.support.eval_verifiers:broken' returned"):
        run(grpo_config(data, "grpo-bad", reward="tests.support.eval_verifiers:broken"))


def test_engine_sampler(data):
    """sampler='engine' (the paged-KV engine, one process): the stage trains on its groups, and its
    greedy validation answers are the static sampler's (the same initial val/reward)."""
    from tests.stages.test_stage_parallel import MODULES, in_process

    MODULES[GRPOConfig] = "posttrain.stages.grpo"
    kw = dict(max_steps=2, eval_interval=0, val_prompts=8, checkpoint={"interval_steps": 0})
    runs = {s: in_process(grpo_config(data, f"grpo-{s}", sampler=s, **kw)) for s in ("engine", "static")}
    initial = {s: next(r["val/reward_initial"] for r in recs if "val/reward_initial" in r) for s, recs in runs.items()}
    assert initial["engine"] == pytest.approx(initial["static"])
    # greedy: token for token the same completions from both samplers
    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.tokenizer import Tokenizer
    from posttrain.stages.grpo import sample_chunk

    model = build_model(get_preset("debug"), seed=0)
    tok = Tokenizer.from_pretrained(data / "data" / "tokenizer")
    prompts = [tok.encode(t) for t in ("sort 3 1 2", "copy a b c d", "max 7 2")]
    greedy = dict(max_new_tokens=8, temperature=0.0)
    got = {s: sample_chunk(types.SimpleNamespace(tok=tok, model=model, cfg=types.SimpleNamespace(sampler=s)),
                           prompts, 2, greedy, seed=1) for s in ("engine", "static")}
    assert got["engine"] == got["static"] and all(len(c) == 8 or c[-1] in tok.eos_ids for cs in got["engine"]
                                                  for c in cs)
    steps = [r for r in runs["engine"] if "grad_norm" in r]
    assert len(steps) == 2 and all(0 < r["completions/mean_length"] <= 8 for r in steps)
    rounds = [json.loads(line) for line in (data / "grpo-engine" / "grpo" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rounds) == 2 * 4 and all(len(r["samples"]) == 4 for r in rounds)


# two steps per round: a round's second step is off the sampling policy (ratio, clip, KL to the base)
PARALLEL = dict(max_steps=4, eval_interval=0, loss_type="dapo", num_iterations=2, beta=0.04, epsilon_high=0.28,
                val_prompts=0)


def fsdp_config(data: Path, name: str, **kw) -> GRPOConfig:
    return grpo_config(data, name, parallel={"dp_shard": 2}, optim={"lr": 5e-3, "warmup_steps": 1,
                                                                    "grad_accum_steps": 1}, **PARALLEL, **kw)


@pytest.fixture(scope="module")
def fsdp_run(data):
    from tests.stages.test_stage_parallel import MODULES, torchrun_stage

    MODULES[GRPOConfig] = "posttrain.stages.grpo"
    return torchrun_stage(fsdp_config(data, "grpo-fsdp"), data / ".work-grpo-fsdp", 2)


@pytest.fixture(scope="module")
def one_process(data):
    from tests.stages.test_stage_parallel import MODULES, in_process

    MODULES[GRPOConfig] = "posttrain.stages.grpo"
    return in_process(grpo_config(data, "grpo-ref", **PARALLEL))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_two_ranks_reproduce_one_process(data, one_process, layout, request):
    """FSDP over 2 gloo ranks (1 micro-batch each), or TP over 2 (the pair decodes and trains on
    the same rows, 2 micro-batches), = one process with 2 micro-batches: the same samples (seeded by
    chunk, whoever samples it), the same batches, the same per-step loss and gradient norm. (kl and
    clip_fraction are rank 0's micro-batches' own, so not compared.)"""
    from tests.stages.test_stage_parallel import torchrun_stage

    if layout == "fsdp":
        records = request.getfixturevalue("fsdp_run")
    else:
        records = torchrun_stage(grpo_config(data, "grpo-tp", parallel={"tp": 2}, **PARALLEL), data / ".work-grpo-tp", 2)
    a = {r["step"]: r for r in one_process if "grad_norm" in r}
    b = {r["step"]: r for r in records if "grad_norm" in r}
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert abs(a[2]["loss"]) > 1e-3 and a[2]["kl"] > 0
    for step in a:
        assert b[step]["tokens"] == a[step]["tokens"], step
        assert b[step]["rewards/mean"] == pytest.approx(a[step]["rewards/mean"], rel=1e-9)
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-4, abs=1e-6), step
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4, abs=1e-6), step
    same = [(data / d / "grpo" / "rollouts.jsonl").read_text() for d in ("grpo-ref", f"grpo-{layout}")]
    assert same[0] == same[1]


@pytest.mark.slow
def test_killed_at_a_round_boundary_resumes_bit_exact(data, fsdp_run):
    """Killed right after the step-2 checkpoint (the end of round 0), started again: round 1 is
    sampled with the restored policy and seed, and the exported weights are bitwise the
    uninterrupted run's."""
    from tests.stages.test_stage_parallel import assert_resume_is_bit_exact

    assert_resume_is_bit_exact(fsdp_config(data, "grpo-fsdp"), data / "grpo-fsdp", 2)
    rollouts = [(data / d / "grpo" / "rollouts.jsonl").read_text() for d in ("grpo-fsdp", "grpo-fsdp-resumed")]
    assert rollouts[0] == rollouts[1]
