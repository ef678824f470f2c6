"""The deployments' run form (flows/form.py): human titles, one section per node with the everyday
knobs first, no serve-time fields, "(Optional)" only where a value may be left out, the DAG summary
in the description; the form's schema still accepts the served config and gives it back unchanged,
the Prefect server refuses a value the schema rules out when the run is created, and a cross-field
error (which JSON schema cannot express) fails the run at once naming the key path."""

from __future__ import annotations

import copy
import json
import re
import time

import pytest

from posttrain.core.config import load_config
from posttrain.core.titles import field_title, model_title
from posttrain.flows.config import PipelineConfig
from posttrain.flows.form import SERVE_ONLY, form_schema, run_parameters, summary
from tests.support.pipelines import DEMO_CONFIG


@pytest.fixture(scope="module")
def cfg() -> PipelineConfig:
    return load_config(PipelineConfig, DEMO_CONFIG)


@pytest.fixture(scope="module")
def schema(cfg) -> dict:
    return form_schema(cfg)


def generic_schema() -> dict:
    from prefect.utilities.callables import parameter_schema

    from posttrain.flows.pipeline import post_training

    return parameter_schema(post_training.fn).model_dump()


def titles(node) -> list[str]:
    if isinstance(node, dict):
        return ([node["title"]] if isinstance(node.get("title"), str) else []) + \
            [t for v in node.values() for t in titles(v)]
    if isinstance(node, list):
        return [t for v in node for t in titles(v)]
    return []


def ordered(definition: dict) -> list[str]:
    return [k for k, _ in sorted(definition["properties"].items(), key=lambda kv: kv[1].get("position", 0))]


PYDANTIC_STYLE = re.compile(r"\b(Sft|Dpo|Kd|Gkd|Lora|Qlora|Mlflow|Fsdp|Hsdp|Tp|Pp|Cp|Ep|Kv|Nf4|Gpus?|Cpus?|Uri|Id|Lr)\b"
                            r"| S$|^(Optim|Parallel)$")


def test_the_title_rules():
    assert field_title("sft_teacher") == "SFT teacher"
    assert field_title("dpo") == "DPO"
    assert field_title("lora") == "LoRA"
    assert field_title("lr") == "Learning rate"
    assert field_title("tp") == "Tensor parallel (tp)"
    assert field_title("lock_wait_s") == "Lock wait (s)"
    assert field_title("tracking_uri") == "Tracking URI"
    assert field_title("gpus") == "GPUs"
    assert field_title("num_samples") == "Number of samples"

    class LoRAConfig:
        pass

    class DPONode:
        pass

    assert (model_title(LoRAConfig), model_title(DPONode)) == ("LoRA", "DPO node")


@pytest.mark.parametrize("which", ["form", "flow"])
def test_titles_are_human(schema, which):
    found = titles(schema if which == "form" else generic_schema())
    assert len(found) > 200
    assert [t for t in found if PYDANTIC_STYLE.search(t)] == []
    assert PYDANTIC_STYLE.search("Sft Teacher") and PYDANTIC_STYLE.search("Lock Wait S")  # the check can fail
    d = schema["definitions"]
    assert d["SFTNode"]["properties"]["lora"]["title"] == "LoRA"
    assert d["OptimConfig"]["properties"]["lr"]["title"] == "Learning rate"
    assert d["ParallelConfig"]["properties"]["tp"]["title"] == "Tensor parallel (tp)"
    assert d["TrackingConfig"]["title"] == "Tracking"


def not_required(schema: dict) -> list[str]:
    """Properties the V1/V2 form titles "... (Optional)": not in their parent's `required`."""
    out = []
    for name, d in schema["definitions"].items():
        out += [f"{name}.{p}" for p in d.get("properties", {}) if p not in d.get("required", [])]
    return out


