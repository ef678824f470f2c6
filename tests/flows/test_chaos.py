"""Chaos: the demo pipeline (reduced) driven as a user drives it, `python -m posttrain.flows.cli run CONFIG
--set ...`, while a seeded RNG SIGKILLs, at chosen moments, a training rank, the torchrun
launcher, or the flow process itself (while a stage runs, right after it wrote a checkpoint, or
at any moment); after each kill the same command runs again, and the next kill lands in that
rerun. Once K kills are done the command runs to completion.

Then, against an uninterrupted run of the same command (run first, at the same path, then moved
aside), and with some rerun having resumed from a checkpoint:
- every stage's manifest digest, and the registered model's files, are bitwise equal;
- MLflow: no run is left RUNNING; every interrupted attempt's pipeline run, and its run of the
  stage the kill landed in, are FAILED or KILLED (unless that stage had finished: then it is its
  one FINISHED run, the one its manifest names, and the reruns use it from the cache);
- Prefect: no flow run is left Running, a killed flow's is Crashed;
- no process of an attempt outlives it: after a rank or the launcher is killed the flow fails
  and exits; after the flow is killed its launcher and ranks die with it, and its ephemeral
  Prefect API server is stopped by the next run.

POSTTRAIN_CHAOS_SEED and POSTTRAIN_CHAOS_KILLS choose another schedule; the kill points, and
what each attempt did, are printed and written to <tmp>/chaos-report.json. The run takes about
10 minutes on 2 busy CPU cores (the uninterrupted reference about 4 of them).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("POSTTRAIN_CHAOS_SEED", "20251201"))
KILLS = int(os.environ.get("POSTTRAIN_CHAOS_KILLS", "5"))
KINDS = ("rank", "launcher", "flow")


@dataclass
class ChaosConfig:
    config: Path  # the pipeline config file `posttrain run` is given
    overrides: list[str]  # its --set arguments
    stages: list[str]  # the stages that run, in order
    training: list[str]  # those of them that checkpoint
    name: str  # the pipeline's name (MLflow tag posttrain.pipeline)
    model_name: str  # the registered model
    run_dir: Path  # where the stages' output directories are
    workspace: Path  # the directory the command runs in (MLflow's database and artifacts)

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / stage

    def launch_log(self, stage: str) -> Path:
        return self.run_dir / ".launch" / stage / "launch.log"


def chaos_config(workspace: Path) -> ChaosConfig:
    """The pipeline under test, in the one place this test knows the config format: the demo
    DAG cut to data prep -> SFT -> DPO -> evaluation (+ registry), with tiny step counts and a
    checkpoint every few steps, so that kills land mid-training and resumes have something to
    resume. No stage retries: every kill fails its attempt, and the rerun must recover."""
    import yaml

    from posttrain.flows.demo import DEMO_CONFIG

    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    nodes = demo["nodes"]
    student = {**nodes["student"], "max_steps": 24, "eval_interval": 12, "checkpoint": {"interval_steps": 4}}
    dpo = {**nodes["dpo"], "model": "student", "max_steps": 12, "epochs": 12, "eval_interval": 6,
           "checkpoint": {"interval_steps": 3}}
    dpo.pop("rounds", None)
    for node in (student, dpo):  # the sharded default layout: with the demo's faster DDP, kills timed for
        node.pop("parallel", None)  # a stage's run can land after it has finished
    evaluate = {**nodes["evaluate"], "models": ["dpo", "student"], "max_examples": 8, "max_new_tokens": 6}
    evaluate.pop("select", None)
    cfg = {**demo, "name": "chaos", "workspace": str(workspace / "runs"), "stage_retries": 0, "retry_delay_s": 0,
           "tracking": {**demo["tracking"], "tracking_uri": f"sqlite:///{workspace / 'mlflow.db'}"},
           "registry": {**demo["registry"], "model_name": "chaos-model", "evaluate": None},
           "nodes": {"prep": {**nodes["prep"], "synthetic_size": 300}, "student": student, "dpo": dpo,
                     "evaluate": evaluate}}
    path = workspace.parent / "chaos.yaml"  # beside the workspace, which the test moves aside
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return ChaosConfig(path, [], ["prep", "student", "dpo", "evaluate"],
                       ["student", "dpo"], "chaos", "chaos-model", workspace / "runs" / "chaos", workspace)


# ------------------------------------------------------------------------------ processes

def _tagged(token: str) -> list[psutil.Process]:
    """Every live process started under this attempt (they inherit CHAOS_TOKEN from the flow)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("CHAOS_TOKEN") == token and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _role(p: psutil.Process) -> tuple[str, str | None]:
    """(flow | launcher | rank | server | other, the stage a launcher or rank belongs to)."""
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "other", None
    stage = None
    if "--config" in cmd and cmd.index("--config") + 1 < len(cmd):
        stage = Path(cmd[cmd.index("--config") + 1]).parent.name  # <run>/.launch/<stage>/spec.json
    if "posttrain.flows.cli" in cmd:
        return "flow", None
    if "posttrain.stages.launch" in cmd and "torchrun" in cmd:
        return "launcher", stage
    if any(c.startswith("posttrain.stages.") for c in cmd) and stage:
        return "rank", stage
    if any("uvicorn" in c for c in cmd):
        return "server", None
    return "other", None


