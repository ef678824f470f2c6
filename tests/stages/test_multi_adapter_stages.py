"""Several adapters from a stage config (`lora.adapter_names: [a, b]`): SFT, DPO and distillation
train each adapter on its own rows in one job, export each as a PEFT adapter that loads with peft
onto the transformers model with equal logits, and as its own merged model; a run killed midway
resumes to the outputs of an uninterrupted one; FSDP over 2 gloo processes matches one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.core.tracking import TrackingConfig
from posttrain.stages.config import DataPrepConfig, DistillConfig, DPOConfig, SFTConfig

OFF = TrackingConfig(enabled=False)
LORA = {"enabled": True, "rank": 4, "alpha": 8, "adapter_names": ["a", "b"]}
ADAPTER_OF_TASK = {"copy": "a", "reverse": "a", "sort": "b", "max": "b"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The synthetic suite's rows with an `adapter` column (by task) as a user's JSONL, prepared by
    data prep (which keeps the column), and an HF base model with the tokenizer beside it."""
    import pyarrow.parquet as pq

    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.hf import save_pretrained
    from posttrain.registry.tokenizer import Tokenizer
    from posttrain.stages.data_prep import prepare

    root = tmp_path_factory.mktemp("multi")
    prepare(DataPrepConfig(output_dir=str(root / "suite"), synthetic_size=200, tracking=OFF))
    for task in ("sft", "preference"):
        with (root / f"{task}.jsonl").open("w") as f:
            for split in ("train", "validation", "test"):
                for r in pq.read_table(root / "suite" / "data" / f"{task}_{split}.parquet").to_pylist():
                    keep = ("messages",) if task == "sft" else ("prompt", "chosen", "rejected")
                    f.write(json.dumps({**{k: r[k] for k in keep}, "adapter": ADAPTER_OF_TASK[r["task"]]}) + "\n")
    prepare(DataPrepConfig(output_dir=str(root / "prep"), synthetic_size=0, tokenizer=str(root / "suite" / "tokenizer"),
                           sources=[str(root / "sft.jsonl"), str(root / "preference.jsonl")], tracking=OFF))
    save_pretrained(build_model(get_preset("debug"), seed=0), root / "base")
    Tokenizer.from_pretrained(root / "suite" / "tokenizer").save_pretrained(root / "base")
    return root


def sft_cfg(root: Path, out: str, **kw) -> SFTConfig:
    base = dict(output_dir=str(root / out), model=str(root / "base"), lora=LORA, tracking=OFF, max_steps=4,
                eval_interval=0, data={"sources": [str(root / "prep")], "batch_tokens": 512, "max_seq_len": 128},
                optim={"lr": 5e-3, "warmup_steps": 1}, checkpoint={"interval_steps": 2})
    return SFTConfig(**{**base, **kw})


def adapter_weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "adapters" / name / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def sft_run(root):
    """SFT of adapters a and b (adapter_lr for b)."""
    from posttrain.stages.sft import run

    return run(sft_cfg(root, "sft", lora={**LORA, "adapter_lr": {"b": 1e-2}}, eval_interval=4))