def test_optional_is_left_only_on_lists_and_mappings(schema):
    defs = schema["definitions"]
    optional = not_required(schema)
    for path in optional:
        name, prop = path.split(".")
        p = defs[name]["properties"][prop]
        types = {(defs[v["$ref"].rsplit("/", 1)[-1]] if "$ref" in v else v).get("type")
                 for v in p.get("anyOf", [p])}
        free = any(v.get("type") == "object" and not v.get("properties") for v in p.get("anyOf", [p]))
        assert "array" in types or free, f"{path} is shown as (Optional)"
    # Nullable scalars (the None tab submits null) and sections are required: no "(Optional)".
    assert "tokenizer" in defs["ModelConfig"]["required"] and "max_steps" in defs["SFTNode"]["required"]
    assert "lora" in defs["SFTNode"]["required"]
    # pydantic's schema marks none of those: the flow's own schema has "(Optional)" on nearly all.
    raw = not_required(generic_schema())
    assert len(raw) > 3 * len(optional) and "ModelConfig.tokenizer" in raw


@pytest.mark.slow
def test_no_serve_time_fields_in_the_run_form(cfg, schema):
    from posttrain.flows.deploy import build_deployments

    for s in (schema, generic_schema()):
        assert not set(SERVE_ONLY) & set(s["definitions"]["PipelineConfig"]["properties"])
    assert not set(SERVE_ONLY) & set(run_parameters(cfg)["config"])
    on_demand, scheduled = build_deployments(cfg)
    for d in (on_demand, scheduled):
        assert not set(SERVE_ONLY) & set(d.parameters["config"])
        assert "schedule" not in json.dumps(d._parameter_openapi_schema.model_dump()["definitions"]["PipelineConfig"])
    assert [s.schedule.cron for s in scheduled.schedules] == [cfg.schedule]  # the serve side still has it


def test_one_section_per_node_everyday_knobs_first(cfg, schema):
    defs = schema["definitions"]
    nodes = defs["PipelineConfig"]["properties"]["nodes"]
    assert list(nodes["properties"]) == list(cfg.nodes) == nodes["required"]
    assert nodes["properties"]["teacher"] == {**nodes["properties"]["teacher"], "$ref": "#/definitions/SFTNode",
                                              "title": "teacher (SFT)"}
    assert "oneOf" in nodes["additionalProperties"]  # other nodes may still come through the API
    assert ordered(defs["SFTNode"])[:8] == ["kind", "model", "data", "max_steps", "epochs", "optim", "lora",
                                            "parallel"]
    assert ordered(defs["DistillNode"])[:3] == ["kind", "model", "teacher"]
    assert ordered(defs["DPONode"])[-5:] == ["checkpoint", "reliability", "launcher", "tracking", "sweep"]
    assert ordered(defs["OptimConfig"])[0] == "lr"
    assert ordered(defs["LoRAConfig"])[:3] == ["enabled", "rank", "alpha"]
    assert ordered(defs["ParallelConfig"])[:6] == ["dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"]
    assert ordered(defs["PipelineConfig"])[:2] == ["name", "nodes"]
    checkpoint = defs["SFTNode"]["properties"]["checkpoint"]
    assert checkpoint["title"] == "Advanced: checkpoint" and "properties" not in checkpoint  # one JSON editor
    assert "$ref" not in checkpoint


def test_summary_lists_each_node(cfg):
    from posttrain.flows.deploy import build_deployments

    text = summary(cfg)
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| Node")]
    assert [r.split(" | ")[0].removeprefix("| ").split(" (")[0] for r in rows] == list(cfg.nodes)
    dpo = next(r for r in rows if r.startswith("| dpo"))
    n = cfg.nodes["dpo"]
    assert f"| {n.lora.rank} |" in dpo and f"{n.optim.lr:g}" in dpo and f"{n.max_steps} steps" in dpo
    on_demand, scheduled = build_deployments(cfg)
    assert text in on_demand.description
    assert f"**Schedule:** `{cfg.schedule}`" in scheduled.description


def test_the_form_schema_takes_the_served_config_back_unchanged(cfg, schema):
    from prefect.utilities.schema_tools import validate
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    params = run_parameters(cfg)
    assert validate(params, schema, raise_on_error=False) == []
    assert validate(params, generic_schema(), raise_on_error=False) == []
    # The form submits a JSON editor's value as {"__prefect_kind": "json"}; the server hydrates it.
    sent = copy.deepcopy(params)
    teacher = sent["config"]["nodes"]["teacher"]
    teacher["checkpoint"] = {"__prefect_kind": "json", "value": json.dumps(teacher["checkpoint"])}
    got = hydrate(sent, HydrationContext(raise_on_error=True))
    assert validate(got, schema, raise_on_error=False) == []
    assert run_parameters(PipelineConfig.model_validate(got["config"])) == params


