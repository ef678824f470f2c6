"""posttrain.core.config and posttrain.flows.config: the demo config, loading, `--set nodes.<name>.<key>` overrides,
error messages, output dirs, parallel layouts, schema and round trips. (The DAG's own validation,
expansion and wiring rules: tests/flows/test_dag.py.)"""

import json
from pathlib import Path

import pytest
import yaml

from posttrain.core.config import ConfigError, dump_config, ensure_within, from_json_file, load_config, to_json_file
from posttrain.core.data.config import DataConfig
from posttrain.core.lora.config import LoRAConfig
from posttrain.core.parallel.config import ParallelConfig
from posttrain.flows.config import NODE_CLASSES, PipelineConfig
from posttrain.flows.dag import Edge, PipelineDAG, Upstream
from tests.support.pipelines import DEMO_CONFIG
from posttrain.stages.config import KINDS, STAGE_CONFIGS, DistillConfig, DPOConfig, EvalConfig, SFTConfig
from posttrain.stages.launch.config import LauncherConfig

SMALL = """
name: small
nodes:
  prep: {kind: data_prep, synthetic_size: 50}
  teacher: {kind: sft, model: debug, data: prep}
  student:
    kind: sft
    model: debug
    data: prep
"""


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def demo(*sets: str) -> PipelineConfig:
    return load_config(PipelineConfig, DEMO_CONFIG, list(sets))


def upstream(dag: PipelineDAG, name: str) -> dict[str, Upstream]:
    """Every input of `name` finished, in its default output dir."""
    return {u: Upstream(str(dag.output_dir(u)), f"digest-{u}") for u in dag.inputs(name)}


def spec_of(cfg: PipelineConfig, name: str):
    dag = PipelineDAG(cfg)
    return dag.spec(name, upstream(dag, name))


# ------------------------------------------------------------------------------------ the demo

def test_tracking_uri_from_the_environment_unless_set_and_always_absolute(tmp_path, monkeypatch):
    """`posttrain ui` says `export MLFLOW_TRACKING_URI=...`: that wins over the default; a config's
    own URI wins over both; a relative SQLite path becomes absolute where the config loads."""
    from posttrain.core.tracking import TrackingConfig
    from posttrain.flows.demo import DEMO_CONFIG as SHIPPED  # the shipped demo leaves the URI to the default

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert load_config(PipelineConfig, SHIPPED).tracking.tracking_uri == "http://127.0.0.1:5000"
    assert demo("tracking.tracking_uri=sqlite:///runs.db").tracking.tracking_uri == f"sqlite:///{tmp_path}/runs.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert TrackingConfig().tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert TrackingConfig(tracking_uri="sqlite:////abs/m.db").tracking_uri == "sqlite:////abs/m.db"
    assert TrackingConfig(tracking_uri="file:///abs/mlruns").tracking_uri == "file:///abs/mlruns"


def test_demo_config_describes_the_embedded_pipeline():
    cfg = demo()
    assert {n: v.kind for n, v in cfg.nodes.items()} == {
        "prep": "data_prep", "teacher": "sft", "student": "sft", "distill": "distill", "dpo": "dpo",
        "evaluate": "evaluate"}
    assert cfg.launcher.kind == "local" and cfg.launcher.nproc_per_node == 2
    assert cfg.tracking.tracking_uri == f"sqlite:///{Path('mlflow.db').resolve()}"  # absolute: one database
    assert cfg.nodes["student"].model.name_or_path == "debug"  # `model: debug`, the shorthand
    assert cfg.nodes["distill"].teacher.name_or_path == "teacher"
    assert cfg.nodes["evaluate"].data.sources == ["prep"]  # `data: prep`, the shorthand
    assert cfg.nodes["prep"].synthetic_size > 0
    assert cfg.schedule == "0 3 * * 1"
    assert cfg.nodes["dpo"].lora.enabled and cfg.nodes["dpo"].reference == "disable_adapter"
    for cls in (*STAGE_CONFIGS.values(), *(c for k, c in NODE_CLASSES.items() if k != "data_prep"),
                LoRAConfig, ParallelConfig, DataConfig):
        cls()  # every default validates on its own
    assert NODE_CLASSES["data_prep"]().kind == "data_prep" and set(NODE_CLASSES) == set(KINDS)


def test_a_pipeline_needs_nodes(tmp_path):
    with pytest.raises(ConfigError, match=r"^nodes: Field required$"):
        load_config(PipelineConfig)  # no defaults to start from: the user writes the DAG
    with pytest.raises(ConfigError, match=r"^nodes: Field required in .*empty\.yaml$"):
        load_config(PipelineConfig, write(tmp_path, "name: x\n", "empty.yaml"))
    with pytest.raises(ConfigError, match=r"^nodes: the pipeline has no nodes in "):
        load_config(PipelineConfig, write(tmp_path, "nodes: {}\n"))
    with pytest.raises(ConfigError, match=r"^nodes: Input should be a valid dictionary \(got \['prep'\]\)"):
        load_config(PipelineConfig, write(tmp_path, "nodes: [prep]\n"))