def test_sft_exports_each_adapter_loadable_with_peft(root, sft_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.registry.hf import load_pretrained

    out = root / "sft"
    outputs = sft_run["outputs"]
    assert outputs == {"adapter/a": "adapters/a", "adapter/b": "adapters/b", "model/a": "model-a",
                       "model/b": "model-b", "tokenizer": "tokenizer"}
    m = sft_run["metrics"]
    for name in ("a", "b"):  # each trained on its own rows, and validated on them
        assert m[f"val/loss/{name}"] < m[f"val/loss/{name}_initial"]
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name in ("a", "b"):
        assert any(t.abs().sum() > 0 for k, t in adapter_weights(out, name).items() if "lora_B" in k)
        hf = AutoModelForCausalLM.from_pretrained(root / "base", attn_implementation="sdpa")
        peft_model = PeftModel.from_pretrained(hf, out / "adapters" / name).eval()
        merged = load_pretrained(out / f"model-{name}").eval()
        with torch.no_grad():
            logits[name] = peft_model(ids).logits
            assert (logits[name] - merged(ids)).abs().max() < 1e-4
    assert (logits["a"] - logits["b"]).abs().max() > 1e-3  # two different adapters


@pytest.mark.slow  # MLflow's sqlite store takes ~15 s to create
def test_each_adapter_is_logged_and_registered_on_its_own(root):
    """Each adapter's PEFT files are artifacts of the stage's run, with per-adapter metrics; the
    registry registers one adapter's merged model (what an evaluate node of `sft:b` selects)."""
    from mlflow import MlflowClient

    from posttrain.registry.mlflow_registry import RegistryConfig, register_and_promote
    from posttrain.stages.sft import run

    uri = f"sqlite:///{root}/mlflow.db"
    manifest = run(sft_cfg(root, "tracked", max_steps=2, tracking=TrackingConfig(
        tracking_uri=uri, experiment="multi-adapter", log_every=1)))
    client = MlflowClient(tracking_uri=uri)
    run_id = manifest["mlflow_run_id"]
    for name in ("a", "b"):
        files = {Path(f.path).name for f in client.list_artifacts(run_id, f"adapters/{name}")}
        assert files == {"adapter_config.json", "adapter_model.safetensors"}
    history = client.get_metric_history(run_id, "train/tokens/b")
    assert history and all(h.value > 0 for h in history)
    assert client.get_metric_history(run_id, "train/grad_norm/a")
    # one metric scheme (posttrain.stages.recipe.run_metric_names): the objective under its own name, the
    # validation curve from step 0, no value logged twice at a step
    logged = client.get_run(run_id).data.metrics
    assert "train/sft_loss" in logged and not {"loss", "train/loss", "val/loss_initial"} & set(logged)
    val = [h.step for h in client.get_metric_history(run_id, "val/loss")]
    assert val[0] == 0 and val[-1] == 2 and len(val) == len(set(val)), val

    source = {"model_dir": str(root / "tracked" / "model-b"), "model_name": "model-b", "evaluate": "eval",
              "metrics": {"exact_match": 0.5}, "lineage": {}}
    decision = register_and_promote(RegistryConfig(model_name="adapter-b"), uri, run_id, source)
    from posttrain.registry.mlflow_registry import fetch_registered

    # registered as an MLflow model merged into its base: the HF files a later pipeline can load
    local, _ = fetch_registered(uri, f"models:/adapter-b/{decision['version']}", root / "fetched")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in local.iterdir()}


class KilledAt:
    """SFT whose training dies (as a killed job would) in the forward of step `step`."""

    def __init__(self, step: int):
        from posttrain.stages.sft import SFT

        self.inner, self.step, self.name = SFT(), step, "sft"

    def setup(self, s):
        plan = self.inner.setup(s)
        inner, calls, per_step = plan.objective, [0], s.cfg.optim.grad_accum_steps

        def objective(model, batch):
            calls[0] += 1
            if calls[0] > (self.step - 1) * per_step:
                raise RuntimeError("killed")
            return inner(model, batch)

        plan.objective = objective
        return plan


def test_killed_run_resumes_to_the_uninterrupted_outputs(root):
    """The original failure: a multi-adapter run that dies leaves checkpoints the next run resumes
    from (every adapter and its optimizer state), and it ends bit-identical to an uninterrupted run."""
    from posttrain.stages.recipe import run_training
    from posttrain.stages.sft import run

    whole = run(sft_cfg(root, "whole", max_steps=5))
    with pytest.raises(RuntimeError, match="killed"):
        run_training(KilledAt(4), sft_cfg(root, "resumed", max_steps=5))
    assert (root / "resumed" / "checkpoints").is_dir() and not (root / "resumed" / "manifest.json").exists()
    again = run(sft_cfg(root, "resumed", max_steps=5))
    assert again["metrics"]["steps"] == whole["metrics"]["steps"] == 5
    for name in ("a", "b"):
        want, got = adapter_weights(root / "whole", name), adapter_weights(root / "resumed", name)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
    assert again["files"] == whole["files"]  # merged models too, bit for bit


