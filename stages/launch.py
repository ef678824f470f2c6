"""Turn a stage spec into a launch: torchrun here, torchrun on several hosts, Slurm, or Kubernetes.

    result = launch_stage("sft", spec, spec.launcher, workdir=run_dir / ".launch/sft")

Whatever the launcher, every rank runs `python -m stages.<module> --config spec.json` under torchrun,
so one spec runs unchanged anywhere; the stage picks gloo or NCCL from its device. The spec is
written into `workdir`, the output streams line by line into a log file and `on_output`, and the
result carries the exit code of the first failing rank and the stage's manifest.json.

Nothing is left running when a launch ends early. Local torchrun runs in its own session, and
torchrun puts each worker in a session of its own, so no process-group kill reaches them all:
`cancel()` snapshots the process tree, sends SIGTERM to torchrun (which passes it to its workers),
and after a grace period SIGKILLs whatever of the tree is still alive. `wait()` cancels on any
exception (KeyboardInterrupt, Prefect's cancellation raised in the calling thread) and turns SIGTERM
into SystemExit when nobody else handles it; if the launching process is killed outright, torchrun
gets SIGTERM from the kernel (PR_SET_PDEATHSIG, set by the `torchrun` wrapper at the bottom).
Slurm jobs are cancelled with scancel, Kubernetes jobs deleted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from core.config import LauncherConfig, StageConfig, dump_config, to_json_file

ROOT = Path(__file__).resolve().parents[1]  # holds the `stages` package; on the ranks' PYTHONPATH
INFRA = ROOT / "infra"
SPEC_MOUNT = "/etc/posttrain"  # where Kubernetes pods find the spec ConfigMap
_SLURM_DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
               "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


class LaunchError(RuntimeError):
    """The launch itself failed (sbatch refused the job, kubectl is missing), not the stage."""


@dataclass
class LaunchResult:
    returncode: int
    """0, the first failing rank's exit code, or 128 + signal."""
    manifest: dict | None
    """`<output_dir>/manifest.json` after a successful run; None after a failure."""
    log_file: Path
    wall_time_s: float
    job_id: str | None = None
    """Slurm job id or Kubernetes job name; None for torchrun launched here."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


# ---------------------------------------------------------------------------------- commands

def rdzv_id(module: str, spec: StageConfig) -> str:
    """A rendezvous id every node derives alike from what it is given, with no coordinator."""
    digest = hashlib.sha256(json.dumps([module, dump_config(spec)], sort_keys=True).encode())
    return f"{module.strip('_')}-{digest.hexdigest()[:12]}"


def torchrun_command(module: str, spec_file: Path, launcher: LauncherConfig, *,
                     rdzv: str | None = None, local_addr: str | None = None) -> list[str]:
    """This node's launcher for kind 'local' (standalone) or 'multinode' (c10d rendezvous)."""
    cmd = [sys.executable, "-m", "stages.launch", "torchrun"]
    if launcher.kind == "local":
        cmd += ["--standalone", "--nnodes=1"]
    elif launcher.kind == "multinode":
        cmd += [f"--nnodes={launcher.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={launcher.rdzv_endpoint}", f"--rdzv-id={rdzv}"]
        cmd += [f"--local-addr={local_addr}"] if local_addr else []
    else:
        raise ValueError(f"torchrun_command is for kind 'local' or 'multinode', not {launcher.kind!r}")
    return cmd + [f"--nproc-per-node={launcher.nproc_per_node}", f"--max-restarts={launcher.max_restarts}",
                  "-m", f"stages.{module}", "--config", str(spec_file)]


def _cpus() -> int:
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


def _local_env(launcher: LauncherConfig, env: dict | None) -> dict[str, str]:
    out = rank_env(launcher, env, dict(os.environ), cpus=_cpus())
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), out.get("PYTHONPATH")) if p)
    out["POSTTRAIN_LAUNCHER_PID"] = str(os.getpid())  # for the wrapper's PR_SET_PDEATHSIG check
    return out


# ---------------------------------------------------------------------------------- process trees