def test_every_field_has_a_description_for_the_prefect_form():
    schema = PipelineConfig.model_json_schema()
    json.dumps(schema)  # what the Prefect UI renders its run form from
    missing = [f"{name}.{field}" for name, model in schema["$defs"].items()
               for field, spec in model.get("properties", {}).items() if not spec.get("description")]
    missing += [k for k, spec in schema["properties"].items() if not spec.get("description")]
    assert not missing
    assert schema["required"] == ["nodes"]
    # `nodes` is a mapping of node name -> one of the node kinds, told apart by `kind`
    union = schema["properties"]["nodes"]["additionalProperties"]
    assert set(union["discriminator"]["mapping"]) == set(KINDS)
    assert {ref["$ref"].rsplit("/", 1)[-1] for ref in union["oneOf"]} == {c.__name__ for c in NODE_CLASSES.values()}


def test_defaults_are_not_shared_between_instances():
    a, b = demo(), demo()
    a.nodes["student"].lora.targets.append("q_proj")
    a.nodes["student"].model.overrides["n_layers"] = 9
    assert b.nodes["student"].lora.targets == ["all-linear"] and b.nodes["student"].model.overrides == {}
    x, y = NODE_CLASSES["sft"](), NODE_CLASSES["sft"]()
    x.sweep["lora.rank"] = [8]
    x.data.sources.append("prep")
    assert y.sweep == {} and y.data.sources == []


# ------------------------------------------------------------------------------------ loading

def test_yaml_file_and_overrides_coerce_types(tmp_path):
    path = write(tmp_path, SMALL + """\
    optim: {lr: 1e-3, betas: [0.9, 0.99]}
    lora: {enabled: true}
""")
    cfg = load_config(PipelineConfig, path, [
        "nodes.student.optim.lr=1e-4",
        "nodes.student.lora.targets=[q_proj,v_proj]",
        "nodes.student.lora.use_rslora=true",
        "nodes.student.max_steps=50",
        "nodes.student.model.overrides.num_layers=4",
        "launcher.slurm.time=4:00:00",
        "tracking.tags.team=no",
    ])
    s = cfg.nodes["student"]
    assert cfg.name == "small"
    assert s.optim.lr == 1e-4 and isinstance(s.optim.lr, float)
    assert s.optim.betas == (0.9, 0.99)
    assert s.lora.targets == ["q_proj", "v_proj"] and s.lora.use_rslora and s.lora.enabled
    assert s.max_steps == 50
    assert s.model.overrides == {"num_layers": 4} and s.model.name_or_path == "debug"
    # YAML 1.1 would read these as 14400 and False.
    assert cfg.launcher.slurm.time == "4:00:00" and cfg.tracking.tags == {"team": "no"}


def test_precedence_override_beats_file_beats_default(tmp_path):
    path = write(tmp_path, SMALL.replace("{kind: sft, model: debug, data: prep}",
                                         "{kind: sft, model: debug, data: prep, optim: {lr: 0.01, warmup_steps: 3}}"))
    cfg = load_config(PipelineConfig, path, ["nodes.teacher.optim.lr=0.02"])
    assert cfg.nodes["teacher"].optim.lr == 0.02  # override
    assert cfg.nodes["teacher"].optim.warmup_steps == 3  # file
    assert cfg.nodes["teacher"].optim.eps == 1e-8  # default
    assert load_config(PipelineConfig, path).nodes["teacher"].optim.lr == 0.01
    assert cfg.nodes["student"].optim.lr == load_config(PipelineConfig, path).nodes["student"].optim.lr


def test_partial_sections_keep_the_kinds_defaults():
    cfg = demo("nodes.dpo.lora={rank: 8}", "nodes.dpo.optim={warmup_steps: 0}")
    dpo = cfg.nodes["dpo"]
    assert dpo.lora.rank == 8 and dpo.lora.enabled and dpo.lora.alpha == 32  # the file's, merged key by key
    assert dpo.optim.lr == 0.001 and dpo.optim.warmup_steps == 0
    cfg = load_config(PipelineConfig, None, ["nodes.prep.kind=data_prep", "nodes.d.kind=dpo", "nodes.d.model=debug",
                                             "nodes.d.data=prep", "nodes.d.lora.rank=8"])
    assert cfg.nodes["d"].lora.enabled and cfg.nodes["d"].optim.lr == 5e-5  # DPO's defaults, not LoRAConfig's