@pytest.mark.parametrize("key, value, path", [
    ("nodes.teacher.epochs", 0, "config.nodes.teacher.epochs"),
    ("nodes.student.optim.lr", -1.0, "config.nodes.student.optim.lr"),
    ("nodes.prep.val_fraction", 1.5, "config.nodes.prep.val_fraction"),
    ("launcher.kind", "mainframe", "config.launcher.kind"),
    ("nodes.dpo.rounds", 0, "config.nodes.dpo.rounds"),
    ("name", "../escape", "config.name"),
])
def test_per_field_rules_are_in_the_schema(cfg, schema, key, value, path):
    from prefect.utilities.schema_tools import validate

    params = run_parameters(cfg)
    node = params["config"]
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    errors = validate(params, schema, raise_on_error=False)
    assert errors and ".".join(map(str, errors[0].path)) == path


def test_a_cross_field_error_passes_the_schema_and_fails_validation_naming_the_path(cfg, schema):
    from pydantic import ValidationError
    from prefect.utilities.schema_tools import validate

    params = run_parameters(cfg)
    params["config"]["nodes"]["prep"].update(val_fraction=0.6, test_fraction=0.5)
    assert validate(params, schema, raise_on_error=False) == []  # JSON schema cannot say "sum <= 1"
    with pytest.raises(ValidationError, match=r"nodes\.prep: val_fraction \+ test_fraction"):
        PipelineConfig.model_validate(params["config"])


# ---------------------------------------------------------------- against a real Prefect server

from tests.flows.test_deploy import prefect_api  # noqa: E402,F401  (the module's server fixture)


@pytest.fixture(scope="module")
def deployment(prefect_api, cfg, tmp_path_factory):
    """The deployments registered (as `posttrain serve` does, without serving them)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from posttrain.flows.deploy import ON_DEMAND, build_deployments

    url, _ = prefect_api
    served = cfg.model_copy(update={"workspace": str(tmp_path_factory.mktemp("runs"))})
    with temporary_settings({PREFECT_API_URL: url}):
        for d in build_deployments(served):
            d.apply()
        with get_client(sync_client=True) as client:
            yield client, client.read_deployment_by_name(f"post_training/{ON_DEMAND}")


@pytest.mark.slow
def test_the_server_refuses_an_invalid_value_when_the_run_is_created(deployment):
    from prefect.exceptions import PrefectHTTPStatusError

    client, dep = deployment
    stored = dep.parameter_openapi_schema["definitions"]["PipelineConfig"]["properties"]
    assert list(stored["nodes"]["properties"]) == ["prep", "teacher", "student", "distill", "dpo", "evaluate"]
    assert "schedule" not in stored and "schedule" not in dep.parameters["config"]
    params = copy.deepcopy(dep.parameters)
    params["config"]["nodes"]["teacher"]["max_steps"] = -5
    with pytest.raises(PrefectHTTPStatusError, match=r"409.*config\.nodes\.teacher\.max_steps"):
        client.create_flow_run_from_deployment(dep.id, parameters=params)
    ok = client.create_flow_run_from_deployment(dep.id, parameters=dep.parameters)  # the form's own values
    assert ok.parameters == dep.parameters
    client.delete_flow_run(ok.id)


@pytest.mark.slow
def test_a_cross_field_error_fails_the_run_at_once_naming_the_path(deployment):
    from prefect.flow_engine import run_flow

    from posttrain.flows.pipeline import post_training

    client, dep = deployment
    params = copy.deepcopy(dep.parameters)
    params["config"]["nodes"]["prep"].update(val_fraction=0.6, test_fraction=0.5)
    run = client.create_flow_run_from_deployment(dep.id, parameters=params)  # the schema lets it through
    start = time.time()
    state = run_flow(post_training, flow_run=run, parameters=run.parameters, return_type="state")
    assert time.time() - start < 15  # validation, not a node, failed it (about a second)
    assert state.is_failed()
    assert "nodes.prep: val_fraction + test_fraction must leave some training data" in state.message
    assert client.read_flow_run(run.id).state.is_failed()
