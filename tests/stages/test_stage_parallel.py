"""The training stages under posttrain.core.parallel layouts reproduce the single-process run.

Each stage runs under torchrun on 2 or 4 CPU processes (gloo) and in this process on one; every
step's loss, token count and gradient norm, the validation metrics and the exported HF weights
must match. The batches are the same by construction: the sampler deals *global* micro-batches
round-robin to the data-parallel ranks, so 2 FSDP ranks x 1 micro-batch see, at each step, the
global batches one process sees with grad_accum_steps=2; tp and cp ranks share their data shard
(cp ranks cut each packed row by sequence) and accumulate as many micro-batches as one process.
The step's token count is the check that the batches are the same.

The layouts share launches: one torchrun of 2 ranks and one of 4 run, one stage after another in
the same ranks and process group, every layout of LAYOUTS that the session's tests ask for
(`launched`), since a launch's start-up is most of a 4-step stage's run; the killed-and-resumed
runs launch on their own.

The matrix covers each stage and each dimension once, and the named combinations once each:
SFT under FSDP, TP+SP, CP x TP, EP x FSDP / EP x TP (an MoE model), EP x TP with LoRA on the
experts, PP, PP x FSDP and PP x TP (LoRA), and a killed and resumed run under FSDP, TP and PP
bitwise equal to the uninterrupted one; QLoRA under FSDP (resumed too) and under TP; DPO under
CP x FSDP, EP x FSDP, PP (reference: the LoRA base, or a frozen copy in the same stages) and
PP x FSDP (precomputed), PP x CP (the LoRA base between accumulated micro-batches), on-policy
under CP, TP and PP x CP; online distillation with the teacher laid out as the student under CP
and TP, with a layout of its own (sharded while the student replicates), of an MoE student under
EP x FSDP, and under PP x TP and PP x CP (the teacher split into the same stages); GKD
(on-policy) under CP, TP and PP x CP; offline distillation under FSDP (the teacher's cache
scored by both ranks), TP (top-k of the vocab-split logits), CP and PP x CP.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.core.config import to_json_file
from posttrain.core.tracking import TrackingConfig
from posttrain.stages.config import DataPrepConfig, DistillConfig, DPOConfig, EvalConfig, SFTConfig

RTOL = 1e-4  # fp32 on CPU: the layouts differ from one process by summation order (~1e-7 measured)
ATOL = 1e-6
ATOL_WEIGHTS = 1e-4  # after 4 AdamW steps at lr 1e-3 (~2e-6 measured)
STEPS = 4
OFF = TrackingConfig(enabled=False, log_every=1)

# The torchrun entry point: a stage's main, with each metrics dict the stage logs appended to a
# file (rank 0) instead of MLflow.
RECORDER = """
import contextlib, importlib, json, os, sys
import posttrain.stages.recipe as recipe

class Run:
    run_id = None
    def log_metrics(self, metrics, step=None):
        if os.environ["RANK"] == "0":
            with open(os.environ["POSTTRAIN_TEST_METRICS"], "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\\n")
    def __getattr__(self, name):
        return lambda *args, **kwargs: None

recipe.stage_run = lambda *args, **kwargs: contextlib.nullcontext(Run())

kill_at = int(os.environ.get("POSTTRAIN_TEST_KILL_AFTER_SAVE", "0"))
if kill_at:  # every rank dies the moment the checkpoint of step `kill_at` is complete
    from posttrain.core.checkpoint import CheckpointManager
    save = CheckpointManager.save
    def save_then_die(self, step, *args, **kwargs):
        written = save(self, step, *args, **kwargs)
        if step == kill_at:
            self.wait()
            import torch.distributed as dist
            dist.barrier()
            os._exit(17)
        return written
    CheckpointManager.save = save_then_die
if __name__ == "__main__" and sys.argv[1] == "--batch":  # (a spawned generator worker imports this file again)
    # several stages one after the other in these ranks, in one process group (the stages' own
    # close_distributed would drop it between them); rank 0 marks each one done
    # Each rank's output of a stage goes to <done>.rank<R>.log (what a launch of its own would log).
    import torch.distributed as dist
    recipe.close_distributed = lambda: None
    for module, spec, metrics, done in json.loads(open(sys.argv[2]).read()):
        os.environ["POSTTRAIN_TEST_METRICS"] = metrics
        stage = importlib.import_module(module)
        if hasattr(stage, "close_distributed"):  # a stage that closes the group itself (evaluate)
            stage.close_distributed = lambda: None
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(f"{done}.rank{os.environ['RANK']}.log", "w") as log:
            os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
            try:
                stage.main(["--config", spec])
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        if os.environ["RANK"] == "0":
            open(done, "w").close()
    if dist.is_initialized():
        dist.destroy_process_group()
elif __name__ == "__main__":
    importlib.import_module(sys.argv[1]).main(sys.argv[2:])