def _roles(token: str) -> list[tuple[psutil.Process, str, str | None]]:
    return [(p, *_role(p)) for p in _tagged(token)]


@dataclass
class Attempt:
    n: int
    cmd: list[str]
    cwd: Path
    env: dict[str, str]
    log: Path
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    def start(self) -> Attempt:
        self.t0 = time.monotonic()
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env={**self.env, "CHAOS_TOKEN": self.token},
                                     stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._out.close()

    def tail(self, n: int = 60) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-n:])

    def leftovers(self, timeout: float, allow: tuple[str, ...] = ()) -> list[str]:
        """Processes of this attempt still alive after `timeout` s (roles in `allow` excepted)."""
        deadline = time.monotonic() + timeout
        while True:
            left = [(p, r, s) for p, r, s in _roles(self.token) if r not in allow]
            if not left or time.monotonic() > deadline:
                return [f"{r}({s}) pid {p.pid}: {' '.join(p.cmdline())[:200]}" for p, r, s in left if _alive(p)]
            time.sleep(0.5)

    def reap(self, but: tuple[str, ...] = ()) -> None:
        """Test hygiene, after the checks: whatever of this attempt is still alive goes (roles in `but` excepted)."""
        for p, role, _ in _roles(self.token):
            if role not in but:
                try:
                    p.kill()
                except psutil.Error:
                    pass


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _env(prefect_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "POSTTRAIN_"))}
    env.update(PREFECT_HOME=str(prefect_home), PYTHONUNBUFFERED="1")
    return env


def _command(cc: ChaosConfig) -> list[str]:
    return [sys.executable, "-m", "posttrain.flows.cli", "run", str(cc.config), *(f"--set={o}" for o in cc.overrides)]


# ------------------------------------------------------------------------------ kills

def kill_schedule(rng: random.Random, k: int) -> list[dict]:
    """k kills: each kind at least once, the rest drawn. Each has a target (`pick`: a fraction
    choosing among the stages still to finish when its attempt starts; or, for some flow kills,
    `anywhere`: a moment since the start, maybe during Prefect's start-up or between stages), a
    trigger (`up`: the target's ranks are running; `checkpoint`: the target wrote a new checkpoint,
    so that the rerun resumes from it; at least one kill has it) and a delay after the trigger.
    At least one flow kill lands while a stage runs."""
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(k - len(KINDS))]
    rng.shuffle(kinds)
    plan = []
    for i, kind in enumerate(kinds):  # the first flow kill lands in a stage, a later one maybe anywhere
        anywhere = kind == "flow" and "flow" in kinds[:i] and rng.random() < 0.5
        trigger = "checkpoint" if rng.random() < 0.5 else "up"
        delay = rng.uniform(5.0, 90.0) if anywhere else rng.uniform(0.0, 1.0 if trigger == "checkpoint" else 3.0)
        plan.append({"kind": kind, "pick": round(rng.random(), 3), "anywhere": anywhere,
                     "trigger": None if anywhere else trigger, "delay_s": round(delay, 2)})
    if not any(p["trigger"] == "checkpoint" for p in plan):
        p = next(p for p in plan if not p["anywhere"])
        p["trigger"], p["delay_s"] = "checkpoint", round(rng.uniform(0.0, 1.0), 2)
    return plan


def _stage_running(token: str) -> dict[str, list[tuple[psutil.Process, str]]]:
    """stage -> [(process, launcher | rank)] of the stage jobs now running."""
    out: dict[str, list] = {}
    for p, role, stage in _roles(token):
        if role in ("launcher", "rank") and stage:
            out.setdefault(stage, []).append((p, role))
    return out