def test_one_adapter_of_any_name_trains_and_exports(root):
    """adapter_names: [solo] (no routing): exported as the stage's adapter/ and model/, as 'default' is."""
    from posttrain.registry.adapters import load_adapter
    from posttrain.registry.hf import load_pretrained
    from posttrain.stages.sft import run

    out = root / "solo"
    m = run(sft_cfg(root, "solo", max_steps=2, lora={**LORA, "adapter_names": ["solo"]}))
    assert {"adapter", "model", "tokenizer"} == m["outputs"].keys()
    base = load_pretrained(root / "base").eval()
    load_adapter(base, out / "adapter")
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (base(ids) - load_pretrained(out / "model").eval()(ids)).abs().max() < 1e-4


def test_rows_map_to_adapters_by_source(root, tmp_path):
    """adapter_sources: every row of a.jsonl trains a, of b.jsonl b (no column needed)."""
    from posttrain.stages.sft import run

    rows = [json.loads(line) for line in (root / "sft.jsonl").read_text().splitlines()]
    for name in ("a", "b"):
        with (tmp_path / f"{name}.jsonl").open("w") as f:
            for r in rows:
                if r["adapter"] == name:
                    f.write(json.dumps({"messages": r["messages"]}) + "\n")
    sources = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    cfg = sft_cfg(root, "by-source", max_steps=2, model={"name_or_path": str(root / "base")},
                  lora={**LORA, "adapter_sources": {"a": sources[0], "b": sources[1]}},
                  data={"sources": sources, "batch_tokens": 512, "max_seq_len": 128})
    m = run(cfg)["metrics"]
    assert m["val/loss/a"] > 0 and m["val/loss/b"] > 0


def test_dpo_and_distillation_train_several_adapters(root, sft_run):
    from posttrain.stages.distill import run as distill
    from posttrain.stages.dpo import run as dpo

    common = dict(model=str(root / "base"), lora=LORA, tracking=OFF, max_steps=3, eval_interval=0,
                  optim={"lr": 5e-3, "warmup_steps": 1})
    d = dpo(DPOConfig(output_dir=str(root / "dpo"), data={"sources": [str(root / "prep")], "micro_batch_size": 8},
                      **common))
    k = distill(DistillConfig(output_dir=str(root / "kd"), teacher=str(root / "sft" / "model-a"),
                              data={"sources": [str(root / "prep")], "batch_tokens": 512, "max_seq_len": 128},
                              **common))
    for out, manifest in ((root / "dpo", d), (root / "kd", k)):
        assert {"adapter/a", "adapter/b", "model/a", "model/b"} <= manifest["outputs"].keys()
        for name in ("a", "b"):
            assert any(t.abs().sum() > 0 for key, t in adapter_weights(out, name).items() if "lora_B" in key)
    assert 0 <= d["metrics"]["val/accuracy"] <= 1 and k["metrics"]["val/kl"] < k["metrics"]["val/kl_initial"]
    for name in ("a", "b"):  # each adapter validated on its own held-out data too
        assert 0 <= d["metrics"][f"val/accuracy/{name}"] <= 1 and k["metrics"][f"val/kl/{name}"] > 0
        assert k["metrics"][f"val/kl/{name}"] < k["metrics"][f"val/kl/{name}_initial"]
    # the overall figures are the per-adapter ones weighted by their pairs / tokens
    lo, hi = sorted(d["metrics"][f"val/margin/{n}"] for n in ("a", "b"))
    assert lo - 1e-9 <= d["metrics"]["val/margin"] <= hi + 1e-9


@pytest.mark.parametrize("kw,key", [
    (dict(lora={**LORA, "adapter_sources": {"a": "nowhere.jsonl"}}), "lora"),
    (dict(lora={**LORA, "adapter_lr": {"c": 1e-3}}), "lora"),
    (dict(lora={**LORA, "modules_to_save": ["embed_tokens"]}), "lora"),
])
def test_what_several_adapters_cannot_do_is_refused_at_load(root, kw, key):
    with pytest.raises(ValueError, match=key):
        SFTConfig.model_validate({**sft_cfg(root, "x").model_dump(mode="json"), **kw})
    with pytest.raises(ValueError, match="on_policy"):
        DPOConfig(lora=LORA, pairs="on_policy", data={"sources": [str(root / "prep")]})