"""

MODULES = {SFTConfig: "posttrain.stages.sft", DPOConfig: "posttrain.stages.dpo", DistillConfig: "posttrain.stages.distill",
           EvalConfig: "posttrain.stages.evaluate"}


def sft_config(root: Path, name: str, data: dict | None = None, **kw) -> SFTConfig:
    data = {"sources": [str(root / "data")], "batch_tokens": 256, "max_seq_len": 128, **(data or {})}
    return SFTConfig(output_dir=str(root / name), tracking=OFF, data=data,
                     max_steps=STEPS, eval_interval=0, checkpoint={"interval_steps": 0}, **kw)


def dpo_config(root: Path, name: str, **kw) -> DPOConfig:
    return DPOConfig(output_dir=str(root / name), tracking=OFF,
                     data={"sources": [str(root / "data")], "micro_batch_size": 4, "max_seq_len": 128},
                     max_steps=STEPS, eval_interval=0, checkpoint={"interval_steps": 0}, **kw)


def distill_config(root: Path, name: str, data: dict | None = None, **kw) -> DistillConfig:
    kw.setdefault("mode", "online")
    data = {"sources": [str(root / "data")], "batch_tokens": 256, "max_seq_len": 128, **(data or {})}
    return DistillConfig(output_dir=str(root / name), tracking=OFF,
                         teacher={"name_or_path": "debug", "overrides": {"hidden_size": 96, "intermediate_size": 256}},
                         data=data, max_steps=STEPS, eval_interval=0, checkpoint={"interval_steps": 0}, **kw)


def optim(grad_accum: int, lr: float = 1e-3) -> dict:
    return {"lr": lr, "warmup_steps": 1, "grad_accum_steps": grad_accum}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from posttrain.stages.data_prep import prepare

    root = tmp_path_factory.mktemp("stage_parallel")
    prepare(DataPrepConfig(output_dir=str(root / "data"), synthetic_size=120, tracking=TrackingConfig(enabled=False)))
    return root


# Pipeline parallelism runs fixed shapes: micro-batches of 2 packed rows (of max_seq_len tokens).
PP_DATA = {"batch_tokens": None, "micro_batch_size": 2}
PP_LORA = {"enabled": True, "rank": 8}
MOE = {"name_or_path": "debug-moe"}
ON_POLICY = dict(pairs="on_policy", reference="precomputed", num_samples=2, max_new_tokens=6)
GKD = dict(mode="on_policy", on_policy_ratio=0.5, max_new_tokens=6)
QLORA = {"enabled": True, "quantize_base": "nf4", "rank": 8}


def _sft(parallel: dict, grad_accum: int, lr: float = 1e-3, **kw):
    return lambda root, name: sft_config(root, name, parallel=parallel, optim=optim(grad_accum, lr), **kw)


def _dpo(parallel: dict, grad_accum: int, **kw):
    return lambda root, name: dpo_config(root, name, parallel=parallel, optim=optim(grad_accum, lr=5e-3), **kw)


def _distill(parallel: dict, grad_accum: int, teacher: dict | None = None, **kw):
    def make(root: Path, name: str) -> DistillConfig:
        cfg = distill_config(root, name, parallel=parallel, optim=optim(grad_accum), **kw)
        if teacher is None:
            return cfg
        cfg.teacher.parallel = teacher  # a layout of the teacher's own
        return DistillConfig.model_validate(cfg.model_dump())
    return make


# Every layout the tests below run under torchrun: name -> (ranks, its config from (root, name)).
LAYOUTS: dict[str, tuple[int, Callable[[Path, str], object]]] = {
    # SFT
    "fsdp": (2, _sft({"dp_shard": 2}, 1)),                                # 2 data shards x 1 micro-batch
    "tp_sp": (2, _sft({"tp": 2, "sequence_parallel": True}, 2)),          # 1 data shard x 2 micro-batches
    "cp_tp": (4, _sft({"cp": 2, "tp": 2}, 2)),                            # ring attention on tp-split heads
    "pp": (2, _sft({"pp": 2}, 2, data=PP_DATA)),                          # a block per rank, tied ends
    "pp_fsdp": (4, _sft({"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe"}, 1, data=PP_DATA)),  # each stage over 2
    "pp_tp": (4, _sft({"pp": 2, "tp": 2, "sequence_parallel": True}, 2, data=PP_DATA, lora=PP_LORA)),  # LoRA, tp
    "pp_cp": (4, _sft({"pp": 2, "cp": 2}, 2, data=PP_DATA, lora=PP_LORA)),  # each row's chunks over a ring
    "ep_fsdp": (2, _sft({"dp_shard": 2, "ep": 2}, 1, model=MOE)),         # 2 experts per rank, non-experts sharded
    "ep_tp": (4, _sft({"dp_shard": 2, "tp": 2, "ep": 2}, 1, model=MOE)),  # experts over the dp ranks, tokens over tp
    "ep_tp_lora": (4, _sft({"dp_shard": 2, "tp": 2, "ep": 2}, 1, model=MOE,
                           lora={"enabled": True, "rank": 8, "experts": True})),
    "moe-pp": (2, _sft({"pp": 2}, 2, model=MOE, data=PP_DATA)),
    "moe-pp-ep": (4, _sft({"pp": 2, "dp_shard": 2, "ep": 2}, 1, model=MOE, data=PP_DATA)),  # experts over 2 dp
    "qlora-fsdp": (2, _sft({"dp_shard": 2}, 1, lr=5e-3, lora=QLORA)),
    "qlora-tp": (2, _sft({"tp": 2, "sequence_parallel": True}, 2, lr=5e-3, lora=QLORA)),
    "qlora-pp": (4, _sft({"pp": 2, "tp": 2}, 2, lr=5e-3, lora=QLORA, data=PP_DATA)),
    # DPO. Chosen and rejected of each pair cut over 2 cp ranks, still meeting in one loss; the
    # reference the LoRA base under disable_adapter, on the same shards
    "dpo-cp-fsdp": (4, _dpo({"cp": 2, "dp_shard": 2}, 1)),
    # pairs side by side in the pipeline's rows, the loss on the last stage; the reference a
    # forward-only pass of the schedule with the adapters off
    "dpo-pp": (2, _dpo({"pp": 2}, 2)),
    # ... or computed once before training (the starting policy is the base), each stage sharded
    "dpo-pp-fsdp": (4, _dpo({"pp": 2, "dp_shard": 2}, 1, reference="precomputed")),
    # ... or a frozen copy of the starting model split into the same stages, run forward-only first
    "dpo-pp-model": (2, _dpo({"pp": 2}, 2, reference="model")),
    # each row's chunks on a ring in both stages, a pair's log-probs summed over it on the last;
    # the LoRA base's forward-only pass between accumulated micro-batches (FSDP over the cp ranks)
    "dpo-pp-cp": (4, _dpo({"pp": 2, "cp": 2}, 2)),
    # on-policy: samples as an ordinary model (ring attention off, FSDP units gathered), each rank
    # its seeded share of the prompts; trains on them cut over the cp ranks
    "dpo-op-cp": (2, _dpo({"cp": 2}, 2, **ON_POLICY)),
    # decodes with its KV heads split over tp (no sequence split), both tp ranks on the same rows
    "dpo-op-tp": (2, _dpo({"tp": 2}, 2, **ON_POLICY)),
    # decodes stage by stage (posttrain.core.parallel.pipeline_decode), each cp rank its own prompts as an
    # ordinary model (its stages' FSDP units gathered), then trains on the pairs pipelined and on a ring
    "dpo-op-pp-cp": (4, _dpo({"pp": 2, "cp": 2}, 2, **ON_POLICY)),
    "dpo-ep": (2, _dpo({"dp_shard": 2, "ep": 2}, 1, model=MOE)),
    # online distillation: the teacher sharded with the student's layout, ring attention on the same chunks
    "kd-cp": (2, _distill({"cp": 2}, 2)),
    # a teacher of its own layout: sharded over both ranks (FSDP, inference) while the student replicates
    "kd-ddp-teacher-fsdp": (2, _distill({"dp_replicate": 2}, 1, teacher={"dp_shard": 2})),
    # teacher and student split alike over tp: their logits meet on each rank's vocab slice
    "kd-tp": (2, _distill({"tp": 2}, 2)),
    "kd-pp-tp": (4, _distill({"pp": 2, "tp": 2, "sequence_parallel": True}, 2, data=PP_DATA)),
    "kd-pp-cp": (4, _distill({"pp": 2, "cp": 2}, 2, data=PP_DATA)),  # both stages on the ring, the chunks met there
    "distill-ep": (2, _distill({"dp_shard": 2, "ep": 2}, 1, model=MOE)),
    # GKD: the student samples as an ordinary model, then trains on its samples cut over cp
    "gkd-cp": (2, _distill({"cp": 2}, 2, **GKD)),
    "gkd-tp": (2, _distill({"tp": 2}, 2, **GKD)),  # the tp group decodes in lockstep on the same prompts
    # decodes stage by stage; the samples keep their prompts' rows (the pipeline's fixed shapes),
    # the teacher split into the same stages; both on a ring for training
    "gkd-pp-cp": (4, _distill({"pp": 2, "cp": 2}, 2, data=dict(PP_DATA, packing=False), **GKD)),
    # offline distillation
    "kd-off-fsdp": (2, _distill({"dp_shard": 2}, 1, mode="offline", top_k=8)),
    "kd-off-tp": (2, _distill({"tp": 2, "sequence_parallel": True}, 2, mode="offline", top_k=8)),
    "kd-off-cp": (2, _distill({"cp": 2}, 2, mode="offline", top_k=8)),
    "kd-off-pp-cp": (4, _distill({"pp": 2, "cp": 2}, 2, mode="offline", top_k=8, data=PP_DATA)),
}


def layout_config(root: Path, layout: str):
    return LAYOUTS[layout][1](root, layout)


@pytest.fixture(scope="module")
def launched(root, request) -> dict[str, list[dict]]:
    """The layouts this session's tests of this module ask for, under torchrun: one launch per
    world size, its stages one after the other in the same ranks and process group (a launch's
    start-up, torchrun and every rank importing torch and the stages, is most of a small stage's
    run: ~7 s of 2 ranks, ~10 s of 4, on 2 cores). {layout: rank 0's metrics records}; a layout
    whose launch failed raises, with the launch's output, when a test asks for it."""
    wanted = asked_for(request, LAYOUTS)
    out = {}
    for nproc in sorted({LAYOUTS[n][0] for n in wanted}):
        out.update(torchrun_batch({n: layout_config(root, n) for n in wanted if LAYOUTS[n][0] == nproc}, nproc,
                                  root / f".work-batch-{nproc}"))
    return Launched(out)


def asked_for(request, names) -> list[str]:
    """Those of `names` that a collected test of the requesting module has as its `layout`
    parameter (all of them when the whole module runs; fewer under -k)."""
    asked = {item.callspec.params.get("layout") for item in request.session.items
             if item.module is request.module and getattr(item, "callspec", None)}
    return [n for n in names if n in asked]


class Launched(dict):
    """{layout: records, or why its launch did not finish them (raised when asked for)}."""

    def __missing__(self, layout: str):
        raise AssertionError(f"layout {layout!r} was not launched (not asked for by a collected test)")

    def __getitem__(self, layout: str) -> list[dict]:
        got = super().__getitem__(layout)
        if isinstance(got, str):
            raise AssertionError(got)
        return got


def torchrun_batch(configs: dict[str, object], nproc: int, work: Path) -> dict[str, list[dict] | str]:
    """Run the stages of `configs` ({name: stage config}) one after the other in one torchrun
    launch of `nproc` ranks (one process group); {name: rank 0's metrics records}, or the
    launch's output tail and the stage's own for those it did not finish. Each stage's output,
    all ranks', is in stage_log(work, name)."""
    layouts = list(configs)
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for name, cfg in configs.items():
        spec, metrics, done = work / f"{name}.json", work / f"{name}.metrics.jsonl", work / f"{name}.done"
        to_json_file(cfg, spec)
        metrics.unlink(missing_ok=True)
        done.unlink(missing_ok=True)
        runs.append((MODULES[type(cfg)], str(spec), str(metrics), str(done)))
    (work / "batch.json").write_text(json.dumps(runs))
    (work / "record_stage.py").write_text(RECORDER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POSTTRAIN_TEST_KILL_AFTER_SAVE": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(work / "record_stage.py"), "--batch", str(work / "batch.json")]
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=1500)
    out: dict[str, list[dict] | str] = {}
    for name, (_, _, metrics, done) in zip(layouts, runs):
        if Path(done).exists():
            lines = Path(metrics).read_text().splitlines() if Path(metrics).exists() else []  # none logged
            out[name] = plain([json.loads(line) for line in lines])
        else:
            out[name] = (f"the {nproc}-rank launch of {layouts} (exit {proc.returncode}) did not finish {name!r}:\n"
                         + (proc.stdout + proc.stderr)[-3000:] + f"\n--- {name}'s output:\n" + stage_log(work, name)[-4000:])
    return out


def stage_log(work: Path, name: str) -> str:
    """What stage `name` of a torchrun_batch in `work` printed, rank by rank."""
    return "".join(f.read_text(errors="replace") for f in sorted(work.glob(f"{name}.done.rank*.log")))


def in_process(cfg) -> list[dict]:
    """Run the stage in this process (world 1); the metrics it logged."""
    from posttrain.stages import recipe

    records: list[dict] = []

    class Run:
        run_id = None

        def log_metrics(self, metrics, step=None):
            records.append({"step": step, **metrics})

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    module = __import__(MODULES[type(cfg)], fromlist=["run"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recipe, "stage_run", lambda *args, **kwargs: contextlib.nullcontext(Run()))
        module.run(cfg)
    return plain(records)


@pytest.fixture(scope="module")
def reference(root):
    """SFT in this process with 2 micro-batches per step: (dir, metrics)."""
    return root, in_process(sft_config(root, "ref", optim=optim(2)))


def torchrun_stage(cfg, work: Path, nproc: int = 2, kill_after_save: int = 0) -> list[dict]:
    """Run the stage on `nproc` processes; the metrics rank 0 logged. kill_after_save=N: every
    rank exits (17) once step N's checkpoint is complete, as a job killed then would."""
    work.mkdir(parents=True, exist_ok=True)
    spec, script, metrics = work / "spec.json", work / "record_stage.py", work / "metrics.jsonl"
    to_json_file(cfg, spec)
    script.write_text(RECORDER)
    metrics.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POSTTRAIN_TEST_METRICS": str(metrics),
           "POSTTRAIN_TEST_KILL_AFTER_SAVE": str(kill_after_save)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
           MODULES[type(cfg)], "--config", str(spec)]
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=600)
    if kill_after_save:
        assert proc.returncode != 0 and not (Path(cfg.output_dir) / "manifest.json").exists(), proc.stderr[-3000:]
        return []
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return plain([json.loads(line) for line in metrics.read_text().splitlines()])