def test_a_nodes_partial_sections_start_from_its_kinds_defaults(tmp_path):
    """Written in a file or handed to model_validate (as Prefect does), a node's section merges
    onto its kind's default section: a DPO node's `lora: {rank: 8}` keeps `enabled: true` (it was
    LoRAConfig's `false`, refused with reference='disable_adapter'), `data: prep` keeps the kind's
    data format."""
    nodes = {"prep": {"kind": "data_prep"}, "s": {"kind": "sft", "data": "prep"},
             "d": {"kind": "dpo", "model": "s", "data": "prep", "lora": {"rank": 8}, "optim": {"warmup_steps": 0}},
             "k": {"kind": "distill", "model": "s", "teacher": "s", "data": {"sources": ["prep"], "max_seq_len": 64}}}
    path = write(tmp_path, yaml.safe_dump({"nodes": nodes}))
    for cfg in (load_config(PipelineConfig, path), PipelineConfig.model_validate({"nodes": nodes})):
        d, k, s = cfg.nodes["d"], cfg.nodes["k"], cfg.nodes["s"]
        assert (d.lora.enabled, d.lora.rank, d.optim.lr, d.optim.warmup_steps) == (True, 8, 5e-5, 0)
        assert d.data.format == "preference" and s.data.format == k.data.format == "sft"
        assert k.data.max_seq_len == 64 and d.model.name_or_path == "s"
    assert nodes["d"] == {"kind": "dpo", "model": "s", "data": "prep", "lora": {"rank": 8},
                          "optim": {"warmup_steps": 0}}  # the caller's dict is left as it was


def test_overrides_keep_shorthands_they_set_a_key_of():
    """`model: student` is {name_or_path: student}: setting one key of it keeps the reference (it
    was replaced by a fresh section, the distillation silently training the `debug` preset)."""
    cfg = demo("nodes.distill.model.kernels=torch", "nodes.distill.teacher={dtype: bfloat16}",
               "nodes.evaluate.data.max_seq_len=64", "nodes.student.model.overrides.num_layers=1")
    kd = cfg.nodes["distill"]
    assert (kd.model.name_or_path, kd.model.kernels) == ("student", "torch")
    assert (kd.teacher.name_or_path, kd.teacher.dtype) == ("teacher", "bfloat16")
    assert cfg.nodes["evaluate"].data.sources == ["prep"] and cfg.nodes["evaluate"].data.max_seq_len == 64
    assert cfg.nodes["student"].model.name_or_path == "debug"
    assert PipelineDAG(cfg).inputs("distill") == ["prep", "student", "teacher"]


def test_overrides_add_and_rewire_nodes():
    cfg = demo("nodes.kd2.kind=distill", "nodes.kd2.model=student", "nodes.kd2.teacher=teacher", "nodes.kd2.data=prep",
               "nodes.kd2.divergence=jsd", "nodes.evaluate.models=[dpo, kd2]")
    dag = PipelineDAG(cfg)
    assert cfg.nodes["kd2"].divergence == "jsd"
    assert dag.inputs("kd2") == ["prep", "student", "teacher"] and dag.inputs("evaluate") == ["dpo", "kd2", "prep"]
    assert dag.order.index("kd2") < dag.order.index("evaluate")
    cfg = demo("nodes.student.sweep={lora.rank: [8, 16]}", "nodes.student.lora.enabled=true",
               "nodes.distill.model=student@rank=16")
    assert PipelineDAG(cfg).inputs("distill") == ["prep", "student@rank=16", "teacher"]


def test_override_fills_an_optional_section():
    cfg = demo("nodes.teacher.launcher.kind=slurm", "nodes.teacher.launcher.slurm.gpus_per_node=8")
    t = cfg.nodes["teacher"].launcher
    assert t.kind == "slurm" and t.slurm.gpus_per_node == 8
    assert spec_of(cfg, "teacher").launcher == t
    assert spec_of(cfg, "student").launcher.kind == "local"  # the pipeline's


def test_json_config_and_stage_config_load(tmp_path):
    path = write(tmp_path, json.dumps({"beta": 0.2, "loss_type": "ipo"}), "dpo.json")
    cfg = load_config(DPOConfig, path, ["num_samples=8"])
    assert (cfg.beta, cfg.loss_type, cfg.num_samples) == (0.2, "ipo", 8)


# ------------------------------------------------------------------------------------ errors

