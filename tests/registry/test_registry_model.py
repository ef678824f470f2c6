"""The registered model is an MLflow model (issue 15): a pyfunc LoggedModel of the parent run whose
artifacts are the HF files and tokenizer, with a signature and input example, loading with
`mlflow.pyfunc.load_model("models:/name/version")` and predicting what the project's own loader
and generate give; its lineage as links (each node's run id and digest, the parent run, the
evaluate node) and the pipeline's datasets as inputs with their digests; fetch_registered still
hands a later pipeline an HF directory it loads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

PROMPTS = ["hello", "add 12 30", "a longer prompt than the others"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    from mlflow import MlflowClient

    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.byte_tokenizer import byte_tokenizer
    from posttrain.registry.hf import save_pretrained
    from posttrain.registry.mlflow_registry import RegistryConfig, register_and_promote

    root = tmp_path_factory.mktemp("regmodel")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    model_dir = root / "student"
    model = build_model(get_preset("debug"), seed=0)
    with torch.no_grad():  # sharper than the random init: each prompt gets its own greedy text
        for p in model.parameters():
            p.mul_(4 if p.dim() == 2 else 1)
    save_pretrained(model, model_dir / "model")
    byte_tokenizer(512).save_pretrained(model_dir / "model")
    (root / "prep").mkdir()
    train, test = root / "prep" / "sft_train.parquet", root / "prep" / "sft_test.parquet"
    pd.DataFrame({"prompt": ["a", "b"], "completion": ["x", "y"]}).to_parquet(train)
    pd.DataFrame({"prompt": ["c"], "completion": ["z"]}).to_parquet(test)

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.create_experiment("posttrain", artifact_location=str(root / "artifacts"))
    parent = client.create_run(exp, run_name="pipeline").info.run_id
    runs = {n: client.create_run(exp, run_name=n, tags={"mlflow.parentRunId": parent}).info.run_id
            for n in ("student", "evaluate")}
    lineage = {"prep": "a" * 64, "student": "b" * 64, "evaluate": "c" * 64}
    datasets = [{"name": "sft_train", "path": str(train), "digest": sha256(train), "node": "prep"},
                {"name": "sft_test", "path": str(test), "digest": sha256(test), "context": "eval", "node": "prep"}]
    source = {"evaluate": "evaluate", "model_dir": str(model_dir), "model_name": "student",
              "metrics": {"exact_match": 0.25, "n": 3, "exact_match/task=copy": 0.5}, "lineage": lineage,
              "runs": {**runs, "prep": None}, "datasets": datasets, "baseline": None}
    decision = register_and_promote(RegistryConfig(model_name="tiny", baseline=None), uri, parent, source)
    mv = client.get_model_version("tiny", decision["version"])
    return SimpleNamespace(root=root, uri=uri, client=client, parent=parent, runs=runs, lineage=lineage,
                           datasets=datasets, decision=decision, mv=mv, hf=model_dir / "model",
                           model_id=mv.source.removeprefix("models:/"))


@pytest.fixture
def tracking(reg, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", reg.uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", reg.uri)
    mlflow.set_tracking_uri(reg.uri)
    mlflow.set_registry_uri(reg.uri)
    yield mlflow
    mlflow.set_tracking_uri(None)
    mlflow.set_registry_uri(None)


def direct(hf: Path, prompts: list[str], max_new_tokens: int, chat: bool = True) -> list[str]:
    """Greedy completions with the project's loader, tokenizer and generate (no MLflow): the
    prompt as a user turn through the chat template, or as plain text (no BOS/EOS here)."""
    from posttrain.core.model.generate import SamplingParams, generate
    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.tokenizer import Tokenizer

    model, tok = load_pretrained(hf).eval(), Tokenizer.from_pretrained(hf)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) if chat
           else list(p.encode()) for p in prompts]  # the byte tokenizer: one id per byte
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=tuple(tok.eos_ids))
    return [tok.decode(g.tokens, skip_special_tokens=True) for g in generate(model, ids, params, pad_id=tok.pad_id)]


def test_the_version_is_a_logged_model_with_a_signature(reg):
    from mlflow.models import Model

    assert reg.mv.source.startswith("models:/m-") and reg.mv.run_id == reg.parent
    logged = reg.client.get_logged_model(reg.mv.source.removeprefix("models:/"))
    assert logged.source_run_id == reg.parent and logged.status.to_proto() == 2  # READY
    outputs = reg.client.get_run(reg.parent).outputs.model_outputs
    assert [o.model_id for o in outputs] == [logged.model_id]
    from mlflow.artifacts import download_artifacts

    local = Path(download_artifacts(artifact_uri=reg.client.get_model_version_download_uri("tiny", reg.mv.version),
                                    dst_path=str(reg.root / "dl-sig"),
                                    tracking_uri=reg.uri))
    m = Model.load(str(local / "MLmodel"))
    sig = m.signature.to_dict()
    assert json.loads(sig["inputs"]) == [{"type": "string", "name": "prompt", "required": True}]
    assert [c["name"] for c in json.loads(sig["outputs"])] == ["completion", "finish_reason"]
    params = {p["name"]: (p["type"], p["default"]) for p in json.loads(sig["params"])}
    assert params == {"max_new_tokens": ("long", 64), "temperature": ("double", 0.0),
                      "chat_template": ("boolean", True)}
    assert "python_function" in m.flavors and m.model_id == logged.model_id
    example = json.loads((local / m.saved_input_example_info["artifact_path"]).read_text())
    assert example == {"inputs": {"columns": ["prompt"], "data": [["What is 12 + 30?"]]},
                       "params": {"max_new_tokens": 16}}
    serving = json.loads((local / "serving_input_example.json").read_text())
    assert serving["dataframe_split"]["data"] == [["What is 12 + 30?"]] and serving["params"] == {"max_new_tokens": 16}
    hf = local / "artifacts" / "hf"
    assert m.flavors["python_function"]["artifacts"]["hf"]["path"] == "artifacts/hf" and not hf.is_symlink()
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert sha256(hf / f) == sha256(reg.hf / f), f  # the HF files, unchanged
    assert (local / "code" / "posttrain" / "registry" / "mlflow_model.py").exists()  # loads without the repo


def test_pyfunc_load_and_predict_is_the_projects_greedy_generate(reg, tracking):
    model = tracking.pyfunc.load_model(f"models:/tiny/{reg.mv.version}")
    assert model.metadata.get_input_schema().input_names() == ["prompt"]
    out = model.predict(pd.DataFrame({"prompt": PROMPTS}), params={"max_new_tokens": 7})
    expected = direct(reg.hf, PROMPTS, 7)
    assert list(out["completion"]) == expected and any(expected)
    assert set(out["finish_reason"]) <= {"stop", "length"}
    plain = model.predict(pd.DataFrame({"prompt": PROMPTS}), params={"max_new_tokens": 5, "chat_template": False})
    expected_plain = direct(reg.hf, PROMPTS, 5, chat=False)
    assert list(plain["completion"]) == expected_plain and len(set(expected_plain)) == len(PROMPTS)
    default = model.predict(pd.DataFrame({"prompt": PROMPTS[1:2]}))  # max_new_tokens defaults to 64
    assert default["completion"][0].startswith(expected[1]) and len(default["completion"][0]) > len(expected[1])
    alias = tracking.pyfunc.load_model("models:/tiny@candidate")
    assert list(alias.predict(pd.DataFrame({"prompt": PROMPTS[:2]}), params={"max_new_tokens": 7})["completion"]) \
        == expected[:2]


def test_lineage_is_links_on_the_version_and_the_logged_model(reg):
    logged = reg.client.get_logged_model(reg.model_id)
    for tags in (reg.mv.tags, logged.tags):
        assert tags["lineage.parent_run_id"] == reg.parent and tags["lineage.evaluate"] == "evaluate"
        assert tags["lineage.model"] == "student" and tags["eval.exact_match"] == "0.25"
        for node, digest in reg.lineage.items():
            assert tags[f"lineage.{node}.digest"] == digest
            assert tags[f"lineage.{node}"] == (digest if node != "evaluate" else "evaluate")  # the node's name wins
        for node, run_id in reg.runs.items():
            assert tags[f"lineage.{node}.run_id"] == run_id
            assert reg.client.get_run(run_id).info.run_name == node  # a link to a real run
        assert "lineage.prep.run_id" not in tags  # a node without a run has no link
        assert tags["dataset.sft_train.digest"] == reg.datasets[0]["digest"]
    assert logged.params["evaluate"] == "evaluate" and logged.params["model"] == "student"
    assert json.loads(logged.tags["mlflow.modelVersions"]) == [{"name": "tiny", "version": reg.mv.version}]


def test_datasets_are_inputs_with_digests_and_the_metrics_are_the_models(reg):
    inputs = reg.client.get_run(reg.parent).inputs.dataset_inputs
    got = {i.dataset.name: i for i in inputs}
    assert set(got) == {"sft_train", "sft_test"}
    for ds in reg.datasets:
        i = got[ds["name"]]
        tags = {t.key: t.value for t in i.tags}
        assert i.dataset.digest == ds["digest"][:36] and tags["digest"] == ds["digest"]
        assert json.loads(i.dataset.source)["uri"] == ds["path"] and i.dataset.source_type == "local"
        assert tags["mlflow.data.context"] == ds.get("context", "training") and tags["node"] == "prep"
    metrics = {m.key: m for m in reg.client.get_logged_model(reg.model_id).metrics}
    assert metrics["registered/exact_match"].value == 0.25 and metrics["registered/n"].value == 3
    assert metrics["registered/exact_match/task_copy"].value == 0.5  # a key MLflow takes
    assert (metrics["registered/exact_match"].dataset_name, metrics["registered/exact_match"].dataset_digest) == (
        "sft_test", reg.datasets[1]["digest"][:36])


def test_fetch_registered_gives_the_hf_directory_to_load(reg):
    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.mlflow_registry import fetch_registered
    from posttrain.registry.tokenizer import Tokenizer

    local, ident = fetch_registered(reg.uri, "models:/tiny@candidate", reg.root / "cache")
    assert ident == f"tiny/v{reg.mv.version} run {reg.parent}"
    assert sha256(local / "model.safetensors") == sha256(reg.hf / "model.safetensors")
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(load_pretrained(local).eval()(ids), load_pretrained(reg.hf).eval()(ids))
    assert Tokenizer.from_pretrained(local).encode("hi") == Tokenizer.from_pretrained(reg.hf).encode("hi")
    assert fetch_registered(reg.uri, f"models:/tiny/{reg.mv.version}", reg.root / "cache")[0] == local


def test_registering_without_runs_or_datasets(reg, tmp_path):
    """The flow before it passes `runs` and `datasets`: digests only, no inputs, still a model."""
    from posttrain.registry.mlflow_registry import RegistryConfig, register_and_promote

    run = reg.client.create_run(reg.client.get_experiment_by_name("posttrain").experiment_id).info.run_id
    source = {"evaluate": "evaluate", "model_dir": str(reg.hf), "model_name": "student",
              "metrics": {"exact_match": 0.5}, "lineage": {"student": "b" * 64}, "baseline": None}
    decision = register_and_promote(RegistryConfig(model_name="tiny-plain", baseline=None), reg.uri, run, source)
    mv = reg.client.get_model_version("tiny-plain", decision["version"])
    assert mv.tags["lineage.student.digest"] == "b" * 64 and not any(k.endswith(".run_id") for k in mv.tags)
    assert reg.client.get_run(run).inputs.dataset_inputs == []
    assert reg.client.get_logged_model(mv.source.removeprefix("models:/")).status.to_proto() == 2


def test_an_adapter_is_registered_merged_into_its_base(reg, tracking):
    """A PEFT adapter directory (a LoRA stage's `adapter/`) is registered as its base with the
    adapter merged (artifact hf, the tokenizer from the base) and the adapter's own files kept
    (artifact adapter); predict is the base + adapter's greedy generate."""
    from posttrain.core.lora import apply_lora
    from posttrain.core.model.generate import SamplingParams, generate
    from posttrain.registry.adapters import load_adapter, save_adapter
    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.mlflow_registry import RegistryConfig, register_and_promote
    from posttrain.registry.tokenizer import Tokenizer

    model = load_pretrained(reg.hf)
    apply_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p, generator=torch.Generator().manual_seed(1)) * 0.5)
    stage = reg.root / "lora"
    save_adapter(model, stage / "adapter", base_model=str(reg.hf))
    run = reg.client.create_run(reg.client.get_experiment_by_name("posttrain").experiment_id).info.run_id
    source = {"evaluate": "evaluate", "model_dir": str(stage), "model_name": "lora",
              "metrics": {"exact_match": 0.5}, "lineage": {}, "baseline": None}
    decision = register_and_promote(RegistryConfig(model_name="tiny-lora", baseline=None), reg.uri, run, source)

    ours = load_pretrained(reg.hf).eval()
    load_adapter(ours, stage / "adapter")
    tok = Tokenizer.from_pretrained(reg.hf)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=tuple(tok.eos_ids))
    expected = [tok.decode(g.tokens, skip_special_tokens=True) for g in generate(ours.eval(), ids, params, tok.pad_id)]
    assert expected != direct(reg.hf, PROMPTS, 6)  # the adapter changes what the base says
    loaded = tracking.pyfunc.load_model(f"models:/tiny-lora/{decision['version']}")
    assert list(loaded.predict(pd.DataFrame({"prompt": PROMPTS}), params={"max_new_tokens": 6})["completion"]) \
        == expected
    local = Path(tracking.artifacts.download_artifacts(
        artifact_uri=reg.client.get_model_version_download_uri("tiny-lora", decision["version"]),
        dst_path=str(reg.root / "dl-lora")))
    assert {f.name for f in (local / "artifacts" / "adapter").iterdir()} == {"adapter_config.json",
                                                                            "adapter_model.safetensors"}
    assert (local / "artifacts" / "hf" / "tokenizer.json").exists()