def plain(records: list[dict]) -> list[dict]:
    """The logged records under the trainer's own names (posttrain.stages.recipe.run_metric_names undone):
    train/<objective>_loss -> loss, train/<k> -> k, step 0's val/<k> -> val/<k>_initial."""
    from posttrain.stages.recipe import OBJECTIVE_LOSS

    out = []
    for r in records:
        m = {}
        for k, v in r.items():
            if k in OBJECTIVE_LOSS.values():
                k = "loss"
            elif k.startswith("train/") and k != "train/seconds":
                k = k[len("train/"):]
            elif k.startswith("val/") and r.get("step") == 0:
                k = f"{k}_initial"
            m[k] = v
        out.append(m)
    return out


def steps_of(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if "grad_norm" in r}


def close(a: float, b: float) -> bool:
    """Within RTOL, or ATOL of values near 0 (a DPO margin of 4e-5 from log-probs of ~-300)."""
    return abs(a - b) <= RTOL * abs(b) + ATOL


def assert_same_run(records: list[dict], ref_records: list[dict], out: Path, ref_out: Path,
                    val_keys: tuple[str, ...]) -> None:
    """Per step: the same tokens, loss and gradient norm; the same validation; the same weights."""
    from posttrain.registry.hf import load_pretrained

    ref, par = steps_of(ref_records), steps_of(records)
    assert sorted(par) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert par[step]["tokens"] == ref[step]["tokens"], f"step {step}: other batches than one process"
        for key in ("loss", "grad_norm"):
            assert close(par[step][key], ref[step][key]), (step, key, par[step][key], ref[step][key])
    final = {k: v for r in records for k, v in r.items()}
    ref_final = {k: v for r in ref_records for k, v in r.items()}
    for key in val_keys:
        assert close(final[key], ref_final[key]), (key, final[key], ref_final[key])

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["metrics"]["steps"] == STEPS
    got = load_pretrained(out / manifest["outputs"]["model"]).state_dict()
    want = load_pretrained(ref_out / "model").state_dict()
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= ATOL_WEIGHTS, f"exported weights differ by {worst}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp_sp", "cp_tp"])
def test_sft_under_torchrun_matches_one_process(reference, launched, layout):
    root, ref_records = reference
    assert_same_run(launched[layout], ref_records, root / layout, root / "ref", ("val/loss_initial", "val/loss"))
    if layout in ("fsdp", "tp_sp"):
        assert_resume_is_bit_exact(layout_config(root, layout), root / layout, LAYOUTS[layout][0])