def test_unknown_top_level_key_names_key_and_file(tmp_path):
    path = write(tmp_path, SMALL + "nmae: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(PipelineConfig, path)
    msg = str(e.value)
    assert "nmae" in msg and "unknown key" in msg and "config.yaml" in msg and "workspace" in msg


def test_unknown_nested_key_names_dotted_path_and_valid_keys(tmp_path):
    path = write(tmp_path, SMALL + "    optim:\n      lrr: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(PipelineConfig, path)
    msg = str(e.value)
    assert msg.startswith("nodes.student.optim.lrr: unknown key") and msg.endswith("in " + str(path))
    assert "lr, weight_decay" in msg


def test_wrong_type_names_path_value_and_file(tmp_path):
    path = write(tmp_path, SMALL + "    optim: {lr: abc}\n")
    with pytest.raises(ConfigError) as e:
        load_config(PipelineConfig, path)
    msg = str(e.value)
    assert msg.startswith("nodes.student.optim.lr: ") and "'abc'" in msg and msg.endswith("in " + str(path))


def test_every_bad_node_is_named_on_its_own_line(tmp_path):
    path = write(tmp_path, SMALL + "    max_steps: 0\n    optim: {lr: abc}\n  kd: {kind: distill, temperature: -1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(PipelineConfig, path)
    lines = str(e.value).splitlines()
    assert sorted(line.split(":")[0] for line in lines) == ["nodes.kd.temperature", "nodes.student.max_steps",
                                                           "nodes.student.optim.lr"]
    assert all(line.endswith(f" in {path}") for line in lines)


def test_wrong_type_from_override_names_the_override(tmp_path):
    with pytest.raises(ConfigError, match=r"^nodes\.dpo\.beta: .*\(got 'x'\) \(from --set nodes\.dpo\.beta=x\)$"):
        demo("nodes.dpo.beta=x")
    # a reference set on the command line is blamed on the --set, not on the file
    with pytest.raises(ConfigError, match=r"^nodes\.dpo\.model: 'nope' is not a node .*\(from --set nodes\.dpo\.model=nope\)$"):
        demo("nodes.dpo.model=nope")
    with pytest.raises(ConfigError, match=r"^nodes\.dpo\.model: 'xxxx.*' is not a node"):  # too long for a file name
        demo("nodes.dpo.model=" + "x" * 5000)
    # ... and a bad value in the file on the file, whatever else was set
    path = write(tmp_path, DEMO_CONFIG.read_text().replace("    pairs: on_policy\n", "    pairs: on_policy\n    beta: 0\n"))
    with pytest.raises(ConfigError, match=rf"^nodes\.dpo\.beta: .*\(got 0\) in {path}$"):
        load_config(PipelineConfig, path, ["nodes.student.max_steps=3"])


def test_set_on_unknown_nested_path_errors_naming_the_path():
    with pytest.raises(ConfigError, match=r"^nodes\.student\.lora\.rnak: unknown key; valid keys here: .*rank.*"
                                          r"\(from --set nodes\.student\.lora\.rnak=4\)"):
        demo("nodes.student.lora.rnak=4")
    with pytest.raises(ConfigError, match=r"unknown key 'nope'.*top level"):
        demo("nope.x=1")
    with pytest.raises(ConfigError, match=r"unknown key 'launcher\.slurm\.tme'.*'launcher\.slurm'.*time"):
        demo("launcher.slurm.tme=1")
    with pytest.raises(ConfigError, match=r"'nodes\.student\.optim\.lr' is a value \(0\.003\), not a section"):
        demo("nodes.student.optim.lr.x=1")
    with pytest.raises(ConfigError, match="a.b.c=value"):
        demo("nodes.student.optim.lr")
    with pytest.raises(ConfigError, match=r"^nodes\.nope\.kind: missing; one of data_prep, sft, distill, dpo, grpo, evaluate"):
        demo("nodes.nope.max_steps=3")  # a new node needs its kind first
    with pytest.raises(ConfigError, match=r"^nodes\.student\.rounds: unknown key"):
        demo("nodes.student.rounds=2")  # rounds are DPO's
    with pytest.raises(ConfigError, match=r"^nodes\.student: expected a mapping with a `kind`, got int"):
        demo("nodes.student=3")


def test_old_style_overrides_are_unknown_keys():
    for item in ("posttrain.stages.distill=false", "sft_student.max_steps=3", "dpo.beta=0.2"):
        with pytest.raises(ConfigError, match=rf"--set {item}: unknown key '{item.split('.')[0]}'.*nodes"):
            demo(item)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(PipelineConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(PipelineConfig, write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_config(PipelineConfig, write(tmp_path, "a: [1,\n", "bad.yaml"))
    with pytest.raises(ConfigError, match="extension"):
        load_config(PipelineConfig, write(tmp_path, "", "cfg.toml"))
    with pytest.raises(ConfigError, match=r"duplicate key 'prep'"):
        load_config(PipelineConfig, write(tmp_path, SMALL + "  prep: {kind: data_prep}\n"))


def test_cross_field_errors_name_the_node(tmp_path):
    with pytest.raises(ConfigError, match=r"^nodes\.dpo: reference='disable_adapter' needs lora\.enabled"):
        demo("nodes.dpo.lora.enabled=false")
    with pytest.raises(ConfigError, match=r"^nodes\.student: save='adapter' needs lora\.enabled"):
        demo("nodes.student.save=adapter")
    with pytest.raises(ConfigError, match=r"^nodes\.prep: val_fraction \+ test_fraction must leave"):
        demo("nodes.prep.val_fraction=0.5", "nodes.prep.test_fraction=0.5")
    with pytest.raises(ConfigError, match=r"^nodes\.evaluate\.parallel\.ep: evaluation under pipeline .* not with "):
        demo("nodes.evaluate.parallel.pp=2", "nodes.evaluate.parallel.ep=2")
    with pytest.raises(ConfigError, match="top_k"):
        load_config(DistillConfig, None, ["mode=offline"])
    with pytest.raises(ConfigError, match="double_quant"):
        load_config(SFTConfig, None, ["lora.double_quant=true"])
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        demo("launcher.kind=multinode", "launcher.nnodes=2")
    with pytest.raises(ConfigError, match="5-field cron"):
        demo("schedule=weekly")


def test_the_registered_evaluate_node_is_checked_at_load():
    """registry.evaluate was looked up only after every node had run."""
    with pytest.raises(ConfigError, match=r"^registry\.evaluate: 'dpo' is not an evaluate node \(evaluate\) "
                                          r"\(from --set registry\.evaluate=dpo\)"):
        demo("registry.evaluate=dpo")
    with pytest.raises(ConfigError, match=r"^registry\.evaluate: 'evaluate' is a sweep of 2 nodes"):
        demo("registry.evaluate=evaluate", "nodes.evaluate.sweep={max_examples: [10, 20]}")
    assert demo("registry.evaluate=evaluate@max_examples=10", "nodes.evaluate.sweep={max_examples: [10, 20]}")
    assert demo("registry.evaluate=nope", "registry.enabled=false").registry.evaluate == "nope"


def test_node_names_and_kinds():
    with pytest.raises(ConfigError, match=r"^nodes\.1st: node names are letters"):
        demo("nodes.1st.kind=sft")
    with pytest.raises(ConfigError, match=r"^nodes\.student\.kind: 'ppo'; one of data_prep"):
        demo("nodes.student.kind=ppo")
    # a node changing kind is validated as the new kind
    with pytest.raises(ConfigError, match=r"^nodes\.student\.teacher: unknown key"):
        load_config(PipelineConfig, DEMO_CONFIG, ["nodes.student.teacher=teacher", "nodes.student.kind=sft"])
    assert demo("nodes.student.kind=dpo").nodes["student"].lora.enabled  # DPO's defaults now apply


# ------------------------------------------------------------------------------------ paths

def test_ensure_within(tmp_path):
    assert ensure_within("runs", "demo/sft") == Path("runs/demo/sft")
    assert ensure_within("runs", "demo/../other") == Path("runs/other")
    assert ensure_within(tmp_path, tmp_path / "a") == tmp_path / "a"
    for bad in ("../x", "demo/../../x", "/etc"):
        with pytest.raises(ValueError, match="escapes"):
            ensure_within("runs", bad)


def test_output_dirs_must_stay_in_the_workspace():
    with pytest.raises(ConfigError, match=r"^nodes\.dpo\.output_dir: .*escapes.*workspace"):
        demo("nodes.dpo.output_dir=../../../etc")
    with pytest.raises(ConfigError, match=r"workspace.*'\.\.'"):
        demo("workspace=../runs")
    with pytest.raises(ConfigError, match="name"):
        demo("name=../x")
    cfg = demo("nodes.dpo.output_dir=aligned")
    assert spec_of(cfg, "dpo").output_dir == str(Path("runs/demo/aligned"))
    assert spec_of(cfg, "evaluate").models[0] == str(Path("runs/demo/aligned"))  # readers follow it
    dag = PipelineDAG(demo("nodes.dpo.output_dir=aligned", "nodes.dpo.rounds=2"))
    assert [str(dag.output_dir(n)) for n in ("dpo@r1", "dpo@r2")] == [str(Path("runs/demo/aligned/r1")),
                                                                     str(Path("runs/demo/aligned/r2"))]


@pytest.mark.parametrize("sets, match", [
    # a node clears its dir when its result changes: whatever lies inside would go with it
    (["nodes.dpo.output_dir=distill"], r"nodes\.dpo\.output_dir: \S*distill is the same directory as node 'distill'"),
    (["nodes.dpo.output_dir=student/dpo"], r"nodes\.dpo\.output_dir: .* is inside the directory of node 'student'"),
    (["nodes.prep.output_dir=shared", "nodes.dpo.output_dir=shared/x/.."], r"nodes\.dpo\.output_dir: .*same directory as node 'prep'"),
    (["nodes.student.output_dir=x", "nodes.teacher.output_dir=x/y"], r"nodes\.(teacher|student)\.output_dir: "),
    (["nodes.dpo.output_dir=."], r"nodes\.dpo\.output_dir: '\.' is the run dir itself"),
    (["nodes.dpo.output_dir=.."], r"nodes\.dpo\.output_dir: '\.\.' is the workspace itself"),
    (["nodes.dpo.output_dir=.locks"], r"nodes\.dpo\.output_dir: .*where the pipeline keeps its own files"),
    (["nodes.dpo.output_dir=.launch/x"], r"nodes\.dpo\.output_dir: .*where the pipeline keeps its own files"),
])
def test_output_dirs_are_each_nodes_own(sets, match):
    with pytest.raises(ConfigError, match=match):
        demo(*sets)


@pytest.mark.parametrize("sets, match", [
    # a member's name is its directory's and its lock file's: two members of one name would be one node
    (["nodes.student.sweep={optim.lr: [0.1, 0.1]}"], r"^nodes\.student\.sweep\.optim\.lr: 0\.1 is listed twice"),
    (["nodes.student.sweep={seed: [1, '1']}"], r"^nodes\.student\.sweep\.seed: 1 is listed twice"),
    # ... and a value with a '/' would name a path (out of the workspace, here), not a directory
    (["nodes.student.sweep={model.name_or_path: [debug, ../../../../../../tmp]}"],
     r"^nodes\.student\.sweep\.model\.name_or_path: the member student@name_or_path=\.\./.* would be named by a path"),
    (["nodes.student.sweep={seed: [1, 2], lora.targets: [[" + ", ".join(["q_proj"] * 40) + "]]}"],
     r"^nodes\.student\.sweep: 'student@seed=1@targets=.*too long a name for a directory"),
    (["nodes.student.sweep={seed: [" + ", ".join(map(str, range(50))) + "], epochs: [" + ", ".join(map(str, range(1, 50))) + "]}"],
     r"^nodes\.student\.sweep: 2450 members .*at most 1000"),
    (["nodes.student.sweep={output_dir: [a, b]}"], r"^nodes\.student\.output_dir: a swept node's members each need"),
])
def test_sweep_members_are_distinct_directories(sets, match):
    with pytest.raises(ConfigError, match=match):
        demo(*sets, "nodes.distill.model=teacher", "nodes.evaluate.models=[student]")


# ------------------------------------------------------------------------------------ the demo's DAG

def test_demo_dag_edges_are_explicit():
    dag = PipelineDAG(demo())
    assert dag.order == ["prep", "teacher", "student", "distill", "dpo", "evaluate"]
    data = [Edge("prep", s, "data", "data.sources[0]") for s in ("teacher", "student", "distill", "dpo", "evaluate")]
    assert set(dag.edges) == {
        *data, Edge("student", "distill", "model", "model"), Edge("teacher", "distill", "teacher", "teacher"),
        Edge("distill", "dpo", "model", "model"), Edge("dpo", "evaluate", "evaluated", "models[0]"),
        Edge("student", "evaluate", "evaluated", "models[1]"), Edge("distill", "evaluate", "evaluated", "models[2]")}
    assert dag.inputs("distill") == ["prep", "student", "teacher"]
    assert dag.describe()["nodes"]["dpo"] == {"kind": "dpo", "from": "dpo", "inputs": ["distill", "prep"],
                                              "output_dir": str(Path("runs/demo/dpo"))}


def test_stage_spec_wires_upstream_outputs():
    cfg = demo()
    dpo = spec_of(cfg, "dpo")
    assert type(dpo) is DPOConfig  # the stage's own config: no kind, sweep or rounds
    assert dpo.model.name_or_path == str(Path("runs/demo/distill"))
    assert dpo.data.sources == [str(Path("runs/demo/prep"))]
    assert dpo.launcher == cfg.launcher and dpo.tracking == cfg.tracking
    distill = spec_of(cfg, "distill")
    assert distill.teacher.name_or_path == str(Path("runs/demo/teacher"))
    assert distill.model.name_or_path == str(Path("runs/demo/student"))
    ev = spec_of(cfg, "evaluate")
    assert type(ev) is EvalConfig and ev.models == [str(Path(f"runs/demo/{m}")) for m in ("dpo", "student", "distill")]
    assert cfg.nodes["distill"].model.name_or_path == "student"  # spec() copies; the pipeline is untouched
    assert spec_of(cfg, "student").model.name_or_path == "debug"  # a preset stays a preset


# ------------------------------------------------------------------------------------ parallel

@pytest.mark.parametrize("kw, world, want", [
    ({}, 2, {"dp_shard": 2, "tp": 1}),
    ({"tp": 2}, 4, {"dp_shard": 2, "tp": 2}),
    ({"dp_replicate": 2, "tp": 2}, 8, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}),
    ({"dp_shard": 2, "pp": 2, "cp": 2}, 8, {"dp_shard": 2, "pp": 2, "cp": 2}),
    ({"ep": 4}, 4, {"dp_shard": 4, "ep": 4}),
    ({"cp": 2, "ep": 4}, 4, {"dp_shard": 2, "cp": 2, "ep": 4}),
])
def test_resolve_valid_layouts(kw, world, want):
    sizes = ParallelConfig(**kw).resolve(world)
    assert {k: sizes[k] for k in want} == want
    prod = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"] * sizes["pp"]
    assert prod == world


@pytest.mark.parametrize("kw, world, match", [
    ({"tp": 3}, 4, r"world size 4 is not divisible by .*tp=3.* = 3"),
    ({"dp_shard": 2, "tp": 2}, 8, r"= 4 ranks, but the world size is 8; set dp_shard=-1"),
    ({"dp_replicate": 2, "ep": 4}, 4, r"ep=4 must divide dp_shard\*cp = 2\*1"),
    ({"ep": 4, "tp": 2}, 4, r"ep=4 must divide dp_shard\*cp = 2\*1"),
    ({"pp": 4, "pp_microbatches": 2}, 4, r"pp_microbatches >= pp=4"),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2, "pp_microbatches": 3},
     2, r"divisible by pp=2"),
])
def test_resolve_invalid_layouts(kw, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kw).resolve(world)


def test_parallel_field_checks():
    with pytest.raises(ValueError, match="dp_shard must be -1"):
        ParallelConfig(dp_shard=0)
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        ParallelConfig(pp=2, pp_schedule="interleaved_1f1b")


def test_validate_for_model():
    ParallelConfig(tp=2, ep=4).validate_for_model(n_heads=8, n_kv_heads=2, n_experts=8)
    with pytest.raises(ValueError, match=r"tp=3 does not divide the model's n_heads=8.*valid tp: \[1, 2\]"):
        ParallelConfig(tp=3).validate_for_model(8, 2)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the model's n_kv_heads=2"):
        ParallelConfig(tp=4).validate_for_model(8, 2)
    with pytest.raises(ValueError, match=r"ep=3 does not divide the model's n_experts=8"):
        ParallelConfig(ep=3).validate_for_model(8, 8, n_experts=8)
    with pytest.raises(ValueError, match="dense"):
        ParallelConfig(ep=2).validate_for_model(8, 8)


# ------------------------------------------------------------------------------------ round trips

def test_json_round_trip(tmp_path):
    cfg = demo("nodes.student.lora.enabled=true", "nodes.student.lora.targets=[q_proj]",
               "nodes.student.model.overrides={num_layers: 2, rope_theta: 1e6}",
               "launcher.kubernetes.volumes=[{name: ws, mountPath: /ws}]", "nodes.dpo.optim.betas=[0.8, 0.9]",
               "nodes.teacher.sweep={optim.lr: [0.001, 0.003]}", "nodes.distill.teacher=teacher@lr=0.003",
               "nodes.dpo.rounds=2", "nodes.evaluate.models=[dpo, dpo@r1, teacher]",
               "nodes.evaluate.select={metric: exact_match}", "nodes.evaluate.launcher={nproc_per_node: 1}")
    path = to_json_file(cfg, tmp_path / "spec" / "pipeline.json")
    assert from_json_file(PipelineConfig, path) == cfg
    assert json.loads(path.read_text()) == dump_config(cfg)
    assert not [p for p in path.parent.iterdir() if p.name != "pipeline.json"]  # no temp files left
    # what Prefect stores as the flow's parameter and validates back when a run starts
    again = PipelineConfig.model_validate(json.loads(json.dumps(dump_config(cfg))))
    assert again == cfg and PipelineDAG(again).order == PipelineDAG(cfg).order
    assert list(again.nodes) == list(cfg.nodes)  # the user's order survives


def test_prefect_renders_and_validates_the_flow_parameter():
    """The run form comes from Prefect's schema of post_training's `config`; what the form sends
    back is validated by Prefect into the same PipelineConfig, and a bad node is refused by name."""
    from prefect.exceptions import ParameterTypeError
    from prefect.utilities.callables import parameter_schema

    from posttrain.flows.pipeline import post_training

    schema = parameter_schema(post_training.fn).model_dump()
    json.dumps(schema)
    assert list(schema["properties"]) == ["config"] and schema["required"] == ["config"]
    assert {c.__name__ for c in NODE_CLASSES.values()} <= set(schema["definitions"])
    cfg = demo("nodes.dpo.rounds=2", "nodes.student.sweep={lora.rank: [4, 8]}", "nodes.student.lora.enabled=true",
               "nodes.distill.model=student@rank=8")
    got = post_training.validate_parameters({"config": json.loads(json.dumps(dump_config(cfg)))})
    assert got["config"] == cfg
    bad = {**dump_config(cfg), "nodes": {"x": {"kind": "sft", "model": "nope", "data": "nope.jsonl"}}}
    with pytest.raises(ParameterTypeError, match=r"nodes\.x\.model: 'nope' is not a node"):
        post_training.validate_parameters({"config": bad})


def test_stage_spec_round_trip(tmp_path):
    dag = PipelineDAG(demo())
    for name in dag.order:
        spec = dag.spec(name, upstream(dag, name))
        assert type(spec) is STAGE_CONFIGS[dag.kind(name)]
        path = to_json_file(spec, tmp_path / f"{name}.json")
        assert from_json_file(STAGE_CONFIGS[dag.kind(name)], path) == spec


def test_spec_errors_name_the_json_file(tmp_path):
    path = write(tmp_path, json.dumps({"lora": {"rank": 0}}), "spec.json")
    with pytest.raises(ConfigError, match=r"lora\.rank: .*greater than 0 \(got 0\) in .*spec\.json"):
        from_json_file(SFTConfig, path)


def test_eval_and_launcher_checks():
    with pytest.raises(ValueError, match="greedy"):
        EvalConfig(num_samples=4)
    with pytest.raises(ValueError, match="at least 1 item"):
        EvalConfig(models=[])
    with pytest.raises(ValueError, match="image"):
        LauncherConfig(kind="kubernetes")
    with pytest.raises(ValueError, match="multinode"):
        LauncherConfig(nnodes=2)


# ------------------------------------------------------------------------------------ the CLI

def test_config_command_prints_the_plan_json_and_conversions(tmp_path, capsys, monkeypatch):
    from posttrain.flows.cli import main

    monkeypatch.chdir(tmp_path)  # the demo's workspace (runs/) is relative: nothing is there yet
    assert main(["config", str(DEMO_CONFIG)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pipeline demo: 6 nodes, 11 edges (workspace runs)")
    assert "distill" in out and "<- prep, student, teacher" in out and "student -> distill  (model: model)" in out
    assert main(["run", str(DEMO_CONFIG), "--dry-run", "--set", "nodes.dpo.rounds=2",
                 "--set", "nodes.evaluate.models=[dpo, dpo@r1]"]) == 0  # the plan, nothing launched
    out = capsys.readouterr().out
    assert "7 nodes" in out and "dpo@r2" in out and not (tmp_path / "runs").exists()
    assert main(["config", str(DEMO_CONFIG), "--json", "--set", "nodes.student.max_steps=7"]) == 0
    dumped = json.loads(capsys.readouterr().out)
    assert PipelineConfig.model_validate(dumped) == demo("nodes.student.max_steps=7")
    assert main(["config"]) == 0 and "dpo@r2" in capsys.readouterr().out  # no file: the embedded demo
    old = write(tmp_path, yaml.safe_dump({"name": "old", "stages": {"dpo": False}, "sft_student": {"max_steps": 3},
                                          "distill": {"kind": "jsd"}}), "old.yaml")
    assert main(["config", "--convert", str(old)]) == 0
    new = write(tmp_path, capsys.readouterr().out, "new.yaml")
    cfg = load_config(PipelineConfig, new)
    assert "dpo" not in cfg.nodes and cfg.nodes["distill"].divergence == "jsd"
    assert cfg.nodes["sft_student"].max_steps == 3
    assert main(["config", "--convert", str(new)]) == 2 and "already in the DAG format" in capsys.readouterr().err
    assert main(["config", str(old)]) == 2 and "posttrain config --convert" in capsys.readouterr().err


@pytest.mark.parametrize("old, match", [
    # disabled stages starting from each other: following them looped forever
    ({"stages": {"sft_student": False, "distill": False}, "sft_student": {"init_from": "distill"},
      "distill": {"init_from": "sft_student"}}, r"\.init_from: the disabled stages (distill|sft_student) -> .* start from each other"),
    ({"sft_student": 3}, r"^sft_student: expected a mapping, got int in "),  # a crash (TypeError)
    ({"stages": ["dpo"]}, r"^stages: expected a mapping"),
    ({"stages": {"dpo": "off"}}, r"^stages\.dpo: expected one of .* true or false"),
    ({"dpo": {"init_from": "nope"}}, r"^dpo\.init_from: 'nope' is not a stage"),
    ({"evaluate": {"compare_to": "dpo"}}, r"^evaluate\.compare_to: expected a list"),  # was read letter by letter
    ({"distill": {"model": True}}, r"^distill\.model: expected a mapping, got bool"),
])
def test_converting_a_malformed_old_config_names_the_key(tmp_path, old, match):
    from posttrain.flows.convert import convert_file

    path = write(tmp_path, yaml.safe_dump(old), "old.yaml")
    with pytest.raises(ConfigError, match=match) as e:
        convert_file(path)
    assert str(e.value).endswith(f" in {path}")
