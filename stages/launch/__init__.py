"""Turn a stage spec into a launch: torchrun here, torchrun on several hosts, Slurm, or Kubernetes.

    result = launch_stage("sft", spec, spec.launcher, workdir=run_dir / ".launch/sft")

Whatever the launcher, every rank runs `python -m posttrain.stages.<module> --config spec.json` under torchrun
(`module` is a stage name, or a dotted module path importable from the repository root), so one
spec runs unchanged anywhere; the stage picks gloo or NCCL from its device. The spec is
written into `workdir`, the output streams line by line into a log file and `on_output`, and the
result carries the exit code of the first failing rank and the stage's manifest.json.

Nothing is left running when a launch ends early. Local torchrun runs in its own session, and
torchrun puts each worker in a session of its own, so no process-group kill reaches them all:
`cancel()` snapshots the process tree, sends SIGTERM to torchrun (which passes it to its workers),
and after a grace period SIGKILLs whatever of the tree is still alive. `wait()` cancels on any
exception (KeyboardInterrupt, Prefect's cancellation raised in the calling thread) and turns SIGTERM
into SystemExit when nobody else handles it; if the launching process is killed outright, torchrun
gets SIGTERM from the kernel (PR_SET_PDEATHSIG, set by the torchrun wrapper in wrapper.py).
Slurm jobs are cancelled with scancel, Kubernetes jobs deleted.

One runner per backend behind the poll/terminate interface of base.Runner: local (torchrun here,
standalone or multi-node c10d), slurm, kubernetes; job.Launch drives them. Shared pieces: commands
(torchrun command line, ranks' environment, rendezvous id, templates), proctree (/proc process
trees), logstream (output into the log and on_output), signals (SIGTERM and PR_SET_PDEATHSIG), and
wrapper (`python -m posttrain.stages.launch torchrun`). Nothing here imports torch but the wrapper, in
torchrun's own process: the flow process never imports it.
"""

from posttrain.stages.launch.base import LaunchError, LaunchResult, Runner
from posttrain.stages.launch.commands import INFRA, rank_env, rdzv_id, stage_module, torchrun_command
from posttrain.stages.launch.job import Launch, launch_nodes, launch_stage
from posttrain.stages.launch.kubernetes import SPEC_MOUNT, apply_kubernetes, render_kubernetes
from posttrain.stages.launch.slurm import render_sbatch, slurm_job_state

__all__ = [
    "INFRA", "SPEC_MOUNT", "Launch", "LaunchError", "LaunchResult", "Runner", "apply_kubernetes",
    "launch_nodes", "launch_stage", "rank_env", "rdzv_id", "render_kubernetes", "render_sbatch", "slurm_job_state",
    "stage_module", "torchrun_command",
]