def assert_resume_is_bit_exact(cfg: SFTConfig, uninterrupted: Path, nproc: int) -> None:
    """The same run killed right after its step-2 checkpoint, then started again: it resumes from
    that checkpoint (sharded as the layout shards it) and exports bitwise the same weights."""
    from posttrain.registry.hf import load_pretrained

    out = uninterrupted.with_name(uninterrupted.name + "-resumed")
    cfg = cfg.model_copy(update={"output_dir": str(out), "checkpoint": cfg.checkpoint.model_copy(
        update={"interval_steps": 2})})
    torchrun_stage(cfg, out.with_name(f".work-{out.name}"), nproc, kill_after_save=2)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000002"
    records = torchrun_stage(cfg, out.with_name(f".work-{out.name}"), nproc)
    assert min(steps_of(records)) == 3  # steps 1-2 came from the checkpoint
    got = load_pretrained(out / "model").state_dict()
    want = load_pretrained(uninterrupted / "model").state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "resumed weights differ from the uninterrupted run's"


@pytest.fixture(scope="module")
def pp_references(root):
    """SFT in this process on PP_DATA (2 micro-batches per step), full and LoRA: {lora: records}."""
    return {lora: in_process(sft_config(root, f"pp-ref{'-lora' if lora else ''}", data=PP_DATA, optim=optim(2),
                                        **({"lora": PP_LORA} if lora else {})))
            for lora in (False, True)}


