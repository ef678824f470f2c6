"""core.config: defaults, loading, overrides, error messages, parallel layouts, round trips."""

import json
from pathlib import Path

import pytest

from flows.dag import PipelineDAG
from core.config import ConfigError, dump_config, ensure_within, from_json_file, load_config, to_json_file
from core.data.config import DataConfig
from core.lora.config import LoRAConfig
from core.parallel.config import ParallelConfig
from flows.config import PipelineConfig
from stages.config import STAGE_CONFIGS, STAGES, DistillConfig, DPOConfig, EvalConfig, SFTConfig
from stages.launch.config import LauncherConfig


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------ defaults

def test_defaults_describe_the_embedded_demo():
    cfg = PipelineConfig()
    assert cfg.enabled_stages() == list(STAGES)
    assert cfg.launcher.kind == "local" and cfg.launcher.nproc_per_node == 2
    assert cfg.tracking.tracking_uri == "sqlite:///mlflow.db"
    assert cfg.sft_student.model.name_or_path == "debug"
    assert cfg.data_prep.synthetic_size > 0
    assert cfg.schedule == "0 3 * * 1"
    assert cfg.dpo.lora.enabled and cfg.dpo.reference == "disable_adapter"
    for cls in (*STAGE_CONFIGS.values(), LoRAConfig, ParallelConfig, DataConfig):
        cls()  # every default validates on its own


def test_every_field_has_a_description_for_the_prefect_form():
    schema = PipelineConfig.model_json_schema()
    missing = [f"{name}.{field}" for name, model in schema["$defs"].items()
               for field, spec in model.get("properties", {}).items() if not spec.get("description")]
    assert not missing


def test_defaults_are_not_shared_between_instances():
    a, b = PipelineConfig(), PipelineConfig()
    a.sft_student.lora.targets.append("q_proj")
    a.sft_student.model.overrides["n_layers"] = 9
    assert b.sft_student.lora.targets == ["all-linear"] and b.sft_student.model.overrides == {}


# ------------------------------------------------------------------------------------ loading

def test_yaml_file_and_overrides_coerce_types(tmp_path):
    path = write(tmp_path, """
name: nightly
sft_student:
  optim: {lr: 1e-3, betas: [0.9, 0.99]}
  lora: {enabled: true}
""")
    cfg = load_config(PipelineConfig, path, [
        "sft_student.optim.lr=1e-4",
        "sft_student.lora.targets=[q_proj,v_proj]",
        "sft_student.lora.use_rslora=true",
        "sft_student.max_steps=50",
        "sft_student.model.overrides.n_layers=4",
        "launcher.slurm.time=4:00:00",
        "tracking.tags.team=no",
    ])
    s = cfg.sft_student
    assert cfg.name == "nightly"
    assert s.optim.lr == 1e-4 and isinstance(s.optim.lr, float)
    assert s.optim.betas == (0.9, 0.99)
    assert s.lora.targets == ["q_proj", "v_proj"] and s.lora.use_rslora and s.lora.enabled
    assert s.max_steps == 50
    assert s.model.overrides == {"n_layers": 4}
    # YAML 1.1 would read these as 14400 and False.
    assert cfg.launcher.slurm.time == "4:00:00" and cfg.tracking.tags == {"team": "no"}


def test_precedence_override_beats_file_beats_default(tmp_path):
    path = write(tmp_path, "sft_teacher: {optim: {lr: 0.01, warmup_steps: 3}}\n")
    cfg = load_config(PipelineConfig, path, ["sft_teacher.optim.lr=0.02"])
    assert cfg.sft_teacher.optim.lr == 0.02  # override
    assert cfg.sft_teacher.optim.warmup_steps == 3  # file
    assert cfg.sft_teacher.optim.eps == 1e-8  # default
    assert load_config(PipelineConfig, path).sft_teacher.optim.lr == 0.01


def test_partial_sections_keep_stage_specific_defaults(tmp_path):
    path = write(tmp_path, "dpo: {lora: {rank: 8}}\n")
    cfg = load_config(PipelineConfig, path, ["dpo.optim={warmup_steps: 0}"])
    assert cfg.dpo.lora.rank == 8 and cfg.dpo.lora.enabled  # DPO's default, not LoRAConfig's
    assert cfg.dpo.optim.lr == 5e-5 and cfg.dpo.optim.warmup_steps == 0


def test_override_fills_an_optional_section():
    cfg = load_config(PipelineConfig, None, ["sft_teacher.launcher.kind=slurm",
                                             "sft_teacher.launcher.slurm.gpus_per_node=8"])
    assert cfg.sft_teacher.launcher.kind == "slurm" and cfg.sft_teacher.launcher.slurm.gpus_per_node == 8
    assert PipelineDAG(cfg).spec("sft_student").launcher.kind == "local"  # the pipeline default


