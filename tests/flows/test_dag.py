"""posttrain.flows.dag and the flow around it: the DAG a user writes is validated before anything launches
(one test per kind of error, each naming node and key path), sweeps and rounds expand, references
resolve to upstream outputs, cache keys ignore layout-only settings, concurrent nodes get disjoint
devices, a node's output dir is locked while it runs, and old-format configs convert."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from pathlib import Path

import pytest
import yaml

from posttrain.core.config import ConfigError, load_config
from posttrain.flows.config import PipelineConfig
from posttrain.flows.dag import PipelineDAG, Upstream
from posttrain.flows.pipeline import cache_key, node_inputs
from posttrain.flows.resources import DevicePool, needs
from posttrain.flows.workspace import WorkspaceBusy, node_lock

BASE = {
    "prep": {"kind": "data_prep", "synthetic_size": 50},
    "sft": {"kind": "sft", "model": "debug", "data": "prep"},
}


def cfg_of(nodes: dict, tmp_path: Path | None = None, **top) -> PipelineConfig:
    data = {"nodes": nodes, **top}
    if tmp_path is not None:
        data.setdefault("workspace", str(tmp_path / "runs"))
    return PipelineConfig.model_validate(data)


def error_of(nodes: dict, tmp_path: Path, **top) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"nodes": nodes, **top}, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_config(PipelineConfig, path)
    return str(e.value)


def ups(dag: PipelineDAG, name: str, root: str = "/w") -> dict[str, Upstream]:
    return {u: Upstream(f"{root}/{u}", f"digest-{u}", selected=f"{root}/picked" if dag.kind(u) == "evaluate" else None)
            for u in dag.inputs(name)}


# ------------------------------------------------------------------------------ validation errors

def test_unknown_reference_names_node_and_key(tmp_path):
    msg = error_of({**BASE, "kd": {"kind": "distill", "model": "sft", "teacher": "techer", "data": "prep"}}, tmp_path)
    assert "nodes.kd.teacher: 'techer' is not a node (prep, sft, kd)" in msg


def test_a_packaged_model_or_a_gguf_file_is_a_model_and_a_typo_names_them(tmp_path):
    (tmp_path / "mine.gguf").write_bytes(b"GGUF")  # read only when the node runs
    for model in ("smollm2-135m-instruct", str(tmp_path / "mine.gguf")):
        dag = PipelineDAG(cfg_of({**BASE, "sft": {**BASE["sft"], "model": model}}, tmp_path))
        assert dag.nodes["sft"].edges[0].src == "prep" and not dag.nodes["sft"].external
    msg = error_of({**BASE, "sft": {**BASE["sft"], "model": "smollm2-135m-instruc"}}, tmp_path)
    assert "a packaged model (smollm2-135m-instruct) or an existing path (an HF directory or a .gguf file)" in msg


def test_cycle_is_named(tmp_path):
    msg = error_of({"prep": BASE["prep"], "a": {"kind": "sft", "model": "b", "data": "prep"},
                    "b": {"kind": "sft", "model": "a", "data": "prep"}}, tmp_path)
    assert "nodes: a cycle a -> b -> a" in msg


def test_a_data_node_is_not_a_model_and_a_model_is_not_data(tmp_path):
    msg = error_of({**BASE, "d": {"kind": "dpo", "model": "prep", "data": "prep"}}, tmp_path)
    assert "nodes.d.model: 'prep' is a data_prep node; a model comes from a training node" in msg
    msg = error_of({**BASE, "e": {"kind": "evaluate", "models": ["sft"], "data": "sft"}}, tmp_path)
    assert "nodes.e.data.sources[0]: 'sft' is a sft node; data comes from a data_prep node" in msg


def test_an_evaluate_node_without_select_hands_on_no_model(tmp_path):
    msg = error_of({**BASE, "e": {"kind": "evaluate", "models": ["sft"], "data": "prep"},
                    "d": {"kind": "dpo", "model": "e", "data": "prep"}}, tmp_path)
    assert "nodes.d.model: evaluate node 'e' names no model: give it `select:" in msg


def test_a_sweep_cannot_stand_where_one_model_goes(tmp_path):
    msg = error_of({**BASE, "sft": {**BASE["sft"], "sweep": {"optim.lr": [0.1, 0.2]}},
                    "d": {"kind": "dpo", "model": "sft", "data": "prep"}}, tmp_path)
    assert "nodes.d.model: 'sft' is a sweep of 2 nodes (sft@lr=0.1, sft@lr=0.2)" in msg


def test_layout_the_launcher_cannot_hold(tmp_path):
    msg = error_of({**BASE, "sft": {**BASE["sft"], "parallel": {"tp": 4}}}, tmp_path)
    assert msg.startswith("nodes.sft.parallel:") and "2 ranks" in msg


def test_layout_the_model_cannot_take(tmp_path):
    # tp=2 fits the 2 launched ranks but not a model with 3 heads (traced through the model chain).
    nodes = {**BASE, "sft": {"kind": "sft", "data": "prep",
                             "model": {"name_or_path": "debug", "overrides": {"num_heads": 3, "num_kv_heads": 3,
                                                                             "hidden_size": 48}}},
             "d": {"kind": "dpo", "model": "sft", "data": "prep", "parallel": {"tp": 2}}}
    msg = error_of(nodes, tmp_path)
    assert "nodes.d.parallel: tp=2 does not divide the model's n_heads=3" in msg


def test_missing_files(tmp_path):
    msg = error_of({"prep": {"kind": "data_prep", "sources": [str(tmp_path / "nope.jsonl")]}}, tmp_path)
    assert f"nodes.prep.sources[0]: '{tmp_path / 'nope.jsonl'}' does not exist" in msg
    msg = error_of({"s": {"kind": "sft", "model": "debug", "data": str(tmp_path / "train.jsonl")}}, tmp_path)
    assert "nodes.s.data.sources[0]:" in msg and "neither a node nor an existing file" in msg
    msg = error_of({"s": {"kind": "sft", "model": "debug"}}, tmp_path)
    assert "nodes.s.data: no data" in msg


def test_node_settings_errors_carry_the_key_path(tmp_path):
    msg = error_of({**BASE, "sft": {**BASE["sft"], "lora": {"rnak": 4}}}, tmp_path)
    assert "nodes.sft.lora.rnak: unknown key" in msg and "rank" in msg
    assert "nodes.x.kind: missing; one of data_prep, sft" in error_of({**BASE, "x": {"model": "sft"}}, tmp_path)
    assert "nodes.x.kind: 'ppo'" in error_of({**BASE, "x": {"kind": "ppo"}}, tmp_path)
    assert "nodes.a b: node names" in error_of({**BASE, "a b": {"kind": "sft"}}, tmp_path)
    msg = error_of({**BASE, "sft": {**BASE["sft"], "sweep": {"lora.rank": [4, -1]}}}, tmp_path)
    assert "nodes.sft.lora.rank" in msg and "sweep member lora.rank=-1" in msg


def test_old_format_says_how_to_convert(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("stages: {dpo: false}\nsft_student: {max_steps: 3}\n")
    with pytest.raises(ConfigError, match=r"old fixed-chain format.*posttrain config --convert"):
        load_config(PipelineConfig, path)


# ------------------------------------------------------------------------------ expansion and wiring

def test_sweep_expands_the_grid_and_evaluate_takes_every_member():
    dag = PipelineDAG(cfg_of({**BASE, "sft": {**BASE["sft"], "lora": {"enabled": True},
                                             "sweep": {"lora.rank": [8, 16], "optim.lr": [0.1, 0.01]}},
                              "e": {"kind": "evaluate", "models": ["sft"], "data": "prep",
                                    "select": {"metric": "exact_match"}},
                              "d": {"kind": "dpo", "model": "e", "data": "prep"}}))
    members = [n for n in dag.order if n.startswith("sft@")]
    assert members == ["sft@rank=8@lr=0.1", "sft@rank=8@lr=0.01", "sft@rank=16@lr=0.1", "sft@rank=16@lr=0.01"]
    assert {(dag.nodes[n].cfg.lora.rank, dag.nodes[n].cfg.optim.lr) for n in members} == {
        (8, 0.1), (8, 0.01), (16, 0.1), (16, 0.01)}
    assert dag.inputs("e") == sorted(["prep", *members])
    spec = dag.spec("e", ups(dag, "e"))
    assert spec.models == [f"/w/{m}" for m in members] and spec.data.sources == ["/w/prep"]
    # the best of the sweep, chosen by `e`, is what `d` trains
    assert dag.spec("d", ups(dag, "d")).model.name_or_path == "/w/picked"


def test_rounds_chain_each_round_from_the_one_before():
    dag = PipelineDAG(cfg_of({**BASE, "dpo": {"kind": "dpo", "model": "sft", "data": "prep", "rounds": 3,
                                             "pairs": "on_policy"},
                              "e": {"kind": "evaluate", "models": ["dpo@r1", "dpo"], "data": "prep"}}))
    assert dag.order == ["prep", "sft", "dpo@r1", "dpo@r2", "dpo@r3", "e"]
    assert [dag.inputs(f"dpo@r{k}") for k in (1, 2, 3)] == [["prep", "sft"], ["dpo@r1", "prep"], ["dpo@r2", "prep"]]
    specs = [dag.spec(f"dpo@r{k}", ups(dag, f"dpo@r{k}")) for k in (1, 2, 3)]
    assert [s.model.name_or_path for s in specs] == ["/w/sft", "/w/dpo@r1", "/w/dpo@r2"]
    assert len({s.seed for s in specs}) == 3  # each round samples afresh
    assert dag.spec("e", ups(dag, "e")).models == ["/w/dpo@r1", "/w/dpo@r3"]  # `dpo` = its last round


def test_external_references_stay_paths_and_presets(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    dag = PipelineDAG(cfg_of({"s": {"kind": "sft", "model": "debug", "data": str(data)},
                              "r": {"kind": "sft", "model": "models:/champ@champion", "data": str(data)}}))
    assert dag.edges == []
    assert dag.nodes["r"].external == {"model": "models:/champ@champion"}
    spec = dag.spec("s", {})
    assert spec.model.name_or_path == "debug" and spec.data.sources == [str(data)]
    assert spec.output_dir == str(Path("runs/demo/s")) and spec.launcher is not None and spec.tracking is not None


def test_data_prep_runs_as_one_process_as_the_pool_books_it():
    """Data prep's rank 0 does all the work: its launch starts one process (the device pool books
    one slot for it, posttrain.flows.pipeline._devices), whatever the pipeline's launcher; a training node
    keeps the launcher's ranks."""
    from posttrain.flows.pipeline import _devices

    cfg = cfg_of({"prep": {"kind": "data_prep", "synthetic_size": 10},
                  "s": {"kind": "sft", "model": "debug", "data": "prep"}}, launcher={"nproc_per_node": 4})
    dag = PipelineDAG(cfg)
    prep = dag.spec("prep", {})
    assert prep.launcher.nproc_per_node == 1
    assert _devices(dag, "prep")[0] == ("cpu", 1)
    train = dag.spec("s", ups(dag, "s"))
    assert train.launcher.nproc_per_node == 4
    assert cfg.launcher.nproc_per_node == 4  # the pipeline's own launcher is left as it was


