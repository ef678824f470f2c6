"""What every launcher runs, rendered from the spec: the stage module, the torchrun command line,
the ranks' environment, a rendezvous id, and the Jinja templates of the cluster launchers."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import sys
from pathlib import Path

import posttrain.infra

from posttrain.stages.launch.config import LauncherConfig
from posttrain.stages.launch.signals import LAUNCHER_PID_ENV

# The Slurm and Kubernetes templates: infra/, installed as package data of posttrain.infra.
INFRA = Path(posttrain.infra.__file__).resolve().parent
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def stage_module(module: str) -> str:
    """The module the ranks run: `posttrain.stages.<module>` for a stage name ("sft"), a dotted path as
    given ("tests.support.probe_stage": a stage kept outside the product, importable on the ranks' PYTHONPATH)."""
    return module if "." in module else f"posttrain.stages.{module}"


def stage_label(module: str) -> str:
    """The short name job names and labels carry: "sft" for "sft", "probe_stage" for a dotted path."""
    return module.rsplit(".", 1)[-1].strip("_")


def check_stage_module(module: str) -> None:
    """ValueError unless `module` names an importable stage module (before anything is launched)."""
    try:
        found = _MODULE.fullmatch(module) is not None and importlib.util.find_spec(stage_module(module)) is not None
    except ImportError:  # a dotted path whose package does not exist
        found = False
    if not found:
        raise ValueError(f"no stage module {stage_module(module)}")


def rdzv_id(module: str, spec_json: str) -> str:
    """A rendezvous id every node derives alike from what it is given (the stage and its spec
    text, posttrain.core.config.spec_text), with no coordinator."""
    digest = hashlib.sha256(json.dumps([module, spec_json]).encode())
    return f"{stage_label(module)}-{digest.hexdigest()[:12]}"


def torchrun_command(module: str, spec_file: Path, launcher: LauncherConfig, *,
                     rdzv: str | None = None, local_addr: str | None = None) -> list[str]:
    """This node's launcher for kind 'local' (standalone) or 'multinode' (c10d rendezvous)."""
    cmd = [sys.executable, "-m", "posttrain.stages.launch", "torchrun"]
    if launcher.kind == "local":
        cmd += ["--standalone", "--nnodes=1"]
    elif launcher.kind == "multinode":
        cmd += [f"--nnodes={launcher.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={launcher.rdzv_endpoint}", f"--rdzv-id={rdzv}"]
        cmd += [f"--local-addr={local_addr}"] if local_addr else []
    else:
        raise ValueError(f"torchrun_command is for kind 'local' or 'multinode', not {launcher.kind!r}")
    return cmd + [f"--nproc-per-node={launcher.nproc_per_node}", f"--max-restarts={launcher.max_restarts}",
                  "-m", stage_module(module), "--config", str(spec_file)]


def node_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rank_env(launcher: LauncherConfig, env: dict | None, base: dict | None = None, *,
             cpus: int | None = None) -> dict[str, str]:
    """torchrun's and the ranks' environment: `base`, launcher.env, `env` (MLflow's parent run id).

    Given the node's `cpus`, OMP_NUM_THREADS (unless set) gives each rank its share of them: every
    rank at full width oversubscribes the CPU many times over, and torchrun's own default of 1
    starves CPU training on a big host.
    """
    out = {**(base or {}), **launcher.env, **{k: str(v) for k, v in (env or {}).items()}}
    out["PYTHONUNBUFFERED"] = "1"  # lines reach the log as they are printed, not at exit
    if launcher.max_restarts > 0:
        # torchrun keeps one TCP store for the workers across restarts, so a restarted group finds
        # the previous attempt's keys (peer addresses) and gloo/NCCL dial dead ports. Opting out
        # gives every attempt a fresh store hosted by its rank 0.
        out.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if cpus and launcher.nproc_per_node > 1 and "OMP_NUM_THREADS" not in out:
        out["OMP_NUM_THREADS"] = str(max(1, cpus // launcher.nproc_per_node))
    return out


def local_env(launcher: LauncherConfig, env: dict | None) -> dict[str, str]:
    """rank_env for a torchrun started here: this process's environment. The ranks import
    posttrain as installed; nothing is added to their PYTHONPATH (the repository root there would
    let its `kernels/` folder shadow Hugging Face's `kernels`, which transformers imports)."""
    out = rank_env(launcher, env, dict(os.environ), cpus=node_cpus())
    out[LAUNCHER_PID_ENV] = str(os.getpid())  # for the wrapper's PR_SET_PDEATHSIG check
    return out


def templates():
    """The Jinja environment of infra/slurm and infra/kubernetes (`q` shell-quotes a value)."""
    import jinja2  # only the Slurm and Kubernetes paths need it

    env = jinja2.Environment(loader=jinja2.FileSystemLoader([INFRA / "slurm", INFRA / "kubernetes"]),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    env.filters["q"] = lambda v: shlex.quote(str(v))
    return env