def test_json_config_and_stage_config_load(tmp_path):
    path = write(tmp_path, json.dumps({"beta": 0.2, "loss_type": "ipo"}), "dpo.json")
    cfg = load_config(DPOConfig, path, ["num_samples=8"])
    assert (cfg.beta, cfg.loss_type, cfg.num_samples) == (0.2, "ipo", 8)


# ------------------------------------------------------------------------------------ errors

def test_unknown_top_level_key_names_key_and_file(tmp_path):
    path = write(tmp_path, "nmae: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(PipelineConfig, path)
    msg = str(e.value)
    assert "nmae" in msg and "unknown key" in msg and "config.yaml" in msg and "workspace" in msg


def test_unknown_nested_key_names_dotted_path_and_valid_keys(tmp_path):
    path = write(tmp_path, "sft_student:\n  optim:\n    lrr: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(PipelineConfig, path)
    msg = str(e.value)
    assert "sft_student.optim.lrr" in msg and "config.yaml" in msg
    assert "lr, weight_decay" in msg


def test_wrong_type_names_path_value_and_file(tmp_path):
    path = write(tmp_path, "sft_student: {optim: {lr: abc}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(PipelineConfig, path)
    msg = str(e.value)
    assert msg.startswith("sft_student.optim.lr: ") and "'abc'" in msg and msg.endswith("in " + str(path))


def test_wrong_type_from_override_names_the_override(tmp_path):
    with pytest.raises(ConfigError, match=r"dpo\.beta: .*\(got 'x'\) \(from --set dpo\.beta=x\)"):
        load_config(PipelineConfig, write(tmp_path, "{}\n"), ["dpo.beta=x"])


def test_set_on_unknown_nested_path_errors_naming_the_path():
    with pytest.raises(ConfigError, match=r"unknown key 'sft_student\.lora\.rnak'.*'sft_student\.lora'.*rank"):
        load_config(PipelineConfig, None, ["sft_student.lora.rnak=4"])
    with pytest.raises(ConfigError, match=r"unknown key 'nope'.*top level"):
        load_config(PipelineConfig, None, ["nope.x=1"])
    with pytest.raises(ConfigError, match=r"'sft_student\.optim\.lr' is a value, not a section"):
        load_config(PipelineConfig, None, ["sft_student.optim.lr.x=1"])
    with pytest.raises(ConfigError, match="a.b.c=value"):
        load_config(PipelineConfig, None, ["sft_student.optim.lr"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(PipelineConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(PipelineConfig, write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_config(PipelineConfig, write(tmp_path, "a: [1,\n", "bad.yaml"))
    with pytest.raises(ConfigError, match="extension"):
        load_config(PipelineConfig, write(tmp_path, "", "cfg.toml"))


def test_cross_field_errors_name_the_section(tmp_path):
    with pytest.raises(ConfigError, match=r"^dpo: reference='disable_adapter' needs lora\.enabled"):
        load_config(PipelineConfig, None, ["dpo.lora.enabled=false"])
    with pytest.raises(ConfigError, match=r"sft_student: save='adapter' needs lora\.enabled"):
        load_config(PipelineConfig, None, ["sft_student.save=adapter"])
    with pytest.raises(ConfigError, match="top_k"):
        load_config(DistillConfig, None, ["mode=offline"])
    with pytest.raises(ConfigError, match="double_quant"):
        load_config(SFTConfig, None, ["lora.double_quant=true"])
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        load_config(PipelineConfig, None, ["launcher.kind=multinode", "launcher.nnodes=2"])


def test_pipeline_wiring_errors():
    with pytest.raises(ConfigError, match=r"sft_student\.init_from: 'dpo' does not run before"):
        load_config(PipelineConfig, None, ["sft_student.init_from=dpo"])
    with pytest.raises(ConfigError, match=r"sft_teacher\.data\.sources is empty"):
        load_config(PipelineConfig, None, ["stages.data_prep=false"])
    with pytest.raises(ConfigError, match="every stage is disabled"):
        load_config(PipelineConfig, None, [f"stages.{s}=false" for s in STAGES])
    with pytest.raises(ConfigError, match="5-field cron"):
        load_config(PipelineConfig, None, ["schedule=weekly"])


# ------------------------------------------------------------------------------------ paths

def test_ensure_within(tmp_path):
    assert ensure_within("runs", "demo/sft") == Path("runs/demo/sft")
    assert ensure_within("runs", "demo/../other") == Path("runs/other")
    assert ensure_within(tmp_path, tmp_path / "a") == tmp_path / "a"
    for bad in ("../x", "demo/../../x", "/etc"):
        with pytest.raises(ValueError, match="escapes"):
            ensure_within("runs", bad)


def test_output_dirs_must_stay_in_the_workspace():
    with pytest.raises(ConfigError, match=r"dpo\.output_dir: .*escapes.*workspace"):
        load_config(PipelineConfig, None, ["dpo.output_dir=../../../etc"])
    with pytest.raises(ConfigError, match=r"workspace.*'\.\.'"):
        load_config(PipelineConfig, None, ["workspace=../runs"])
    with pytest.raises(ConfigError, match="name"):
        load_config(PipelineConfig, None, ["name=../x"])
    with pytest.raises(ConfigError, match="same directory"):
        load_config(PipelineConfig, None, ["dpo.output_dir=distill"])
    cfg = load_config(PipelineConfig, None, ["dpo.output_dir=aligned"])
    assert PipelineDAG(cfg).spec("dpo").output_dir == str(Path("runs/demo/aligned"))


# ------------------------------------------------------------------------------------ stage specs

def test_stage_spec_wires_upstream_outputs():
    cfg = PipelineConfig()
    dpo = PipelineDAG(cfg).spec("dpo")
    assert dpo.model.name_or_path == str(Path("runs/demo/distill"))
    assert dpo.data.sources == [str(Path("runs/demo/data_prep"))]
    assert dpo.launcher == cfg.launcher and dpo.tracking == cfg.tracking
    distill = PipelineDAG(cfg).spec("distill")
    assert distill.teacher.name_or_path == str(Path("runs/demo/sft_teacher"))
    assert cfg.distill.model.name_or_path == "debug"  # stage() copies; the pipeline is untouched


def test_disabled_upstream_is_skipped():
    cfg = load_config(PipelineConfig, None, ["stages.distill=false"])
    assert PipelineDAG(cfg).upstream("dpo") == "sft_student"
    assert PipelineDAG(cfg).spec("dpo").model.name_or_path == str(Path("runs/demo/sft_student"))
    assert PipelineDAG(cfg).spec("evaluate").compare_to == [str(Path("runs/demo/sft_student"))]
    cfg = load_config(PipelineConfig, None, ["stages.sft_student=false", "stages.distill=false"])
    assert PipelineDAG(cfg).spec("dpo").model.name_or_path == "debug"


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
    cfg = load_config(PipelineConfig, None, [
        "sft_student.lora.enabled=true", "sft_student.lora.targets=[q_proj]",
        "sft_student.model.overrides={n_layers: 2, rope_theta: 1e6}",
        "launcher.kubernetes.volumes=[{name: ws, mountPath: /ws}]", "dpo.optim.betas=[0.8, 0.9]"])
    path = to_json_file(cfg, tmp_path / "spec" / "pipeline.json")
    assert from_json_file(PipelineConfig, path) == cfg
    assert json.loads(path.read_text()) == dump_config(cfg)
    assert not [p for p in path.parent.iterdir() if p.name != "pipeline.json"]  # no temp files left


def test_stage_spec_round_trip(tmp_path):
    cfg = PipelineConfig()
    for name in STAGES:
        spec = PipelineDAG(cfg).spec(name)
        path = to_json_file(spec, tmp_path / f"{name}.json")
        assert from_json_file(type(spec), path) == spec


def test_spec_errors_name_the_json_file(tmp_path):
    path = write(tmp_path, json.dumps({"lora": {"rank": 0}}), "spec.json")
    with pytest.raises(ConfigError, match=r"lora\.rank: .*greater than 0 \(got 0\) in .*spec\.json"):
        from_json_file(SFTConfig, path)


def test_eval_and_launcher_checks():
    with pytest.raises(ValueError, match="greedy"):
        EvalConfig(num_samples=4)
    with pytest.raises(ValueError, match="image"):
        LauncherConfig(kind="kubernetes")
    with pytest.raises(ValueError, match="multinode"):
        LauncherConfig(nnodes=2)


def test_dag_edges_are_explicit_and_follow_disabled_stages():
    from flows.dag import Edge

    dag = PipelineDAG(PipelineConfig())
    assert set(dag.edges) == {
        *(Edge("data_prep", s, "data") for s in ("sft_teacher", "sft_student", "distill", "dpo", "evaluate")),
        Edge("sft_student", "distill", "model"), Edge("sft_teacher", "distill", "teacher"),
        Edge("distill", "dpo", "model"), Edge("dpo", "evaluate", "model"),
        Edge("sft_student", "evaluate", "compare"), Edge("distill", "evaluate", "compare")}
    assert dag.inputs("distill") == ["data_prep", "sft_student", "sft_teacher"]
    assert dag.spec("dpo") is dag.spec("dpo")  # resolved once per DAG (per pipeline run)
    off = PipelineDAG(load_config(PipelineConfig, None, ["stages.distill=false", "stages.data_prep=false",
                                                         "dpo.data.sources=[d.jsonl]", "evaluate.data.sources=[d.jsonl]",
                                                         "sft_student.data.sources=[d.jsonl]",
                                                         "sft_teacher.data.sources=[d.jsonl]"]))
    assert set(off.edges) == {Edge("sft_student", "dpo", "model"), Edge("dpo", "evaluate", "model"),
                              Edge("sft_student", "evaluate", "compare")}
    assert off.spec("dpo").data.sources == ["d.jsonl"]