def _ranks_up(token: str, stage: str) -> bool:
    return any(r == "rank" for _, r in _stage_running(token).get(stage, []))


def _latest(cc: ChaosConfig, stage: str) -> str | None:
    """The stage's newest complete checkpoint (posttrain.core.checkpoint's `latest`), None before its first."""
    try:
        return (cc.stage_dir(stage) / "checkpoints" / "latest").read_text().strip()
    except OSError:
        return None


def _wait_for(attempt: Attempt, cond, every_s: float = 0.25, timeout: float = 900.0):
    """cond()'s first true value (tried every `every_s`); None if the attempt ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if attempt.proc.poll() is not None:
            return None
        if (got := cond()):
            return got
        time.sleep(every_s)
    raise AssertionError(f"attempt {attempt.n}: timed out waiting\n{attempt.tail()}")


def _sleep(attempt: Attempt, seconds: float) -> bool:
    end = time.monotonic() + seconds
    return _wait_for(attempt, lambda: time.monotonic() >= end) is not None


def execute_kill(attempt: Attempt, plan: dict, cc: ChaosConfig, pending: list[str],
                 rng: random.Random) -> dict | None:
    """Carry out one planned kill in `attempt`; what was killed, or None if the attempt ended first."""
    kind, token, target = plan["kind"], attempt.token, None
    if plan["anywhere"]:
        if not _sleep(attempt, plan["delay_s"]):
            return None
    else:
        trained = [s for s in pending if s in cc.training]
        among = trained if plan["trigger"] == "checkpoint" and trained else pending
        target = among[int(plan["pick"] * len(among))]
        done = cc.stage_dir(target) / "manifest.json"
        if not _wait_for(attempt, lambda: _ranks_up(token, target) or done.exists()):
            return None
        if plan["trigger"] == "checkpoint" and target in cc.training:
            before = _latest(cc, target)  # a checkpoint written in this attempt, not one resumed from
            if not _wait_for(attempt, lambda: _latest(cc, target) not in (None, before) or done.exists(), 0.05):
                return None
        if not _sleep(attempt, plan["delay_s"]):
            return None
    if kind == "flow":
        running = _stage_running(token)
        victim, stage = attempt.proc.pid, (target if target in running else next(iter(running), None))
    else:  # the target's job, or the job running now (the target may have finished meanwhile)
        role = "rank" if kind == "rank" else "launcher"

        def candidates():
            running = {s: [p.pid for p, r in procs if r == role] for s, procs in _stage_running(token).items()}
            running = {s: pids for s, pids in running.items() if pids}
            if running:
                stage = target if target in running else sorted(running)[0]
                return stage, sorted(running[stage])

        got = _wait_for(attempt, candidates)
        if got is None:
            return None
        stage, pids = got
        victim = rng.choice(pids)
    try:
        os.kill(victim, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return {"attempt": attempt.n, "kind": kind, "target": target or "anywhere", "trigger": plan["trigger"],
            "stage": stage, "pid": victim, "at_s": round(time.monotonic() - attempt.t0, 1),
            "latest_checkpoint": _latest(cc, stage) if stage in cc.training else None}


# ------------------------------------------------------------------------------ outputs

def _digests(cc: ChaosConfig) -> dict[str, str]:
    return {s: json.loads((cc.stage_dir(s) / "manifest.json").read_text())["digest"] for s in cc.stages}


@dataclass
class Run:
    run_id: str
    name: str
    status: str
    tags: dict[str, str]


def mlflow_facts(workspace: Path, model_name: str, dst: Path) -> dict:
    """What MLflow holds, read in a fresh process (this one would keep a cached connection to a
    SQLite file moved away): the sha256 of every file of the model version under alias
    `candidate` (its HF files, downloaded into `dst`), and every run (id, name, status, tags)."""
    script = "import json, sys; from tests.flows.test_chaos import _mlflow_facts; print(json.dumps(_mlflow_facts(*sys.argv[1:])))"
    out = subprocess.run([sys.executable, "-c", script, str(workspace), model_name, str(dst)],
                         capture_output=True, text=True, cwd=workspace,
                         env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    facts["runs"] = [Run(**r) for r in facts["runs"]]
    return facts


def _mlflow_facts(workspace: str, model_name: str, dst: str) -> dict:
    from mlflow import MlflowClient

    from posttrain.registry.mlflow_registry import fetch_registered

    uri = f"sqlite:///{Path(workspace) / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    Path(dst).mkdir(parents=True)
    # the HF files inside the registered MLflow model (its MLmodel names run and model ids, which differ)
    local, _ = fetch_registered(uri, f"models:/{model_name}@candidate", Path(dst))
    files = {str(f.relative_to(local)): hashlib.sha256(f.read_bytes()).hexdigest()
             for f in sorted(local.rglob("*")) if f.is_file()}
    exp = client.get_experiment_by_name("posttrain")
    runs = [{"run_id": r.info.run_id, "name": r.info.run_name, "status": r.info.status, "tags": r.data.tags}
            for r in client.search_runs([exp.experiment_id], max_results=10_000)]
    return {"registered": files, "runs": runs}


def prefect_flow_runs(prefect_home: Path) -> list[tuple[str, str]]:
    """(name, state type) of every flow run in the Prefect database of `prefect_home`."""
    import sqlite3

    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return db.execute("SELECT name, state_type FROM flow_run ORDER BY created").fetchall()


def _run_to_end(attempt: Attempt, timeout: float = 1500) -> None:
    attempt.start()
    try:
        rc = attempt.wait(timeout)
        assert rc == 0, f"attempt {attempt.n} failed ({rc}):\n{attempt.tail()}"
        assert attempt.leftovers(30) == []
    finally:
        attempt.reap()


# ------------------------------------------------------------------------------ the test

def test_pipeline_survives_kills_and_reproduces_an_uninterrupted_run(tmp_path):
    t_start = time.monotonic()
    env = _env(tmp_path / "prefect")  # one isolated PREFECT_HOME; each run starts its own ephemeral API
    # The uninterrupted reference runs first, in a workspace at the same path, then is moved aside:
    # the same command exactly. (Stage outputs record their inputs' absolute paths, e.g. the LoRA
    # adapter's base_model_name_or_path and the evaluation's model list, so digests of one
    # pipeline in two places differ although every weight is equal.)
    ws = tmp_path / "ws"
    ws.mkdir()
    cc = chaos_config(ws)
    _run_to_end(Attempt(0, _command(cc), ws, env, tmp_path / "reference.log"))
    ref_digests = _digests(cc)
    ref_files = mlflow_facts(ws, cc.model_name, tmp_path / "registered-reference")["registered"]
    assert any(f.endswith(".safetensors") for f in ref_files), ref_files
    os.rename(ws, tmp_path / "reference")
    ws.mkdir()
    t_ref = time.monotonic() - t_start

    rng = random.Random(SEED)
    plan = kill_schedule(rng, KILLS)
    kills: list[dict] = []
    attempts: list[dict] = []
    orphans: list[tuple[int, psutil.Process]] = []  # (attempt, Prefect server) of killed flows
    try:
        n = run_attempts(cc, env, tmp_path, plan, rng, kills, attempts, orphans)
        final = Attempt(n + 1, _command(cc), ws, env, tmp_path / f"attempt-{n + 1}.log")
        _run_to_end(final)
        attempts.append({"attempt": final.n, "killed": None, "rc": 0, "pid": final.proc.pid})
        still = {n: p.pid for n, p in orphans if _alive(p)}
    finally:
        for _, p in orphans:
            if _alive(p):
                p.kill()
    resumes = {s: cc.launch_log(s).read_text().count("resumed from step") for s in cc.training}
    report = {"seed": SEED, "plan": plan, "kills": kills, "attempts": attempts, "resumes": resumes,
              "orphaned_servers": {n: p.pid for n, p in orphans}, "orphaned_servers_left": still,
              "reference_s": round(t_ref, 1), "total_s": round(time.monotonic() - t_start, 1)}
    (tmp_path / "chaos-report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    assert len(kills) == KILLS and {k["kind"] for k in kills} == set(KINDS), report
    assert sum(resumes.values()) >= 1, report  # a kill after a checkpoint: some rerun resumed from it

    # The outputs are the uninterrupted run's, bit for bit.
    assert _digests(cc) == ref_digests
    facts = mlflow_facts(ws, cc.model_name, tmp_path / "registered")
    assert facts["registered"] == ref_files

    # MLflow: nothing left RUNNING; every interrupted attempt FAILED or KILLED; a stage FINISHED once.
    runs = facts["runs"]
    assert [(r.name, r.run_id) for r in runs if r.status == "RUNNING"] == []
    parents = {r.run_id: r for r in runs if r.tags.get("posttrain.pipeline") == cc.name}
    by_pid = {int(r.tags["posttrain.pid"]): r for r in parents.values()}
    final_parent = by_pid[attempts[-1]["pid"]]
    assert final_parent.status == "FINISHED"
    for a in attempts[:-1]:
        p = by_pid.get(a["pid"])  # none when the flow was killed before it opened its run
        assert p is None or p.status in ("FAILED", "KILLED"), (a, p.status)
    assert [r for r in parents.values() if r.status == "FINISHED"] == [final_parent]
    # The Prefect API server of a flow killed once its run had begun was stopped by a later run.
    assert [n for n in still if attempts[n - 1]["pid"] in by_pid] == [], report
    children = [r for r in runs if r.tags.get("mlflow.parentRunId") in parents]
    stage_ids = {c.run_id for c in children}
    per_model = [r for r in runs if r.tags.get("mlflow.parentRunId") in stage_ids and "posttrain.eval_model" in r.tags]
    # every run is the pipeline's, a stage's, or (under an evaluate stage's run) one per evaluated model
    assert len(children) + len(per_model) == len(runs) - len(parents)
    assert [r.name for r in per_model if r.status == "RUNNING"] == []
    named = {s: json.loads((cc.stage_dir(s) / "manifest.json").read_text()).get("mlflow_run_id") for s in cc.stages}
    for s in cc.stages:  # a stage finishes once (then it is cached), in the run its manifest names
        finished = [c.run_id for c in children if c.name == s and c.status == "FINISHED"]
        assert len(finished) <= 1, (s, finished)
        assert not finished or named[s] in (None, finished[0]), s
    pid_of = {a["attempt"]: a["pid"] for a in attempts}
    for k in kills:  # the run of the stage a kill landed in: FAILED or KILLED, unless that stage was done
        p = by_pid.get(pid_of[k["attempt"]])
        for c in children:
            if p is not None and c.tags["mlflow.parentRunId"] == p.run_id and c.name == k["stage"]:
                assert c.status in ("FAILED", "KILLED") or c.run_id == named[k["stage"]], (k, c.status)
    # Prefect: no flow run left Running (a killed flow's is set Crashed by the next run).
    states = prefect_flow_runs(tmp_path / "prefect")
    assert [name for name, state in states if state in ("RUNNING", "PENDING", "SCHEDULED")] == [], states
    assert sum(state == "CRASHED" for _, state in states) == sum(k["kind"] == "flow" for k in kills), states


def run_attempts(cc: ChaosConfig, env: dict, tmp_path: Path, plan: list[dict], rng: random.Random,
                 kills: list[dict], attempts: list[dict], orphans: list) -> int:
    """Run the command again and again, each attempt meeting the next planned kill, until all
    kills are done; returns the number of attempts."""
    n = 0
    while len(kills) < KILLS:
        n += 1
        assert n <= 3 * KILLS, f"only {len(kills)} of {KILLS} kills landed in {n - 1} attempts: {kills}"
        pending = [s for s in cc.stages if not (cc.stage_dir(s) / "manifest.json").exists()]
        assert pending, f"the pipeline finished before all {KILLS} kills landed: {kills}"
        attempt = Attempt(n, _command(cc), cc.workspace, env, tmp_path / f"attempt-{n}.log").start()
        try:
            done = execute_kill(attempt, plan[len(kills)], cc, pending, rng)
            if done is None:  # the attempt ended before its kill: then it must have completed the pipeline
                rc = attempt.wait(60)
                assert rc == 0, f"attempt {n} failed without a kill ({rc}):\n{attempt.tail()}"
                attempts.append({"attempt": n, "killed": None, "rc": rc, "pid": attempt.proc.pid})
                continue
            kills.append(done)
            if done["kind"] == "flow":
                attempt.wait(10)
                # the job the flow launched dies with it; its Prefect API server is left to the next run
                left = attempt.leftovers(90, allow=("server",))
                orphans += [(n, p) for p, role, _ in _roles(attempt.token) if role == "server"]
                rc = -signal.SIGKILL
            else:
                rc = attempt.wait(600)
                assert rc != 0, f"attempt {n} succeeded although its {done['kind']} was killed:\n{attempt.tail()}"
                left = attempt.leftovers(30)
            done["rc"] = rc
            assert left == [], f"attempt {n}: processes outlived the {done['kind']} kill: {left}\n{attempt.tail()}"
            attempts.append({"attempt": n, "killed": done, "rc": rc, "pid": attempt.proc.pid})
        finally:
            attempt.reap(but=("server",) if kills and kills[-1]["attempt"] == n and kills[-1]["kind"] == "flow" else ())
    return n
