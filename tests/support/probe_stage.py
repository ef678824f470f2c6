"""A tiny stage for launcher tests: proves the ranks met, and reports what the launch gave them.

    launch_stage(MODULE, ProbeConfig(...), launcher, workdir=...)
    python -m tests.support.probe_stage --config spec.json      (what every rank runs, under torchrun)

A test fixture, not a product stage: the launcher runs it by its dotted path, which the ranks
import as `tests.support.probe_stage` (tests/conftest.py puts a path to it on every test process's PYTHONPATH).

Every rank joins a gloo process group from the torchrun environment and all-reduces its rank, so a
manifest with `sum == world_size * (world_size - 1) / 2` means every rank rendezvoused. Rank 0 then
writes `<output_dir>/manifest.json` with the world it saw, its launch environment (torchrun, Slurm,
MLflow variables) and the torchrun restart count. Each rank writes its pid to
`<output_dir>/pids/rank<R>.pid`, so a test can check that cancelling left no worker behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from pydantic import Field

from posttrain.core.atomic import write_json_atomic
from posttrain.core.config import from_json_file
from posttrain.stages.config import StageConfig
from posttrain.stages.launch.signals import die_with_agent

MODULE = "tests.support.probe_stage"  # the name to launch it by

# What the manifest reports of the environment: enough to see which launcher ran the ranks and
# that the launcher's env (e.g. MLflow's parent run id) reached them.
_ENV_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PET_", "MLFLOW_", "POSTTRAIN_")
_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "OMP_NUM_THREADS")


class ProbeConfig(StageConfig):
    fail: bool = Field(False, description="Every rank exits 3 at once.")
    fail_once: bool = Field(
        False, description="Rank 0 exits 3 on the first attempt only (a marker file in output_dir), "
                           "so a launch with max_restarts >= 1 succeeds on the restart.")
    sleep_s: float = Field(0.0, ge=0, description="Sleep after writing the pid files (cancel tests).")
    ignore_sigterm: bool = Field(
        False, description="Ranks ignore SIGTERM, like a stage stuck in a collective or a slow save: "
                           "only the launcher's SIGKILL after the grace period stops them.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="ProbeConfig JSON (posttrain.core.config.to_json_file)")
    if not die_with_agent():  # as every product stage does (posttrain.stages.common.parse_spec)
        return 128 + signal.SIGTERM
    cfg = from_json_file(ProbeConfig, parser.parse_args(argv).config)
    if cfg.output_dir is None:
        raise SystemExit("probe: output_dir must be set")
    if cfg.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = Path(cfg.output_dir)
    (out / "pids").mkdir(parents=True, exist_ok=True)
    if cfg.fail:  # before importing torch: the failure tests need no process group, only speed
        print(f"probe: rank {os.environ.get('RANK')} failing on purpose (fail=true)", file=sys.stderr,
              flush=True)
        return 3
    # Imported here so that tests which only render launch specs from ProbeConfig skip torch.
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # reads RANK, WORLD_SIZE, MASTER_ADDR/PORT set by torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(total)
    # Which node (torchrun agent) each rank ran under: one slot per rank, summed over ranks.
    groups = torch.zeros(world, dtype=torch.int64)
    groups[rank] = int(os.environ.get("GROUP_RANK", "0"))
    dist.all_reduce(groups)
    write_json_atomic(out / "pids" / f"rank{rank}.pid", {"pid": os.getpid(), "ppid": os.getppid()})

    marker = out / ".probe_failed_once"
    if cfg.fail_once and rank == 0 and not marker.exists():
        marker.touch()
        print("probe: rank 0 failing on the first attempt (fail_once=true)", file=sys.stderr, flush=True)
        return 3
    if cfg.sleep_s:
        print(f"probe: rank {rank} sleeping {cfg.sleep_s}s", flush=True)
        time.sleep(cfg.sleep_s)

    dist.barrier()
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_KEYS}
        write_json_atomic(out / "manifest.json", {  # the launcher never reads half a manifest
            "stage": "_probe", "world_size": world, "sum": int(total.item()),
            "group_ranks": groups.tolist(),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "env": env})
        print(f"probe: world_size={world} sum={int(total.item())}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