# ------------------------------------------------------------------------------ cache keys

def test_layout_settings_do_not_count_for_the_result_key(tmp_path):
    def key(**sft):
        dag = PipelineDAG(cfg_of({**BASE, "sft": {**BASE["sft"], **sft}}))
        spec = dag.spec("sft", ups(dag, "sft"))
        return cache_key(spec, "sft", node_inputs(dag, "sft", ups(dag, "sft"), {}))

    base = key()
    assert key(parallel={"dp_shard": 1, "dp_replicate": 2}) == base
    assert key(launcher={"nproc_per_node": 1}) == base
    assert key(checkpoint={"interval_steps": 7}, reliability={"max_bad_steps": 9}) == base
    assert key(model={"name_or_path": "debug", "kernels": "torch", "activation_checkpointing": True}) == base
    assert key(optim={"lr": 0.5}) != base
    assert key(lora={"enabled": True}) != base


def test_the_key_follows_upstream_content_and_user_files(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text('{"prompt": "a", "completion": "b"}\n')
    dag = PipelineDAG(cfg_of({**BASE, "sft": {**BASE["sft"], "data": {"sources": ["prep", str(f)]}}}))
    spec = dag.spec("sft", ups(dag, "sft"))
    k1 = cache_key(spec, "sft", node_inputs(dag, "sft", ups(dag, "sft"), {}))
    other = {"prep": Upstream("/w/prep", "another-digest")}
    assert cache_key(spec, "sft", node_inputs(dag, "sft", other, {})) != k1
    f.write_text('{"prompt": "a", "completion": "c"}\n')
    assert cache_key(spec, "sft", node_inputs(dag, "sft", ups(dag, "sft"), {})) != k1


# ------------------------------------------------------------------------------ devices

def test_concurrent_leases_get_disjoint_devices_and_queue():
    pool = DevicePool(gpus=4, cpu_slots=2)
    got, order = {}, []
    first = threading.Event()

    def node(name, n, hold):
        with pool.lease("gpu", n, node=name) as ids:
            got[name] = ids
            order.append(("start", name))
            first.set()
            time.sleep(hold)
            order.append(("end", name))

    a = threading.Thread(target=node, args=("a", 3, 0.3))
    a.start()
    first.wait()
    b = threading.Thread(target=node, args=("b", 2, 0))  # 1 GPU left: waits for a
    c = threading.Thread(target=node, args=("c", 1, 0))  # fits beside a
    b.start(), c.start()
    for t in (a, b, c):
        t.join()
    assert len(got["a"]) == 3 and not set(got["a"]) & set(got["c"])
    assert order.index(("start", "b")) > order.index(("end", "a"))
    assert all(0 <= i < 4 for ids in got.values() for i in ids)
    with pytest.raises(ValueError, match=r"nodes.big: needs 5 GPU rank\(s\).*resources.gpus = 4"):
        pool.check("gpu", 5, "big")


def test_what_a_node_asks_for():
    assert needs("auto", 2, "local", gpus=0) == ("cpu", 2)
    assert needs("auto", 4, "local", gpus=8) == ("gpu", 4)
    assert needs("cuda", 2, "local", gpus=0) == ("gpu", 2)
    assert needs("cuda", 8, "slurm", gpus=0) is None  # the scheduler places it


# ------------------------------------------------------------------------------ workspace lock

def _hold(run_dir, ready, release):
    with node_lock(Path(run_dir), "sft", owner="other-run"):
        ready.set()
        release.wait(30)


@pytest.mark.slow
def test_a_node_dir_held_by_another_process_fails_clearly_or_waits(tmp_path):
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(str(tmp_path), ready, release))
    p.start()
    try:
        assert ready.wait(60)
        with pytest.raises(WorkspaceBusy, match=r"node 'sft': its output directory .* is in use by another "
                                                r"pipeline run \(pid \d+, host .*run other-run"):
            with node_lock(tmp_path, "sft"):
                pass
        threading.Timer(0.5, release.set).start()
        t0 = time.monotonic()
        with node_lock(tmp_path, "sft", wait_s=30):  # queues behind the holder
            assert time.monotonic() - t0 >= 0.4
    finally:
        release.set()
        p.join(30)
    with node_lock(tmp_path, "sft"):  # a holder that died leaves no lock behind
        pass


# ------------------------------------------------------------------------------ converter

def test_old_configs_convert_to_the_same_chain(tmp_path):
    from posttrain.flows.convert import convert

    old = {"name": "x", "stages": {"distill": False},
           "sft_student": {"max_steps": 3, "data": {"batch_tokens": 1024, "max_seq_len": 128}},
           "distill": {"kind": "jsd"}, "evaluate": {"compare_to": ["sft_student", "distill"], "model": {"dtype": "float32"}}}
    new = PipelineConfig.model_validate(convert(old))
    dag = PipelineDAG(new)
    assert dag.order == ["data_prep", "sft_teacher", "sft_student", "dpo", "evaluate"]
    # dpo started from distill, which is off: it passes on distill's start, the student
    assert dag.inputs("dpo") == ["data_prep", "sft_student"]
    assert dag.inputs("evaluate") == ["data_prep", "dpo", "sft_student"]
    assert new.nodes["sft_student"].max_steps == 3 and new.nodes["sft_student"].data.batch_tokens == 1024