@pytest.mark.slow
@pytest.mark.parametrize("layout,lora", [("pp", False), ("pp_fsdp", False), ("pp_tp", True), ("pp_cp", True)])
def test_sft_under_pipeline_parallelism_matches_one_process(root, pp_references, launched, layout, lora):
    """The schedule runs each micro-batch's rows as microbatches (1F1B or GPipe), the loss on the
    last stage a token sum; the debug model ties its embeddings, so the first and last stages
    each hold a copy whose gradients are summed before the step. Then the run under pp is killed
    after its step-2 checkpoint and resumed, bitwise."""
    ref = f"pp-ref{'-lora' if lora else ''}"
    assert_same_run(launched[layout], pp_references[lora], root / layout, root / ref, ("val/loss_initial", "val/loss"))
    if layout == "pp":
        assert_resume_is_bit_exact(layout_config(root, layout), root / layout, LAYOUTS[layout][0])


@pytest.fixture(scope="module")
def moe_reference(root):
    return in_process(sft_config(root, "moe-ref", model=MOE, optim=optim(2)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep_fsdp", "ep_tp"])
def test_moe_sft_under_expert_parallelism_matches_one_process(root, moe_reference, launched, layout):
    records = launched[layout]
    assert_same_run(records, moe_reference, root / layout, root / "moe-ref", ("val/loss_initial", "val/loss"))
    if layout == "ep_tp":  # the logged balancing loss is the whole sequences', not a tp rank's share (1/2)
        for step in range(1, STEPS + 1):  # (rank 0 logs its own micro-batch's; one process the mean of two)
            ref, par = steps_of(moe_reference)[step], steps_of(records)[step]
            assert par["moe/aux_loss"] == pytest.approx(ref["moe/aux_loss"], rel=0.1), (step, par, ref)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep_tp_lora"])
def test_lora_on_experts_under_expert_and_tensor_parallelism_matches_one_process(root, launched, layout):
    """lora.experts: each expert's update sharded with its expert over ep, replicated over tp (its
    gradient reduced over tp in the graph); the merged export and the PEFT adapter (the experts'
    target_parameters) come from the gathered adapters."""
    from safetensors import safe_open

    kw = dict(model=MOE, lora={"enabled": True, "rank": 8, "experts": True})
    ref = in_process(sft_config(root, "moe-lora-ref", optim=optim(2), **kw))
    assert_same_run(launched[layout], ref, root / "ep_tp_lora", root / "moe-lora-ref", ("val/loss_initial", "val/loss"))
    with safe_open(str(root / "ep_tp_lora" / "adapter" / "adapter_model.safetensors"), "pt") as f:
        experts = [k for k in f.keys() if ".mlp.experts." in k]
        assert len(experts) == 4 * 2 and f.get_tensor(experts[0]).abs().sum() > 0  # 4 tensors x 2 MoE layers


@pytest.fixture(scope="module")
def moe_pp_reference(root):
    """The MoE model on PP_DATA's rows, one row a micro-batch (a pipeline microbatch below)."""
    return in_process(sft_config(root, "moe-pp-ref", model=MOE, data=dict(PP_DATA, micro_batch_size=1),
                                 optim=optim(4)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["moe-pp", "moe-pp-ep"])
def test_moe_sft_under_pipeline_parallelism_matches_one_process(root, moe_pp_reference, launched, layout):
    """An MoE model's blocks split over 2 stages: each block's balancing loss attached where the
    block lives, weighted by its microbatch's target tokens and taken over its real tokens only
    (the pipeline's padding rows and columns do not count); with ep, each stage's experts spread
    over its data-parallel ranks. The one-process reference runs the same rows as micro-batches
    of one row (a pipeline microbatch here): the balancing loss is not linear in the tokens it is
    taken over."""
    records, nproc = launched[layout], LAYOUTS[layout][0]
    assert_same_run(records, moe_pp_reference, root / layout, root / "moe-pp-ref", ("val/loss_initial", "val/loss"))
    for step in range(1, STEPS + 1):  # under ep rank 0 logs its own rows' value, one process every row's
        par, want = steps_of(records)[step]["moe/aux_loss"], steps_of(moe_pp_reference)[step]["moe/aux_loss"]
        assert close(par, want) if nproc == 2 else par == pytest.approx(want, rel=0.1), (step, par, want)


@pytest.fixture(scope="module")
def dpo_reference(root):
    return in_process(dpo_config(root, "dpo-ref", optim=optim(2, lr=5e-3)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dpo-cp-fsdp", "dpo-pp", "dpo-pp-fsdp", "dpo-pp-model", "dpo-pp-cp"])
def test_dpo_under_parallel_layouts_matches_one_process(root, dpo_reference, launched, layout):
    assert_same_run(launched[layout], dpo_reference, root / layout, root / "dpo-ref",
                    ("val/accuracy", "val/margin", "val/chosen", "val/rejected"))


@pytest.fixture(scope="module")
def on_policy_reference(root):
    return in_process(dpo_config(root, "dpo-op-ref", optim=optim(2, lr=5e-3), **ON_POLICY))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dpo-op-cp", "dpo-op-tp", "dpo-op-pp-cp"])
def test_on_policy_dpo_under_parallel_layouts_matches_one_process(root, on_policy_reference, launched, layout):
    assert_same_run(launched[layout], on_policy_reference, root / layout, root / "dpo-op-ref",
                    ("val/accuracy", "val/margin", "val/chosen", "val/rejected"))
    same = [(root / d / "on_policy" / "train.jsonl").read_text() for d in ("dpo-op-ref", layout)]
    assert same[0] == same[1]  # the same samples, rewards and pairs


@pytest.fixture(scope="module")
def kd_reference(root):
    return in_process(distill_config(root, "kd-ref", optim=optim(2)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["kd-cp", "kd-ddp-teacher-fsdp", "kd-tp"])
def test_online_distillation_under_parallel_layouts_matches_one_process(root, kd_reference, launched, layout):
    assert_same_run(launched[layout], kd_reference, root / layout, root / "kd-ref", ("val/kl_initial", "val/kl"))


@pytest.fixture(scope="module")
def gkd_reference(root):
    return in_process(distill_config(root, "gkd-ref", optim=optim(2), **GKD))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["gkd-cp", "gkd-tp", "gkd-pp-cp"])
def test_on_policy_distillation_under_parallel_layouts_matches_one_process(root, gkd_reference, launched, layout):
    """GKD (mode on_policy): half the batches are the student's own completions, scored by the
    teacher laid out as the student; the same samples and steps as one process."""
    ref, ref_dir = gkd_reference, "gkd-ref"
    if "pp" in layout:  # fixed shapes: micro-batches of rows, one document each (a sample, longer than
        # the document it replaces, still fits its row), and its own one-process reference
        ref_dir = "gkd-pp-ref"
        ref = in_process(distill_config(root, ref_dir, optim=optim(2), data=dict(PP_DATA, packing=False), **GKD))
    assert_same_run(launched[layout], ref, root / layout, root / ref_dir, ("val/kl_initial", "val/kl"))
    metrics = [json.loads((root / d / "manifest.json").read_text())["metrics"] for d in (ref_dir, layout)]
    assert metrics[0]["on_policy/samples"] == metrics[1]["on_policy/samples"] > 0
    assert metrics[1]["on_policy/truncated"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dpo-ep", "distill-ep"])
def test_moe_dpo_and_distillation_under_expert_parallelism_match_one_process(root, launched, layout):
    """EP x FSDP in the other training stages: DPO (the reference the LoRA base, experts sharded)
    and online distillation of an MoE student by a dense teacher."""
    stage = layout.removesuffix("-ep")
    make, val = (dpo_config, ("val/accuracy", "val/margin")) if stage == "dpo" else (distill_config, ("val/kl",))
    lr = 5e-3 if stage == "dpo" else 1e-3
    ref = in_process(make(root, f"{stage}-moe-ref", model=MOE, optim=optim(2, lr=lr)))
    assert_same_run(launched[layout], ref, root / layout, root / f"{stage}-moe-ref", val)


@pytest.fixture(scope="module")
def kd_pp_reference(root):
    return in_process(distill_config(root, "kd-pp-ref", data=PP_DATA, optim=optim(2)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["kd-pp-tp", "kd-pp-cp"])
def test_online_distillation_under_pipeline_and_tensor_or_context_parallelism_matches_one_process(
        root, kd_pp_reference, launched, layout):
    """The teacher split into the student's stages (and tp or cp): it runs each micro-batch
    forward-only first, its last stage keeping each microbatch's logits, which the student's last
    stage meets in the divergence (vocab-parallel under tp, on this rank's chunks under cp)."""
    records = launched[layout]
    assert_same_run(records, kd_pp_reference, root / layout, root / "kd-pp-ref", ("val/kl_initial", "val/kl"))
    assert steps_of(records)[STEPS]["time/teacher_frac"] > 0  # the teacher's pass is timed


@pytest.fixture(scope="module")
def kd_offline_reference(root):
    return in_process(distill_config(root, "kd-off-ref", mode="offline", top_k=8, optim=optim(2)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["kd-off-fsdp", "kd-off-tp", "kd-off-cp", "kd-off-pp-cp"])
def test_offline_distillation_under_fsdp_tp_cp_and_pp_matches_one_process(root, kd_offline_reference, launched,
                                                                          layout):
    """Under FSDP the sharded teacher scores the documents chunk by chunk, the chunks dealt to the
    2 ranks, each writing its own files; under TP the tp group scores every chunk together (top-k
    of the vocab-split logits), its first rank writing; under PP the teacher split into the
    student's stages scores each chunk stage by stage, and the top-k rows are laid out as the
    pipeline's rows for the student's last stage. Under CP each cp rank scores its own chunks
    with the teacher attending as an ordinary model (under PP x CP its stages' FSDP units
    gathered), and the held-out KL runs it on the ring. Training reads the same rows as one
    process, the student's loss vocab-parallel under TP."""
    ref, ref_dir = kd_offline_reference, root / "kd-off-ref"
    if "pp" in layout:  # fixed shapes: micro-batches of rows (its own one-process reference)
        ref_dir = root / "kd-off-pp-ref"
        ref = in_process(distill_config(root, ref_dir.name, mode="offline", top_k=8, optim=optim(2), data=PP_DATA))
    assert_same_run(launched[layout], ref, root / layout, ref_dir, ("val/kl_initial", "val/kl"))
    (one,) = (ref_dir / "teacher_cache").glob("top8-*")
    (two,) = (root / layout / "teacher_cache").glob("top8-*")
    assert one.name == two.name  # the same key: teacher, k and documents
    for a in sorted(one.glob("chunk-*")):
        x, y = load_file(str(a)), load_file(str(two / a.name))
        # the same k ids per position (their order may differ between near-equal log-probs under TP,
        # whose log-softmax sums the vocab in another order; ~1 row in 2000 here) and log-probs
        assert torch.equal(x["ids"].sort(1).values, y["ids"].sort(1).values)
        assert torch.allclose(x["logps"], y["logps"], atol=1e-5)


@pytest.fixture(scope="module")
def qlora_reference(root):
    return in_process(sft_config(root, "qlora-ref", lora=QLORA, optim=optim(2, lr=5e-3)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["qlora-fsdp", "qlora-tp"])
def test_qlora_sft_under_fsdp_and_tp_matches_one_process(root, qlora_reference, launched, layout):
    """QLoRA under FSDP (FSDP-QLoRA): the adapters, the dense frozen weights (embedding, norms,
    head) and their optimizer state sharded, and the NF4 base's storage too (each rank keeps its
    piece, posttrain.core.quant.shard_nf4_storage; forward and backward gather it); killed and resumed, it
    ends bitwise where the uninterrupted run did (the checkpoint holds no NF4 base: it is loaded
    again). Under TP each rank computes on its slice of every NF4 weight (posttrain.core.quant.nf4_shard:
    the same codes and scales, cut where the split cuts the blocks), the adapters split as for a
    dense base."""
    assert_same_run(launched[layout], qlora_reference, root / layout, root / "qlora-ref",
                    ("val/loss_initial", "val/loss"))
    if layout == "qlora-fsdp":
        assert_resume_is_bit_exact(layout_config(root, layout), root / layout, LAYOUTS[layout][0])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["qlora-pp"])
def test_qlora_sft_under_pipeline_parallelism_matches_one_process(root, launched, layout):
    """QLoRA with its NF4 base split into 2 pipeline stages x 2 tp ranks: each rank quantizes and
    keeps only its stages' layers (its tp slices of them), the adapters train where their layer
    lives; the merged export gathers every stage's share."""
    kw = dict(lora=QLORA, data=PP_DATA)
    ref = in_process(sft_config(root, "qlora-pp-ref", optim=optim(2, lr=5e-3), **kw))
    assert_same_run(launched[layout], ref, root / "qlora-pp", root / "qlora-pp-ref", ("val/loss_initial", "val/loss"))


def test_unsupported_layouts_are_refused_when_the_config_loads():
    from posttrain.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^data\.batch_tokens: pipeline parallelism \(pp=2\) runs fixed"):
        load_config(SFTConfig, overrides=["parallel.pp=2", "data.batch_tokens=512"])
    with pytest.raises(ConfigError, match=r"^data\.micro_batch_size: 6 rows do not split into 4 pipeline"):
        load_config(SFTConfig, overrides=["parallel.pp=2", "parallel.pp_microbatches=4", "data.micro_batch_size=6"])
    assert load_config(DPOConfig, overrides=["parallel.pp=2", "parallel.cp=2"]).reference == "disable_adapter"
    with pytest.raises(ConfigError, match=r"^data\.max_seq_len: 102 tokens per row do not split into the 2 x cp"):
        load_config(SFTConfig, overrides=["parallel.pp=2", "parallel.cp=2", "data.max_seq_len=102"])


def _sample_then_train() -> dict[str, float]:
    """FSDP on 2 forked ranks: greedy sampling inside `sampling` (each rank its own prompts and
    length, so no collective may run per token) equals one process; training afterwards still does."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from posttrain.core.model.generate import SamplingParams, generate
    from posttrain.core.parallel import parallelize
    from posttrain.stages.training import sampling
    from tests.core.parallel._dist import (batch, clone, compare_training, dp_reference_loss, model_args, par_loss_fn,
                                      reference_model, setup)

    cfg, mesh, _ = setup(2, dp_shard=2)
    args = model_args("debug")
    ref = reference_model(args)
    par = parallelize(clone(ref), cfg, mesh)
    rank = dist.get_rank()
    prompts = [[5, 6, 7], [8, 9]] if rank == 0 else [[10, 11, 12, 13]]
    params = SamplingParams(max_new_tokens=2 + 5 * rank, temperature=0)
    with sampling(par, cfg):
        got = generate(par, prompts, params)
    want = generate(ref, prompts, params)
    out = {"tokens_differ": float(any(g.tokens != w.tokens for g, w in zip(got, want))),
           "logprobs": max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs)),
           "not_resharded": float(not isinstance(par.layers[0].attn.q_proj.weight, DTensor))}
    ids, _ = batch(args)
    out.update(compare_training(ref, par, dp_reference_loss(ids, None, 2), par_loss_fn(mesh, ids)))
    return out


@pytest.mark.slow
def test_sampling_under_fsdp_matches_one_process():
    from tests.core.parallel._dist import TOL, run_ranks

    for res in run_ranks(_sample_then_train, 2):
        bad = {k: v for k, v in res.items() if not v <= TOL}
        assert not bad, f"differences above {TOL}: {bad}"
