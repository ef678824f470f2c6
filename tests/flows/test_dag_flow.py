"""The DAG flow against Prefect's local API: independent nodes queue for device slots (never more
ranks at once than `resources` allows) and a node whose output dir another run holds fails with
a message naming the holder, leaving that directory untouched. (Data-prep nodes keep it quick.)"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def prefect(tmp_path, monkeypatch):
    from prefect.settings import (PREFECT_SERVER_ANALYTICS_ENABLED, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
                                  temporary_settings)

    monkeypatch.chdir(tmp_path)
    settings = {s: v for s, v in ((PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, 180),
                                  (PREFECT_SERVER_ANALYTICS_ENABLED, False)) if s.name not in os.environ}
    with temporary_settings(settings):
        yield tmp_path


def config(tmp_path: Path, **top):
    from posttrain.flows.config import PipelineConfig

    return PipelineConfig.model_validate({
        "name": "slots", "workspace": str(tmp_path / "runs"), "stage_retries": 0,
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}, "registry": {"enabled": False},
        "nodes": {"a": {"kind": "data_prep", "synthetic_size": 60, "synthetic_seed": 1},
                  "b": {"kind": "data_prep", "synthetic_size": 60, "synthetic_seed": 2}}, **top})


def _hold(run_dir: str, ready, release) -> None:
    from posttrain.flows.workspace import node_lock

    with node_lock(Path(run_dir), "b", owner="someone-else"):
        ready.set()
        release.wait(120)


def test_independent_nodes_queue_for_slots_and_a_held_dir_fails_clearly(prefect):
    from posttrain.flows.pipeline import run_pipeline

    result = run_pipeline(config(prefect, resources={"cpu_slots": 1}))
    assert result.ok and set(result.stages) == {"a", "b"}
    leases = sorted(result.leases, key=lambda x: x["start"])
    assert [x["node"] for x in leases] in (["a", "b"], ["b", "a"]) and all(x["ids"] == [0] for x in leases)
    assert leases[0]["end"] <= leases[1]["start"]  # one slot: the second waited for the first
    for node in "ab":  # and a slot is what each used: data prep runs one process
        assert "--nproc-per-node=1 " in (prefect / "runs" / "slots" / ".launch" / node / "launch.log").read_text()

    cfg = config(prefect, name="held")
    held = Path(cfg.run_dir) / "b"
    held.mkdir(parents=True)
    (held / "theirs.txt").write_text("in progress")
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(str(cfg.run_dir), ready, release))
    p.start()
    try:
        assert ready.wait(60)
        with pytest.raises(Exception, match=r"b: node 'b': its output directory .* is in use by another pipeline "
                                            r"run \(pid \d+.*someone-else"):
            run_pipeline(cfg)
    finally:
        release.set()
        p.join(30)
    assert sorted(os.listdir(held)) == ["theirs.txt"]  # untouched
    assert (Path(cfg.run_dir) / "a" / "manifest.json").exists()  # the other node ran
