"""The Kubernetes runner: a ConfigMap holding the spec plus a Kubeflow TrainJob or PyTorchJob
(infra/kubernetes/*.yaml.j2), applied with kubectl, polled for its outcome, deleted to cancel."""

from __future__ import annotations

import json
import re
import subprocess
import time

from posttrain.stages.launch.config import LauncherConfig
from posttrain.stages.launch.base import LaunchError
from posttrain.stages.launch.commands import rank_env, rdzv_id, stage_label, stage_module, templates
from posttrain.stages.launch.logstream import LogSink

SPEC_MOUNT = "/etc/posttrain"  # where Kubernetes pods find the spec ConfigMap
_DONE = {"Complete": 0, "Succeeded": 0, "Failed": 1}  # TrainJob / PyTorchJob conditions


def render_kubernetes(module: str, spec_json: str, launcher: LauncherConfig, *,
                      name: str | None = None, env: dict | None = None, elastic: bool = False) -> list[dict]:
    """[ConfigMap with the spec JSON, TrainJob or PyTorchJob] from infra/kubernetes/*.yaml.j2.

    The first of `launcher.kubernetes.volumes` (each a pod volume plus its mountPath) is taken as
    the workspace: ranks start there, so relative paths in the spec mean what they do locally.
    """
    import yaml

    k8s = launcher.kubernetes
    if not k8s.image:
        raise ValueError("launcher.kubernetes.image is required to render Kubernetes manifests")
    name = name or rdzv_id(module, spec_json).replace("_", "-").lower()[:63].rstrip("-")
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
    cmd = ["python", "-m", "posttrain.stages.launch", "torchrun"]
    cmd += [f"--chdir={k8s.volumes[0]['mountPath']}"] if k8s.volumes else []
    cmd += [f"--nproc-per-node={launcher.nproc_per_node}", f"--max-restarts={launcher.max_restarts}",
            "-m", stage_module(module), "--config", f"{SPEC_MOUNT}/spec.json"]
    cpu = str(k8s.resources.get("cpu", ""))  # "8" splits among ranks; "500m" or none: leave it
    renv = rank_env(launcher, env, cpus=int(cpu) if cpu.isdigit() else None)
    ctx = dict(
        name=name, namespace=k8s.namespace, config_map=f"{name}-spec", spec_dir=SPEC_MOUNT,
        labels={"app.kubernetes.io/name": "posttrain", "posttrain/stage": stage_label(module)},
        spec_json=spec_json, image=k8s.image,
        command=cmd, nnodes=launcher.nnodes, nproc=launcher.nproc_per_node,
        max_restarts=launcher.max_restarts, runtime=k8s.runtime, service_account=k8s.service_account,
        resources={"limits": dict(k8s.resources)} if k8s.resources else {},
        env=[{"name": k, "value": v} for k, v in sorted(renv.items())],
        volumes=volumes, volume_mounts=mounts, elastic=elastic)
    tpl = templates()
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


class KubeJob:
    """An applied TrainJob/PyTorchJob, polled for its Complete/Succeeded/Failed condition."""

    def __init__(self, manifests: list[dict], sink: LogSink, kubectl: str = "kubectl", poll_s: float = 5.0):
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
            if cond.get("status") == "True" and cond.get("type") in _DONE:
                self._sink.put(f"posttrain: {self._refs[-1]} {cond['type']}: {cond.get('message', '')}")
                return _DONE[cond["type"]]
        return None

    def terminate(self, grace_s: float) -> None:
        subprocess.run([self._kubectl, "delete", "-n", self._ns, "--wait=false", *self._refs],
                       capture_output=True, timeout=max(grace_s, 10.0))