def test_a_downstream_node_names_one_adapter(root, sft_run):
    """`sft:a` in a pipeline is adapter a merged into the base (what the registry then registers)."""
    from posttrain.flows.config import PipelineConfig
    from posttrain.flows.dag import PipelineDAG, Upstream

    cfg = PipelineConfig.model_validate({"name": "p", "workspace": str(root / "ws"), "nodes": {
        "sft": {"kind": "sft", "model": str(root / "base"), "data": str(root / "prep"), "lora": LORA},
        "eval": {"kind": "evaluate", "models": ["sft:b", "sft:a"], "data": str(root / "prep")}}})
    dag = PipelineDAG(cfg)
    spec = dag.spec("eval", {"sft": Upstream(str(root / "sft"), sft_run["digest"])})
    assert spec.models == [str(root / "sft" / "model-b"), str(root / "sft" / "model-a")]
    with pytest.raises(ValueError, match="names adapter 'c'"):
        PipelineDAG(PipelineConfig.model_validate({"name": "p", "workspace": str(root / "ws"), "nodes": {
            "sft": {"kind": "sft", "model": str(root / "base"), "data": str(root / "prep"), "lora": LORA},
            "eval": {"kind": "evaluate", "models": ["sft:c"], "data": str(root / "prep")}}}))


# ------------------------------------------------------------------------------------- FSDP, TP


# name -> (its layout on 2 ranks, micro-batches a step): one process takes 2 micro-batches a step
SEVERAL_LAYOUTS = {
    "fsdp": ({"dp_shard": 2}, 1),
    "tp_sp": ({"tp": 2, "sequence_parallel": True}, 2),
    "cp": ({"cp": 2}, 2),  # each document's adapter ids cut over the ring with its tokens
    "pp": ({"pp": 2}, 2),  # the ids laid out as the pipeline's rows, each stage routing its microbatch's
}


def several_cfg(root: Path, name: str, layout: str, accum: int, **kw) -> SFTConfig:
    """3 steps of the two adapters, data shaped for `layout` (pipeline parallelism: fixed rows)."""
    data = {"sources": [str(root / "prep")], "max_seq_len": 128,
            **({"batch_tokens": None, "micro_batch_size": 2} if layout == "pp" else {"batch_tokens": 512})}
    return sft_cfg(root, name, max_steps=3, optim={"lr": 1e-3, "warmup_steps": 1, "grad_accum_steps": accum},
                   tracking=TrackingConfig(enabled=False, log_every=1), checkpoint={"interval_steps": 0},
                   data=data, **kw)


@pytest.fixture(scope="module")
def launched(root, request):
    """The asked-for layouts of SEVERAL_LAYOUTS in one torchrun launch of 2 ranks, one stage after
    another (tests.stages.test_stage_parallel.torchrun_batch)."""
    from tests.stages.test_stage_parallel import Launched, asked_for, torchrun_batch

    wanted = asked_for(request, SEVERAL_LAYOUTS)
    configs = {n: several_cfg(root, n, n, SEVERAL_LAYOUTS[n][1], parallel=SEVERAL_LAYOUTS[n][0]) for n in wanted}
    return Launched(torchrun_batch(configs, 2, root / ".work-batch") if configs else {})


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SEVERAL_LAYOUTS))
def test_several_adapters_under_torchrun_match_one_process(root, launched, layout):
    """2 gloo processes (FSDP dp_shard=2, TP + sequence parallelism, CP or PP) against one process
    with as many micro-batches per step: every step's loss, each adapter's tokens and gradient
    norm, and each exported adapter agree."""
    from tests.stages.test_stage_parallel import close, in_process, steps_of

    records = in_process(several_cfg(root, f"one-{layout}", layout, 2))
    par_records = launched[layout]
    ref, par = steps_of(records), steps_of(par_records)
    assert sorted(par) == sorted(ref) == [1, 2, 3]
    for step in ref:
        for name in ("a", "b"):
            assert par[step][f"tokens/{name}"] == ref[step][f"tokens/{name}"]
        for key in ("loss", "grad_norm/a", "grad_norm/b"):
            assert close(par[step][key], ref[step][key]), (step, key, par[step][key], ref[step][key])
    for name in ("a", "b"):
        want, got = adapter_weights(root / f"one-{layout}", name), adapter_weights(root / layout, name)
        assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-4, name