def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, start time, state) of every process, from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path("/proc", name, "stat").read_text()
            except OSError:  # exited while we looked
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
            table[int(name)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def _tree(root: int) -> dict[int, int]:
    """pid -> start time of `root` and all its descendants (just `root` where there is no /proc)."""
    if not os.path.isdir("/proc/self"):
        return {root: 0}
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in found:
            found[pid] = table[pid][1]
            todo += children.get(pid, [])
    return found


def _alive(pid: int, start: int) -> bool:
    """Still running: not gone, not a zombie, and not a new process that reused the pid."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
    try:
        stat = Path("/proc", str(pid), "stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] not in ("Z", "X") and int(fields[19]) == start


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Sink:
    """Output lines go to the log file at once (complete even if the caller stalls) and to a queue
    that `drain` hands to on_output in the caller's thread, where Prefect's run logger works."""

    def __init__(self, path: Path, on_output: Callable[[str], None] | None, header: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8", buffering=1)
        self._file.write(header + "\n")
        self._lock = threading.Lock()
        self._on_output = on_output
        self._queue: queue.SimpleQueue[str] = queue.SimpleQueue()

    def put(self, line: str) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
        if self._on_output is not None:
            self._queue.put(line)

    def drain(self) -> None:
        while self._on_output is not None:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return
            self._on_output(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class _Node:
    """One torchrun started here, in its own session, its output pumped into the sink."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, sink: _Sink, prefix: str = ""):
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.job_id = None
        # Known descendants. Refreshed now and then, so that if torchrun itself dies (OOM killer)
        # the workers it leaves behind, now children of init, can still be found and killed.
        self._known: dict[int, int] = {}
        self._next_scan = 0.0
        self._pump = threading.Thread(target=self._read, args=(sink, prefix), daemon=True)
        self._pump.start()

    def _read(self, sink: _Sink, prefix: str) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            sink.put(prefix + raw.decode("utf-8", "replace").rstrip("\r\n"))
        self.proc.stdout.close()

    def _scan(self) -> None:
        if self.proc.returncode is None:
            self._known.update(_tree(self.proc.pid))

    def poll(self) -> int | None:
        if time.monotonic() >= self._next_scan:
            self._scan()
            self._next_scan = time.monotonic() + 2.0
        rc = self.proc.poll()
        if rc is not None and any(_alive(p, s) for p, s in self._known.items() if p != self.proc.pid):
            self.terminate(grace_s=5.0)  # torchrun is gone; its leftovers must not outlive it
        if rc is not None:
            self._pump.join(timeout=5.0)  # the last lines, before the caller reads the log
        return rc

    def terminate(self, grace_s: float) -> None:
        self._scan()  # before signalling: once torchrun exits, its workers leave its tree
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # torchrun passes SIGTERM on to its workers
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._scan()  # a restart may have started new workers
            if self.proc.poll() is not None and not any(_alive(p, s) for p, s in self._known.items()):
                break
            time.sleep(0.05)
        for pid, start in self._known.items():
            if _alive(pid, start):
                _signal(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._pump.join(timeout=5.0)


# ---------------------------------------------------------------------------------- Slurm

def _templates():
    import jinja2  # only the Slurm and Kubernetes paths need it

    env = jinja2.Environment(loader=jinja2.FileSystemLoader([INFRA / "slurm", INFRA / "kubernetes"]),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    env.filters["q"] = lambda v: shlex.quote(str(v))
    return env


def render_sbatch(module: str, spec_file: Path, launcher: LauncherConfig, *, workdir: Path,
                  env: dict | None = None, python: str = sys.executable, cwd: Path | None = None) -> str:
    """The batch script (infra/slurm/stage.sbatch.j2): one srun task per node runs torchrun, and
    the torchruns meet at a c10d rendezvous on the allocation's first node."""
    return _templates().get_template("stage.sbatch.j2").render(
        module=module, job_name=f"posttrain-{module.strip('_')}", nnodes=launcher.nnodes,
        nproc=launcher.nproc_per_node, max_restarts=launcher.max_restarts, slurm=launcher.slurm,
        output=Path(workdir).resolve() / "slurm-%j.out", cwd=Path(cwd or Path.cwd()).resolve(),
        spec_file=Path(spec_file).resolve(), python=python, pythonpath=str(ROOT),
        env={k: v for k, v in rank_env(launcher, env).items() if k != "PYTHONUNBUFFERED"})


def slurm_job_state(job_id: str) -> tuple[str, int | None]:
    """(state, exit status) of a job: scontrol while the controller remembers it, then sacct."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    if out.returncode == 0 and "JobState=" in out.stdout:
        fields = dict(tok.split("=", 1) for tok in out.stdout.split() if "=" in tok)
        state, exit_code = fields["JobState"], fields.get("ExitCode", "0:0")
    else:
        out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"],
                             capture_output=True, text=True)
        if out.returncode != 0 or "|" not in out.stdout:
            return "UNKNOWN", None
        state, exit_code = out.stdout.splitlines()[0].split("|")[:2]
        state = state.split()[0]  # "CANCELLED by 0"
    if state not in _SLURM_DONE:
        return state, None
    code, sig = (int(x) for x in exit_code.split(":"))
    return state, 0 if state == "COMPLETED" else code or (128 + sig if sig else 1)


class _SlurmJob:
    """A submitted batch job: polled with scontrol/sacct, its output file tailed into the sink."""

    def __init__(self, script: Path, workdir: Path, sink: _Sink, poll_s: float = 1.0):
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        if out.returncode != 0:
            raise LaunchError(f"sbatch {script} failed ({out.returncode}): {out.stderr.strip()}")
        self.job_id = out.stdout.strip().split(";")[0]  # "id" or "id;cluster"
        self._output = Path(workdir).resolve() / f"slurm-{self.job_id}.out"
        self._sink, self._poll_s = sink, poll_s
        self._offset, self._partial, self._next, self._unknown = 0, b"", 0.0, 0
        sink.put(f"posttrain: submitted Slurm job {self.job_id}, output {self._output}")

    def _tail(self, final: bool = False) -> None:
        try:
            with open(self._output, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:  # still pending
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        if final and self._partial:
            lines, self._partial = lines + [self._partial], b""
        for line in lines:
            self._sink.put(line.decode("utf-8", "replace").rstrip("\r"))

    def poll(self) -> int | None:
        self._tail()
        if time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + self._poll_s
        state, rc = slurm_job_state(self.job_id)
        if state == "UNKNOWN":
            # A controller restart is transient; a job that neither scontrol nor sacct knows for a
            # minute is gone (purged, accounting off) and its fate cannot be learned.
            self._unknown += 1
            if self._unknown * self._poll_s < 60:
                return None
            self._sink.put(f"posttrain: Slurm job {self.job_id} vanished; reporting failure")
            return 1
        self._unknown = 0
        if rc is not None:
            self._tail(final=True)
            self._sink.put(f"posttrain: Slurm job {self.job_id} {state}, exit status {rc}")
        return rc

    def terminate(self, grace_s: float) -> None:
        subprocess.run(["scancel", self.job_id], capture_output=True)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and slurm_job_state(self.job_id)[1] is None:
            time.sleep(0.5)
        self._tail(final=True)


# ---------------------------------------------------------------------------------- Kubernetes

_K8S_DONE = {"Complete": 0, "Succeeded": 0, "Failed": 1}  # TrainJob / PyTorchJob conditions


def render_kubernetes(module: str, spec: StageConfig, launcher: LauncherConfig, *,
                      name: str | None = None, env: dict | None = None, elastic: bool = False) -> list[dict]:
    """[ConfigMap with the spec JSON, TrainJob or PyTorchJob] from infra/kubernetes/*.yaml.j2.

    The first of `launcher.kubernetes.volumes` (each a pod volume plus its mountPath) is taken as
    the workspace: ranks start there, so relative paths in the spec mean what they do locally.
    """
    import yaml

    k8s = launcher.kubernetes
    if not k8s.image:
        raise ValueError("launcher.kubernetes.image is required to render Kubernetes manifests")
    name = name or rdzv_id(module, spec).replace("_", "-").lower()[:63].rstrip("-")
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
        raise ValueError(f"job name {name!r} is not a DNS label (a-z, 0-9, '-', at most 63)")
    volumes = [{"name": "posttrain-spec", "configMap": {"name": f"{name}-spec"}}]
    mounts = [{"name": "posttrain-spec", "mountPath": SPEC_MOUNT, "readOnly": True}]
    for i, vol in enumerate(k8s.volumes):
        if "name" not in vol or "mountPath" not in vol:
            raise ValueError(f"launcher.kubernetes.volumes[{i}] needs 'name' and 'mountPath', got {vol}")
        mount_keys = ("mountPath", "subPath", "readOnly")
        volumes.append({k: v for k, v in vol.items() if k not in mount_keys})
        mounts.append({"name": vol["name"], **{k: vol[k] for k in mount_keys if k in vol}})
    cmd = ["python", "-m", "stages.launch", "torchrun"]
    cmd += [f"--chdir={k8s.volumes[0]['mountPath']}"] if k8s.volumes else []
    cmd += [f"--nproc-per-node={launcher.nproc_per_node}", f"--max-restarts={launcher.max_restarts}",
            "-m", f"stages.{module}", "--config", f"{SPEC_MOUNT}/spec.json"]
    cpu = str(k8s.resources.get("cpu", ""))  # "8" splits among ranks; "500m" or none: leave it
    renv = rank_env(launcher, env, cpus=int(cpu) if cpu.isdigit() else None)
    ctx = dict(
        name=name, namespace=k8s.namespace, config_map=f"{name}-spec", spec_dir=SPEC_MOUNT,
        labels={"app.kubernetes.io/name": "posttrain", "posttrain/stage": module.strip("_")},
        spec_json=json.dumps(dump_config(spec), indent=2, sort_keys=True), image=k8s.image,
        command=cmd, nnodes=launcher.nnodes, nproc=launcher.nproc_per_node,
        max_restarts=launcher.max_restarts, runtime=k8s.runtime, service_account=k8s.service_account,
        resources={"limits": dict(k8s.resources)} if k8s.resources else {},
        env=[{"name": k, "value": v} for k, v in sorted(renv.items())],
        volumes=volumes, volume_mounts=mounts, elastic=elastic)
    tpl = _templates()
    job_template = "trainjob.yaml.j2" if k8s.api == "trainjob" else "pytorchjob.yaml.j2"
    return [yaml.safe_load(tpl.get_template(t).render(**ctx)) for t in ("configmap.yaml.j2", job_template)]


def apply_kubernetes(manifests: list[dict], kubectl: str = "kubectl") -> str:
    """`kubectl apply` the manifests (as one List); LaunchError if kubectl is missing or refuses."""
    doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests})
    try:
        out = subprocess.run([kubectl, "apply", "-f", "-"], input=doc, capture_output=True, text=True)
    except FileNotFoundError:
        raise LaunchError(f"{kubectl!r} not found; render_kubernetes() and apply the manifests yourself") from None
    if out.returncode != 0:
        raise LaunchError(f"kubectl apply failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


class _KubeJob:
    """An applied TrainJob/PyTorchJob, polled for its Complete/Succeeded/Failed condition."""

    def __init__(self, manifests: list[dict], sink: _Sink, kubectl: str = "kubectl", poll_s: float = 5.0):
        self._sink, self._kubectl, self._poll_s, self._next = sink, kubectl, poll_s, 0.0
        job = manifests[-1]
        self.job_id = job["metadata"]["name"]
        self._ns = job["metadata"]["namespace"]
        self._refs = [f"{m['kind'].lower()}.{m['apiVersion'].split('/')[0]}/{m['metadata']['name']}"
                      if "/" in m["apiVersion"] else f"{m['kind'].lower()}/{m['metadata']['name']}"
                      for m in manifests]
        for line in apply_kubernetes(manifests, kubectl).splitlines():
            sink.put(line)

    def poll(self) -> int | None:
        if time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + self._poll_s
        out = subprocess.run([self._kubectl, "get", "-n", self._ns, self._refs[-1], "-o", "json"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            return None  # API server hiccup; the job is still there or deletion will say so
        for cond in json.loads(out.stdout).get("status", {}).get("conditions", []):
            if cond.get("status") == "True" and cond.get("type") in _K8S_DONE:
                self._sink.put(f"posttrain: {self._refs[-1]} {cond['type']}: {cond.get('message', '')}")
                return _K8S_DONE[cond["type"]]
        return None

    def terminate(self, grace_s: float) -> None:
        subprocess.run([self._kubectl, "delete", "-n", self._ns, "--wait=false", *self._refs],
                       capture_output=True, timeout=max(grace_s, 10.0))


# ---------------------------------------------------------------------------------- launching

@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """In the main thread, with no SIGTERM handler installed, SIGTERM (how Prefect and schedulers
    stop a flow process) raises SystemExit, so `wait` cancels the launch before the process goes.
    A handler someone else installed (Prefect's, which raises in its own way) is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Launch:
    """A stage being run: `with Launch(...) as job: result = job.wait()`.

    Leaving the block by an exception, or calling `cancel()` from another thread, stops the job and
    every process it started. Start and wait in the same thread: torchrun is told to die with the
    thread that started it (PR_SET_PDEATHSIG is per thread).
    `nodes > 1` (kind 'multinode') runs that many node launchers on this host, which is how the
    tests, and a single box posing as a cluster, exercise the c10d rendezvous.
    """

    def __init__(self, module: str, spec: StageConfig, launcher: LauncherConfig, *, workdir: Path,
                 env: dict | None = None, log_file: Path | None = None,
                 on_output: Callable[[str], None] | None = None, grace_s: float = 15.0, nodes: int = 1):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", module) or importlib.util.find_spec(
                f"stages.{module}") is None:
            raise ValueError(f"no stage module stages.{module}")
        if nodes > 1 and (launcher.kind != "multinode" or nodes != launcher.nnodes):
            raise ValueError(f"nodes={nodes} needs kind='multinode' with nnodes={nodes}")
        self.module, self.spec, self.launcher, self.env = module, spec, launcher, env
        self.workdir = Path(workdir).resolve()
        self.log_file = Path(log_file or self.workdir / "launch.log").resolve()
        self.on_output, self.grace_s, self.nodes = on_output, grace_s, nodes
        self._runners: list = []
        self._sink: _Sink | None = None
        self._cancelled = False

    def start(self) -> Launch:
        try:
            return self._start()
        except BaseException:  # e.g. sbatch refused the job, or Ctrl-C while torchrun starts
            self.cancel()
            raise

    def _start(self) -> Launch:
        self._cwd = Path.cwd()  # relative paths in the spec are read from here, by ranks and manifest
        spec_file = to_json_file(self.spec, self.workdir / "spec.json").resolve()
        kind = self.launcher.kind
        self._sink = _Sink(self.log_file, self.on_output,
                           f"==> posttrain launch stages.{self.module} ({kind}) {time.strftime('%F %T')}")
        self._t0 = time.monotonic()
        if kind in ("local", "multinode"):
            env = _local_env(self.launcher, self.env)
            rid = rdzv_id(self.module, self.spec)
            # Node launchers on one host must agree on the address the workers meet at.
            addr = "127.0.0.1" if self.nodes > 1 else None
            cmd = torchrun_command(self.module, spec_file, self.launcher, rdzv=rid, local_addr=addr)
            self._sink.put("posttrain: " + shlex.join(cmd))
            for i in range(self.nodes):  # one by one, so that a cancel mid-way finds each started
                self._runners.append(_Node(cmd, env, self._cwd, self._sink,
                                           f"[node{i}] " if self.nodes > 1 else ""))
        elif kind == "slurm":
            script = self.workdir / "stage.sbatch"
            script.write_text(render_sbatch(self.module, spec_file, self.launcher, workdir=self.workdir,
                                            env=self.env, cwd=self._cwd))
            self._runners = [_SlurmJob(script, self.workdir, self._sink)]
        else:
            manifests = render_kubernetes(self.module, self.spec, self.launcher, env=self.env)
            (self.workdir / "manifests.json").write_text(json.dumps(manifests, indent=2))
            self._runners = [_KubeJob(manifests, self._sink)]
        return self

    def wait(self) -> LaunchResult:
        assert self._sink is not None, "start() first"
        codes: list[int | None] = [None] * len(self._runners)
        rc = 0  # the first failure's code; the nodes stopped after it report only their SIGTERM
        try:
            with _sigterm_raises():
                while any(c is None for c in codes):
                    codes = [c if c is not None else r.poll() for c, r in zip(codes, self._runners)]
                    if not rc and (rc := next((c for c in codes if c), 0)):
                        # One node failed: the others would hang in collectives until timeout.
                        for c, r in zip(codes, self._runners):
                            if c is None:
                                r.terminate(self.grace_s)
                    self._sink.drain()
                    # Short sleeps: Prefect cancels a task thread with an exception that only
                    # lands between bytecodes, never inside a long blocking wait.
                    time.sleep(0.1)
        except BaseException:
            self.cancel()
            raise
        finally:
            self._sink.drain()
        self._sink.close()
        return LaunchResult(returncode=rc, manifest=self._manifest() if rc == 0 else None,
                            log_file=self.log_file, wall_time_s=time.monotonic() - self._t0,
                            job_id=self.job_id)

    @property
    def job_id(self) -> str | None:
        """Slurm job id or Kubernetes job name, once started."""
        return self._runners[0].job_id if self._runners else None

    @property
    def pids(self) -> list[int]:
        """The torchrun processes started here (one per node launcher)."""
        return [r.proc.pid for r in self._runners if isinstance(r, _Node)]

    def _manifest(self) -> dict | None:
        if self.spec.output_dir is None:
            return None
        path = self._cwd / self.spec.output_dir / "manifest.json"
        return json.loads(path.read_text()) if path.exists() else None

    def cancel(self) -> None:
        """SIGTERM the whole job, SIGKILL what is left after `grace_s`; safe to call twice."""
        if self._cancelled or self._sink is None:
            return
        self._cancelled = True
        self._sink.put(f"posttrain: cancelling (grace {self.grace_s}s)")
        for r in self._runners:
            r.terminate(self.grace_s)
        self._sink.close()

    def __enter__(self) -> Launch:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.cancel()


def launch_stage(module: str, spec: StageConfig, launcher: LauncherConfig, *, workdir: Path,
                 env: dict | None = None, log_file: Path | None = None,
                 on_output: Callable[[str], None] | None = None, grace_s: float = 15.0) -> LaunchResult:
    """Run `stages.<module>` with `spec` on `launcher` and wait for it (see the module docstring).

    kind 'multinode' runs this host's node launcher; start it the same way on every node, or use
    launch_nodes to run all of them here.
    """
    with Launch(module, spec, launcher, workdir=workdir, env=env, log_file=log_file,
                on_output=on_output, grace_s=grace_s) as job:
        return job.wait()


def launch_nodes(module: str, spec: StageConfig, launcher: LauncherConfig, *, workdir: Path,
                 env: dict | None = None, log_file: Path | None = None,
                 on_output: Callable[[str], None] | None = None, grace_s: float = 15.0) -> LaunchResult:
    """All `launcher.nnodes` node launchers of a 'multinode' launch, on this host."""
    with Launch(module, spec, launcher, workdir=workdir, env=env, log_file=log_file,
                on_output=on_output, grace_s=grace_s, nodes=launcher.nnodes) as job:
        return job.wait()


# ---------------------------------------------------------------------------------- torchrun wrapper

def _torchrun(argv: list[str]) -> int:
    """torchrun with its own arguments, plus what the launcher needs of it: exit with the first
    failing rank's exit code (torchrun exits 1 whatever the rank's), die with the launching thread
    (PR_SET_PDEATHSIG; torchrun then stops its workers), and `--chdir=DIR` first for pods."""
    parent = os.environ.pop("POSTTRAIN_LAUNCHER_PID", None)
    if parent and sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != int(parent):  # the launcher died before the line above took effect
            return 128 + signal.SIGTERM
    if argv and argv[0].startswith("--chdir="):
        os.chdir(argv.pop(0).split("=", 1)[1])
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run.run(run.parse_args(argv))
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code if code < 0 else 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["torchrun"]:
        sys.exit("usage: python -m stages.launch torchrun [torchrun arguments]")
    sys.exit(_torchrun(sys.argv[2:]))