@pytest.mark.slow
def test_serve_model_answers_with_the_registered_champion(reg, tmp_path, monkeypatch):
    """Issue 17's starting point: `posttrain serve-model models:/tiny@champion` fetches the version the
    alias names from the registry and answers the official `openai` client (chat and plain
    completions) with exactly the text of the project's greedy generate on the registered files."""
    import signal

    from tests.stages.test_serving import start_serve_model

    openai = pytest.importorskip("openai")
    assert reg.client.get_model_version_by_alias("tiny", "champion").version == reg.mv.version
    monkeypatch.delenv("POSTTRAIN_API_KEY", raising=False)
    proc, port = start_serve_model(["models:/tiny@champion", "--tracking-uri", reg.uri, "--registry-cache",
                                    str(tmp_path / "cache")], tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        [served] = [m.id for m in client.models.list().data]
        chat = [client.chat.completions.create(model=served, messages=[{"role": "user", "content": p}],
                                               max_tokens=7, temperature=0).choices[0].message.content
                for p in PROMPTS]
        assert chat == direct(reg.hf, PROMPTS, 7) and any(chat)
        plain = [client.completions.create(model=served, prompt=p, max_tokens=5, temperature=0).choices[0].text
                 for p in PROMPTS]
        assert plain == direct(reg.hf, PROMPTS, 5, chat=False)
        assert (tmp_path / "cache" / "tiny" / f"v{reg.mv.version}" / ".complete").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert f"tiny/v{reg.mv.version} run {reg.parent}" in proc.stdout.read()
