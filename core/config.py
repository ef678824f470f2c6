"""Typed configuration for every knob: one schema serves the CLI, Prefect's form and torchrun specs.

Layering: ModelConfig, LoRAConfig, ParallelConfig, OptimConfig, DataConfig, CheckpointConfig are
building blocks; each stage config composes the ones it needs. Launcher and tracking defaults sit
once in PipelineConfig; a stage may override them (`launcher: None` = the pipeline's).
flows.dag.PipelineDAG(cfg).spec(name) is the complete, self-contained spec a torchrun entry point gets.
Precedence: `--set` overrides > config file > defaults; the defaults describe the embedded demo.
"""

from __future__ import annotations

import json
import os
import re
import types
from pathlib import Path
from typing import Any, Literal, Sequence, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

STAGES = ("data_prep", "sft_teacher", "sft_student", "distill", "dpo", "evaluate")
StageName = Literal["data_prep", "sft_teacher", "sft_student", "distill", "dpo", "evaluate"]
STAGE_MODULES = {"data_prep": "data_prep", "sft_teacher": "sft", "sft_student": "sft",
                 "distill": "distill", "dpo": "dpo", "evaluate": "evaluate"}
"""Pipeline stage name -> `stages.<module>` entry point that runs it."""
Dtype = Literal["float32", "bfloat16", "float16"]
C = TypeVar("C", bound=BaseModel)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ConfigError(ValueError):
    """An invalid config file, override or value; the message names the file and the dotted key."""


class _Base(BaseModel):
    # Field descriptions land in the JSON schema, which Prefect renders as its run form.
    # inf/nan pass pydantic's gt/ge checks (nan compares false, inf is "greater"); no knob wants them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _text(cls, v: Any) -> Any:
        # No path, argv entry, env value or URL can hold a NUL, and a lone surrogate (YAML's
        # "\ud800") cannot even be written to the JSON spec: refuse them here, not deep in a stage.
        if (why := _bad_text(v)) is not None:
            raise ValueError(why)
        return v


_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")


def _bad_text(v: Any) -> str | None:
    if isinstance(v, str):
        m = _BAD_TEXT.search(v)
        return None if m is None else "contains a NUL byte" if m.group() == "\x00" else \
            "is not valid Unicode (a lone surrogate)"
    if isinstance(v, (list, tuple)):
        return next((w for x in v if (w := _bad_text(x))), None)
    if isinstance(v, dict):
        return next((w for k, x in v.items() if (w := _bad_text(k) or _bad_text(x))), None)
    return None


def ensure_within(base: str | Path, path: str | Path) -> Path:
    """`path` (relative paths taken from `base`) normalized; ValueError if it escapes `base`.

    Lexical on purpose: a symlink in the workspace to scratch storage is fine, a `..` out is not.
    """
    base_abs = os.path.abspath(base)
    full = os.path.abspath(os.path.join(base_abs, path))
    if os.path.commonpath([base_abs, full]) != base_abs:
        raise ValueError(f"path {str(path)!r} escapes {str(base)!r}")
    return Path(os.path.normpath(os.path.join(base, os.path.relpath(full, base_abs))))


# ---------------------------------------------------------------------------------- building blocks

class ModelConfig(_Base):
    name_or_path: str = Field("debug", description="Preset name, HF checkpoint dir, or a stage output dir.")
    dtype: Dtype = Field("float32", description="Weight/compute dtype: bfloat16 on GPUs, float32 on CPU.")
    activation_checkpointing: bool = Field(False, description="Recompute block activations in backward.")
    compile: bool = Field(False, description="torch.compile each transformer block.")
    overrides: dict[str, Any] = Field({}, description="Architecture fields set over the preset.")
    tokenizer: str | None = Field(None, description="Tokenizer dir; None = the checkpoint's or data prep's.")
    kernels: Literal["auto", "torch"] = Field(
        "auto", description="'auto': Triton on CUDA, torch elsewhere; 'torch' forces the references.")


class LoRAConfig(_Base):
    enabled: bool = Field(False, description="Train low-rank adapters on a frozen base, not all weights.")
    rank: int = Field(16, gt=0, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Updates are scaled by alpha/r (alpha/sqrt(r) with rsLoRA).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    targets: list[str] = Field(
        ["all-linear"], description="Layer names or globs (q_proj, mlp.*), or 'all-linear' (not lm_head).")
    modules_to_save: list[str] = Field([], description="Modules trained in full, e.g. embed_tokens.")
    use_rslora: bool = Field(False, description="Rank-stabilized scaling alpha/sqrt(r).")
    use_dora: bool = Field(False, description="DoRA: learn a per-channel magnitude beside the direction.")
    init_lora_weights: Literal["kaiming", "gaussian", "pissa"] = Field(
        "kaiming", description="How A starts (B starts at 0); 'pissa' takes the base's top singular part.")
    quantize_base: Literal["nf4"] | None = Field(None, description="QLoRA: hold the frozen base in NF4.")
    double_quant: bool = Field(False, description="Also quantize the NF4 block scales.")
    adapter_names: list[str] = Field(
        ["default"], description="Named adapters on one base, trained in one job; the first is active.")

    @model_validator(mode="after")
    def _check(self) -> LoRAConfig:
        if not self.targets:
            raise ValueError("targets is empty; use e.g. [q_proj, v_proj] or [all-linear]")
        if "all-linear" in self.targets and len(self.targets) > 1:
            raise ValueError("targets: 'all-linear' covers every linear layer; use it alone")
        if self.double_quant and self.quantize_base is None:
            raise ValueError("double_quant needs quantize_base='nf4'")
        if self.init_lora_weights == "pissa" and self.quantize_base:
            raise ValueError("init_lora_weights='pissa' rewrites the base; not with quantize_base")
        names = self.adapter_names
        if not names or len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
            raise ValueError(f"adapter_names must be unique identifiers, got {names}")
        return self


class ParallelConfig(_Base):
    dp_replicate: int = Field(1, ge=1, description="Data-parallel replicas (DDP / HSDP replicate).")
    dp_shard: int = Field(-1, description="FSDP shard size; -1 = whatever the other sizes leave.")
    tp: int = Field(1, ge=1, description="Tensor-parallel size; must divide the attention and KV heads.")
    pp: int = Field(1, ge=1, description="Pipeline-parallel stages.")
    cp: int = Field(1, ge=1, description="Context-parallel size (ring attention over the sequence).")
    ep: int = Field(1, ge=1, description="Expert-parallel size, carved out of dp_shard*cp ranks.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field("1f1b", description="Schedule.")
    pp_microbatches: int | None = Field(None, gt=0, description="Microbatches per pipeline step; None = pp.")
    pp_stages_per_rank: int = Field(1, ge=1, description="Virtual stages per rank (interleaved_1f1b: >= 2).")
    sequence_parallel: bool = Field(True, description="With tp > 1, shard norm activations by sequence.")
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = Field(
        "default", description="Free gathered params after forward; 'default' = yes unless pp > 1.")
    mixed_precision_param: Dtype | None = Field(None, description="FSDP param dtype; None = model.dtype.")
    mixed_precision_reduce: Dtype | None = Field("float32", description="Grad reduce dtype; None = param.")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="'auto': nccl on CUDA, else gloo.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto': CUDA when available.")

    @field_validator("dp_shard")
    @classmethod
    def _dp_shard(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("dp_shard must be -1 (fill the world) or >= 1")
        return v

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.pp > 1 and (self.pp_schedule == "interleaved_1f1b") != (self.pp_stages_per_rank > 1):
            raise ValueError("pp_stages_per_rank > 1 goes with pp_schedule='interleaved_1f1b', and only it")
        return self

    def resolve(self, world_size: int) -> dict[str, int]:
        """Concrete mesh sizes for `world_size` ranks; ValueError naming the mismatch."""
        fixed = self.dp_replicate * self.cp * self.tp * self.pp
        layout = f"dp_replicate={self.dp_replicate} * cp={self.cp} * tp={self.tp} * pp={self.pp}"
        if self.dp_shard == -1:
            if world_size % fixed:
                raise ValueError(f"world size {world_size} is not divisible by {layout} = {fixed}")
            dp_shard = world_size // fixed
        else:
            dp_shard = self.dp_shard
            if dp_shard * fixed != world_size:
                raise ValueError(f"{layout} * dp_shard={dp_shard} = {dp_shard * fixed} ranks, but the "
                                 f"world size is {world_size}; set dp_shard=-1 to fill it")
        if (dp_shard * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp_shard*cp = {dp_shard}*{self.cp}: expert "
                             "parallelism reuses the data/context-parallel ranks")
        mb = self.pp_microbatches or self.pp
        if self.pp > 1 and self.pp_schedule != "gpipe" and mb < self.pp:
            raise ValueError(f"pp_schedule={self.pp_schedule!r} needs pp_microbatches >= pp={self.pp}")
        if self.pp > 1 and self.pp_schedule == "interleaved_1f1b" and mb % self.pp:
            raise ValueError(f"interleaved_1f1b needs pp_microbatches ({mb}) divisible by pp={self.pp}")
        return {"dp_replicate": self.dp_replicate, "dp_shard": dp_shard, "cp": self.cp,
                "tp": self.tp, "pp": self.pp, "ep": self.ep}

    def validate_for_model(self, n_heads: int, n_kv_heads: int, n_experts: int = 0) -> None:
        """ValueError when the model cannot be split this way (heads over tp, experts over ep)."""
        for what, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if n % self.tp:
                ok = [d for d in range(1, n_kv_heads + 1) if n_heads % d == 0 and n_kv_heads % d == 0]
                raise ValueError(f"tp={self.tp} does not divide the model's {what}={n} "
                                 f"(n_heads={n_heads}, n_kv_heads={n_kv_heads}); valid tp: {ok}")
        if self.ep > 1 and not n_experts:
            raise ValueError(f"ep={self.ep} but the model is dense (no experts); set ep=1")
        if n_experts and n_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the model's n_experts={n_experts}")


class OptimConfig(_Base):
    lr: float = Field(3e-4, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (not on norms and biases).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps from 0 to lr.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "cosine", description="Decay after warmup, to lr * min_lr_ratio at the last step.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of the peak.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global grad norm; None = off.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"betas must lie in [0, 1), got {v}")
        return v


class DataConfig(_Base):
    sources: list[str] = Field([], description="JSONL/Parquet/HF dataset dirs; empty = data prep's output.")
    format: Literal["sft", "preference", "auto"] = Field(
        "auto", description="Rows: prompt/response or messages, prompt/chosen/rejected, or detect.")
    max_seq_len: int = Field(512, gt=0, description="Tokens per sequence (or per packed row).")
    packing: bool = Field(True, description="Pack examples padding-free; attention never crosses them.")
    truncation: Literal["left", "right", "drop"] = Field(
        "right", description="Over-long examples: cut the start, cut the end, or skip them.")
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="Malformed rows raise (naming file, row, field) or are counted and skipped.")
    micro_batch_size: int = Field(8, gt=0, description="Sequences per rank per micro step.")
    batch_tokens: int | None = Field(
        None, gt=0, description="Tokens per rank per micro step when packing; replaces micro_batch_size.")
    chat_template: str | None = Field(None, description="Template name or Jinja file; None = tokenizer's.")
    mask_prompt: bool = Field(True, description="Loss on responses only.")
    seed: int = Field(0, ge=0, lt=2**63, description="Shuffle seed (sampling is deterministic and resumable).")
    val_fraction: float = Field(0.05, ge=0, lt=1, description="Held out for validation if sources lack the split.")
    test_fraction: float = Field(0.0, ge=0, lt=1, description="Held out for test if sources lack the split.")
    dedup: bool = Field(False, description="Drop exact duplicates (data prep already does).")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError("val_fraction + test_fraction must leave some training data")
        if self.batch_tokens is not None and (not self.packing or self.batch_tokens < self.max_seq_len):
            raise ValueError("batch_tokens needs packing=true and batch_tokens >= max_seq_len")
        return self


class CheckpointConfig(_Base):
    interval_steps: int = Field(100, ge=0, description="Save every N steps; 0 = only at the end.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept.")
    async_save: bool = Field(False, description="Save in the background while training goes on.")
    resume: bool = Field(True, description="Resume from the latest complete checkpoint if there is one.")
    on_save_error: Literal["fail", "continue"] = Field(
        "fail", description="A failed periodic save stops the job, or is logged and retried next time.")


class ReliabilityConfig(_Base):
    """How a training stage survives bad steps, hangs and preemption (core.reliability)."""

    spike_zscore: float = Field(
        6.0, ge=0, description="Skip a step whose loss is this many std devs above the recent mean; 0 = off.")
    spike_window: int = Field(
        100, ge=2, description="Recent accepted step losses the z-score uses; active once half full.")
    max_bad_steps: int = Field(
        5, ge=0, description="After this many skipped steps in a row (non-finite or spike), roll back to "
                             "the last checkpoint, keeping the data position; 0 = never roll back.")
    max_rollbacks: int = Field(3, ge=0, description="Rollbacks allowed in one run before it fails as diverged.")
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="Timeout of every collective (init_process_group); past it the rank fails.")
    hang_timeout_s: float = Field(
        900.0, ge=0, description="Watchdog: a rank without progress this long dumps every rank's stack and "
                                 "ends the job (must exceed the longest step, eval or save); 0 = off.")
    preempt_grace_s: float = Field(
        60.0, gt=0, description="After SIGTERM: time to write a final checkpoint and exit (code 75) before a "
                                "hard exit; keep it below the scheduler's kill delay (torchrun: 30 s).")

    @model_validator(mode="after")
    def _check(self) -> ReliabilityConfig:
        if self.hang_timeout_s and self.hang_timeout_s >= self.collective_timeout_s:
            raise ValueError(f"hang_timeout_s={self.hang_timeout_s} must be below collective_timeout_s="
                             f"{self.collective_timeout_s}: the watchdog dumps the stacks before a collective "
                             "times out and ends the job without them")
        return self


class TrackingConfig(_Base):
    enabled: bool = Field(True, description="Log to MLflow (from rank 0).")
    tracking_uri: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI.")
    experiment: str = Field("posttrain", description="MLflow experiment (pipeline = parent run).")
    artifact_location: str | None = Field(None, description="Artifact root of a new experiment.")
    log_every: int = Field(10, ge=1, description="Log metrics every N steps.")
    system_metrics: bool = Field(False, description="Sample CPU/GPU/memory utilization.")
    tags: dict[str, str] = Field({}, description="Extra tags on every run.")


class SlurmOptions(_Base):
    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    time: str = Field("01:00:00", description="sbatch --time limit.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node; 0 = CPU job.")
    cpus_per_task: int = Field(8, ge=1, description="CPUs per node (torchrun runs once per node).")
    extra_args: list[str] = Field([], description="More sbatch arguments, e.g. ['--qos=high'].")

    @field_validator("partition", "account", "time", "extra_args")
    @classmethod
    def _one_line(cls, v: Any) -> Any:
        # Each lands on an `#SBATCH` line of the batch script: a newline would start a shell command.
        for item in v if isinstance(v, list) else [v]:
            if item is not None and _CONTROL.search(item):
                raise ValueError("contains a control character (a newline would add a line to the batch script)")
        return v


class KubernetesOptions(_Base):
    api: Literal["trainjob", "pytorchjob"] = Field(
        "trainjob", description="Kubeflow Trainer TrainJob, or the older Training Operator PyTorchJob.")
    image: str | None = Field(None, description="Container image with this project installed.")
    namespace: str = Field("default", description="Namespace of the job.")
    runtime: str = Field("torch-distributed", description="TrainJob runtimeRef.")
    resources: dict[str, str | int] = Field({}, description="Per-node limits, e.g. {nvidia.com/gpu: 8}.")
    volumes: list[dict[str, Any]] = Field([], description="Pod volumes, each with a mountPath.")
    service_account: str | None = Field(None, description="Service account of the pods.")


class LauncherConfig(_Base):
    kind: Literal["local", "multinode", "slurm", "kubernetes"] = Field(
        "local", description="torchrun here, torchrun on several hosts, Slurm, or a Kubeflow job.")
    nproc_per_node: int = Field(2, ge=1, description="Ranks per node (one per GPU on GPU nodes).")
    nnodes: int = Field(1, ge=1, description="Number of nodes.")
    rdzv_endpoint: str | None = Field(None, description="host:port of the c10d rendezvous (multinode).")
    max_restarts: int = Field(0, ge=0, description="Worker-group restarts after a failure (resume).")
    env: dict[str, str] = Field({}, description="Environment of every rank, whatever the kind.")
    slurm: SlurmOptions = Field(SlurmOptions(), description="Used when kind='slurm'.")
    kubernetes: KubernetesOptions = Field(KubernetesOptions(), description="Used when kind='kubernetes'.")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        # The Slurm script exports each key unquoted: it must be a plain name.
        for k, val in v.items():
            if not _ENV_NAME.fullmatch(k):
                raise ValueError(f"env key {k!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)")
        return v

    @model_validator(mode="after")
    def _check(self) -> LauncherConfig:
        if self.kind == "local" and self.nnodes > 1:
            raise ValueError("kind='local' runs on this machine; use kind='multinode' for nnodes > 1")
        if self.kind == "multinode" and not self.rdzv_endpoint:
            raise ValueError("kind='multinode' needs rdzv_endpoint (host:port)")
        if self.kind == "kubernetes" and not self.kubernetes.image:
            raise ValueError("kind='kubernetes' needs kubernetes.image")
        return self


def check_layout(parallel: ParallelConfig, launcher: LauncherConfig) -> None:
    """ValueError when the launcher's ranks cannot hold the parallel layout; checked when the
    config loads, so an impossible layout never starts a process."""
    try:
        parallel.resolve(launcher.nnodes * launcher.nproc_per_node)
    except ValueError as e:
        raise ValueError(f"parallel: {e} (the launcher starts {launcher.nnodes} node(s) x "
                         f"{launcher.nproc_per_node} ranks)") from None


# ---------------------------------------------------------------------------------- stages

class StageConfig(_Base):
    output_dir: str | None = Field(None, description="Output dir; None = <workspace>/<pipeline>/<stage>.")
    launcher: LauncherConfig | None = Field(None, description="None = the pipeline's launcher.")
    tracking: TrackingConfig | None = Field(None, description="None = the pipeline's tracking.")
    seed: int = Field(0, ge=0, lt=2**63, description="Seed for init, dropout and sampling.")


class DataPrepConfig(StageConfig):
    sources: list[str] = Field([], description="JSONL/Parquet/HF dataset dirs to import.")
    format: Literal["sft", "preference", "auto"] = Field("auto", description="Row schema of sources.")
    synthetic_size: int = Field(2000, ge=0, description="Examples in the verifiable synthetic suite.")
    synthetic_seed: int = Field(0, ge=0, lt=2**63, description="Seed of the synthetic suite.")
    synthetic_tasks: list[str] | None = Field(None, description="Synthetic tasks; None = all.")
    tokenizer: str | None = Field(None, description="HF tokenizer dir; None = train a small BPE one.")
    vocab_size: int = Field(512, ge=32, description="Vocabulary of the trained tokenizer.")
    val_fraction: float = Field(0.05, ge=0, lt=1, description="Share of examples in the validation split.")
    test_fraction: float = Field(0.05, ge=0, lt=1, description="Share of examples in the test split.")
    dedup: bool = Field(True, description="Drop duplicates before splitting, so no test row leaks.")
    min_tokens: int = Field(1, ge=1, description="Drop shorter examples.")
    max_tokens: int = Field(2048, ge=1, description="Drop longer examples.")
    on_bad_row: Literal["error", "skip"] = Field("error", description="Raise on, or skip, malformed rows.")

    @model_validator(mode="after")
    def _check(self) -> DataPrepConfig:
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError("val_fraction + test_fraction must leave some training data")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if not self.sources and self.synthetic_size == 0:
            raise ValueError("no data: give sources or a synthetic_size > 0")
        return self


class TrainStageConfig(StageConfig):
    """What SFT, distillation and DPO share: the model being trained and the loop around it."""

    init_from: StageName | None = Field(None, description="Stage whose output is the start model.")
    model: ModelConfig = Field(ModelConfig(), description="The model being trained.")
    lora: LoRAConfig = Field(LoRAConfig(), description="Adapters; disabled = full fine-tuning.")
    parallel: ParallelConfig = Field(ParallelConfig(), description="Mesh and parallelism.")
    optim: OptimConfig = Field(OptimConfig(), description="Optimizer and LR schedule.")
    data: DataConfig = Field(DataConfig(), description="Training data.")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="Checkpoints and resume.")
    reliability: ReliabilityConfig = Field(ReliabilityConfig(), description="Bad steps, hangs, preemption.")
    max_steps: int | None = Field(200, gt=0, description="Stop after this many steps (or `epochs`).")
    epochs: int = Field(1, ge=1, description="Stop after this many passes (or `max_steps`).")
    eval_interval: int = Field(50, ge=0, description="Validation every N steps; 0 = only at the end.")
    save: Literal["full", "adapter"] = Field(
        "full", description="Output all weights (LoRA merged in) or only the adapter (PEFT format).")
    export_merged: bool = Field(False, description="Also write an HF checkpoint for use elsewhere.")

    @model_validator(mode="after")
    def _check_train(self) -> TrainStageConfig:
        if self.save == "adapter" and not self.lora.enabled:
            raise ValueError("save='adapter' needs lora.enabled=true")
        if self.launcher is not None:
            check_layout(self.parallel, self.launcher)
        return self


class SFTConfig(TrainStageConfig):
    data: DataConfig = Field(DataConfig(format="sft"), description="Prompt/response or chat data.")


class DistillConfig(TrainStageConfig):
    init_from: StageName | None = Field("sft_student", description="Stage whose output is the student.")
    model: ModelConfig = Field(ModelConfig(), description="The student (the model being trained).")
    teacher: ModelConfig = Field(ModelConfig(), description="The frozen teacher; same vocabulary.")
    teacher_from: StageName | None = Field("sft_teacher", description="Stage whose output is the teacher.")
    data: DataConfig = Field(DataConfig(format="sft"), description="Prompts (and responses).")
    kind: Literal["forward_kl", "reverse_kl", "jsd"] = Field("forward_kl", description="Divergence.")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of both; loss scaled by T^2.")
    jsd_beta: float = Field(0.5, ge=0, le=1, description="Generalized JSD weight (0 fwd KL, 1 rev KL).")
    mode: Literal["online", "on_policy", "offline"] = Field(
        "online", description="Teacher scores data live, scores student samples, or was precomputed.")
    on_policy_ratio: float = Field(0.5, ge=0, le=1, description="on_policy: share of student batches.")
    max_new_tokens: int = Field(64, gt=0, description="On-policy generation length.")
    top_k: int | None = Field(None, gt=0, description="Teacher's top-k logits only (offline: required).")
    ce_weight: float = Field(0.0, ge=0, description="Weight of a hard-label cross-entropy term.")

    @model_validator(mode="after")
    def _check_distill(self) -> DistillConfig:
        if self.mode == "offline" and self.top_k is None:
            raise ValueError("mode='offline' stores teacher logits per token; set top_k (e.g. 64)")
        return self


class DPOConfig(TrainStageConfig):
    init_from: StageName | None = Field("distill", description="Stage whose output is the policy.")
    lora: LoRAConfig = Field(LoRAConfig(enabled=True), description="Adapters; the base is the reference.")
    optim: OptimConfig = Field(OptimConfig(lr=5e-5), description="Optimizer; DPO wants a small lr.")
    data: DataConfig = Field(DataConfig(format="preference"), description="Pairs, or prompts (on_policy).")
    beta: float = Field(0.1, gt=0, description="Strength of the implicit KL to the reference.")
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo"] = Field(
        "sigmoid", description="DPO, IPO, SLiC hinge, robust DPO, or SimPO (reference-free).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Assumed label-flip rate (cDPO/rDPO).")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO target reward margin.")
    sft_weight: float = Field(0.0, ge=0, description="Weight of an NLL term on chosen responses (RPO).")
    reference: Literal["precomputed", "disable_adapter", "model"] = Field(
        "disable_adapter", description="Reference log-probs: computed once before training ('precomputed'), "
                                       "by the LoRA base ('disable_adapter'), or by a frozen copy of the starting "
                                       "model run beside the policy ('model').")
    pairs: Literal["offline", "on_policy"] = Field(
        "offline", description="Pairs from the data, or policy samples ranked by the task verifier.")
    num_samples: int = Field(4, ge=2, description="On-policy samples per prompt.")
    max_new_tokens: int = Field(64, gt=0, description="On-policy generation length.")
    gen_temperature: float = Field(1.0, gt=0, description="On-policy sampling temperature.")

    @model_validator(mode="after")
    def _check_dpo(self) -> DPOConfig:
        if self.loss_type != "simpo" and self.reference == "disable_adapter":
            if not self.lora.enabled:
                raise ValueError("reference='disable_adapter' needs lora.enabled=true; "
                                 "use reference='precomputed' for full fine-tuning")
            if self.lora.init_lora_weights == "pissa":
                raise ValueError("reference='disable_adapter' with PiSSA init is not the original model")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust"):
            raise ValueError(f"label_smoothing applies to loss_type sigmoid/robust, not {self.loss_type!r}")
        return self


class EvalConfig(StageConfig):
    init_from: StageName | None = Field("dpo", description="Stage whose output is evaluated.")
    model: ModelConfig = Field(ModelConfig(), description="The model evaluated.")
    compare_to: list[str] = Field(
        ["sft_student", "distill"], description="Stages or model dirs evaluated alongside.")
    parallel: ParallelConfig = Field(
        ParallelConfig(), description="Device, backend and data-parallel ranks the examples are split over "
                                      "(each holds the whole model: tp, pp, cp and ep stay 1).")
    data: DataConfig = Field(DataConfig(), description="Evaluation data.")
    split: Literal["validation", "test"] = Field("test", description="Split evaluated.")
    max_examples: int | None = Field(None, gt=0, description="At most this many examples; None = all.")
    max_new_tokens: int = Field(64, gt=0, description="Generation length.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    num_samples: int = Field(1, ge=1, description="Samples per prompt (pass@k).")
    batch_size: int = Field(16, gt=0, description="Prompts per generation batch per rank.")
    save_samples: bool = Field(True, description="Log generations as an artifact.")

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError("num_samples > 1 with temperature=0 repeats one greedy sample")
        split = [f"parallel.{k}={getattr(self.parallel, k)}" for k in ("tp", "pp", "cp", "ep")
                 if getattr(self.parallel, k) > 1]
        if split:
            raise ValueError(f"{', '.join(split)}: evaluation splits the examples over data-parallel ranks, "
                             "each holding the whole model; set them to 1")
        if self.launcher is not None:
            check_layout(self.parallel, self.launcher)
        return self


STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    "data_prep": DataPrepConfig, "sft": SFTConfig, "distill": DistillConfig,
    "dpo": DPOConfig, "evaluate": EvalConfig}
"""Stage module name -> its config class (for `python -m stages.<name> --config spec.json`)."""


# ---------------------------------------------------------------------------------- pipeline

class StagesEnabled(_Base):
    data_prep: bool = Field(True, description="Tokenizer, synthetic suite, splits.")
    sft_teacher: bool = Field(True, description="Fine-tune the teacher.")
    sft_student: bool = Field(True, description="Fine-tune the student.")
    distill: bool = Field(True, description="Distill the teacher into the student.")
    dpo: bool = Field(True, description="Preference-optimize the student.")
    evaluate: bool = Field(True, description="Evaluate and compare; gates promotion.")


class RegistryConfig(_Base):
    enabled: bool = Field(True, description="Register the evaluated model in MLflow.")
    model_name: str = Field("posttrain-demo", description="Registered model name.")
    promote_metric: str = Field("exact_match", description="Evaluation metric gating candidate -> champion.")
    greater_is_better: bool = Field(True, description="Direction of promote_metric.")
    min_delta: float = Field(0.0, ge=0, description="Margin the candidate must beat the champion by.")


class PipelineConfig(_Base):
    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Run dir name.")
    workspace: str = Field("runs", description="Root of all stage outputs.")
    stages: StagesEnabled = Field(StagesEnabled(), description="Which stages run.")
    data_prep: DataPrepConfig = Field(DataPrepConfig(), description="Data preparation.")
    sft_teacher: SFTConfig = Field(SFTConfig(), description="SFT of the teacher.")
    sft_student: SFTConfig = Field(SFTConfig(), description="SFT of the student.")
    distill: DistillConfig = Field(DistillConfig(), description="Teacher -> student distillation.")
    dpo: DPOConfig = Field(DPOConfig(), description="Preference optimization.")
    evaluate: EvalConfig = Field(EvalConfig(), description="Evaluation.")
    tracking: TrackingConfig = Field(TrackingConfig(), description="MLflow, unless a stage sets its own.")
    launcher: LauncherConfig = Field(LauncherConfig(), description="Launcher, unless a stage sets its own.")
    registry: RegistryConfig = Field(RegistryConfig(), description="Model registry and promotion.")
    schedule: str | None = Field("0 3 * * 1", description="Deployment cron (Mon 03:00); None = manual.")
    stage_retries: int = Field(2, ge=0, description="Retries of a failed stage (it resumes from its checkpoint).")
    retry_delay_s: float = Field(10.0, ge=0, description="First retry delay; each next one is 3x longer.")

    @field_validator("workspace")
    @classmethod
    def _workspace(cls, v: str) -> str:
        # A relative workspace is read on whichever worker runs the flow; `..` makes that ambiguous.
        if ".." in Path(v).parts:
            raise ValueError(f"workspace {v!r} contains '..'; use an absolute path")
        return v

    @field_validator("schedule")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        if v is not None and len(v.split()) != 5:
            raise ValueError(f"schedule {v!r} is not a 5-field cron expression")
        return v

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if not self.enabled_stages():
            raise ValueError("stages: every stage is disabled")
        dirs: dict[Path, str] = {}
        for i, s in enumerate(STAGES):
            cfg = getattr(self, s)
            for ref in ("init_from", "teacher_from"):
                if (up := getattr(cfg, ref, None)) is not None and STAGES.index(up) >= i:
                    raise ValueError(f"{s}.{ref}: {up!r} does not run before {s!r}")
            if (d := self.stage_dir(s)) in dirs:  # stage_dir raises if output_dir escapes
                raise ValueError(f"{s}.output_dir: same directory as {dirs[d]}.output_dir")
            dirs[d] = s
            data = getattr(cfg, "data", None)
            enabled = getattr(self.stages, s)
            if enabled and hasattr(cfg, "parallel") and cfg.launcher is None:
                try:
                    check_layout(cfg.parallel, self.launcher)
                except ValueError as e:
                    raise ValueError(f"{s}.{e}") from None
            if data is not None and not data.sources and enabled and not self.stages.data_prep:
                raise ValueError(f"{s}.data.sources is empty and stages.data_prep is disabled")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.workspace) / self.name

    def stage_dir(self, name: str) -> Path:
        """The output dir of stage `name`; ValueError if a custom one escapes the workspace."""
        custom = getattr(self, name).output_dir
        if custom is None:
            return self.run_dir / name
        try:
            return ensure_within(self.workspace, Path(self.name) / custom)
        except ValueError as e:
            raise ValueError(f"{name}.output_dir: {e} (the workspace)") from None

    def enabled_stages(self) -> list[str]:
        return [s for s in STAGES if getattr(self.stages, s)]


# ---------------------------------------------------------------------------------- loading

class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars: `1e-4` is a float, `no`/`on` and `4:00:00` stay strings;
    a key given twice in one mapping is an error (YAML says so; PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key_node.value!r}", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


_Yaml12Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag.rsplit(":", 1)[-1] not in ("bool", "int", "float", "timestamp")]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, _rx, _first in (
        ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("int", r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$", "-+0123456789"),
        ("float", r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
                  r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
         "-+0123456789.")):
    _Yaml12Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_rx), list(_first))


def _model_of(ann: Any) -> type[BaseModel] | None:
    if get_origin(ann) in (Union, types.UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        return _model_of(args[0]) if len(args) == 1 else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _free_form(ann: Any) -> bool:
    if get_origin(ann) in (Union, types.UnionType):
        return any(_free_form(a) for a in get_args(ann))
    return get_origin(ann) is dict or ann is dict


def _keys_at(cls: type[BaseModel], parts: list[str]) -> list[str]:
    """Valid keys of the section at `parts`; ConfigError naming the path if it is not one."""
    model: type[BaseModel] | None = cls
    for i, part in enumerate(parts):
        assert model is not None
        if part not in model.model_fields:
            where = f"at {'.'.join(parts[:i])!r}" if i else "at the top level"
            raise ConfigError(f"unknown key {'.'.join(parts[:i + 1])!r}; valid keys {where}: "
                              f"{', '.join(model.model_fields)}")
        ann = model.model_fields[part].annotation
        if _free_form(ann):
            return []  # keys under a dict field (model.overrides.n_layers) are not ours to check
        if (model := _model_of(ann)) is None and i < len(parts) - 1:
            raise ConfigError(f"cannot set {'.'.join(parts)!r}: "
                              f"{'.'.join(parts[:i + 1])!r} is a value, not a section")
    return list(model.model_fields) if model is not None else []


_MAX_NODES, _MAX_DEPTH = 100_000, 64


def _check_size(data: Any, where: str) -> None:
    """ConfigError for a document too deep or too big once YAML aliases are expanded (a "billion
    laughs" document is small on disk; everything that walks it would not be)."""
    stack, count = [(data, 0)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > _MAX_NODES:
            raise ConfigError(f"{where}: more than {_MAX_NODES} values (with YAML aliases expanded); not a config")
        if depth > _MAX_DEPTH:
            raise ConfigError(f"{where}: nested more than {_MAX_DEPTH} levels deep; not a config")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend((v, depth + 1) for v in node)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_Yaml12Loader) or {}
        else:
            raise ConfigError(f"{path}: unknown config extension {path.suffix!r} (use .yaml, .yml, .json)")
    # ValueError: an integer of more than 4300 digits; RecursionError: thousands of nested brackets.
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    _check_size(data, str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _format(cls: type[BaseModel], err: ValidationError, where: str, sets: list[tuple[str, str]]) -> str:
    lines = []
    for e in err.errors(include_url=False):
        loc = e["loc"]
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else str(p) for i, p in enumerate(loc))
        if e["type"] == "extra_forbidden":
            try:
                valid = _keys_at(cls, [p for p in loc[:-1] if isinstance(p, str)])
            except ConfigError:  # e.g. a location inside a free-form dict
                valid = []
            msg = f"unknown key; valid keys here: {', '.join(valid)}" if valid else "unknown key"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] != "missing" and loc and not isinstance(e.get("input"), dict):
                got = repr(e.get("input"))
                msg += f" (got {got if len(got) <= 60 else got[:57] + '...'})"
        origin = next((f" (from --set {k}={raw})" for k, raw in sets
                       if key and (key == k or key.startswith(k + ".") or k.startswith(key + "."))), where)
        lines.append(f"{key}: {msg}{origin}" if key else f"{msg}{origin}")
    return "\n".join(lines)


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()) -> C:
    """Defaults, then the YAML/JSON file at `path`, then `a.b.c=value` overrides (YAML values).

    Sections merge key by key, so `dpo: {lora: {rank: 8}}` keeps DPO's other LoRA defaults.
    Raises ConfigError naming the dotted key, the problem and the file (or the `--set` item).
    """
    where = f" in {path}" if path is not None else ""
    try:
        data = cls().model_dump(mode="json")
    except ValidationError:  # a schema with required fields has no defaults to start from
        data = {}
    data = _merge(data, _read(Path(path)) if path is not None else {})
    sets = []
    for item in [overrides] if isinstance(overrides, str) else overrides:
        key, eq, raw = item.partition("=")
        parts = key.strip().split(".")
        if not eq or not all(parts):
            raise ConfigError(f"override {item!r} is not of the form a.b.c=value")
        try:
            _keys_at(cls, parts)
        except ConfigError as e:
            raise ConfigError(f"--set {item}: {e}") from None
        try:
            value = yaml.load(raw, Loader=_Yaml12Loader)
        except (yaml.YAMLError, ValueError, RecursionError) as e:
            raise ConfigError(f"--set {item}: value is not valid YAML: {e}") from None
        _check_size(value, f"--set {item}")
        node = data
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):  # e.g. a `launcher: null` section being filled in
                node[p] = {}
            node = node[p]
        old = node.get(parts[-1])
        node[parts[-1]] = _merge(old, value) if isinstance(value, dict) and isinstance(old, dict) else value
        sets.append((".".join(parts), raw))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(cls, e, where, sets)) from None


def dump_config(cfg: BaseModel) -> dict[str, Any]:
    """The config as plain JSON-able data (what Prefect stores and load_config reads back)."""
    return cfg.model_dump(mode="json")


def to_json_file(cfg: BaseModel, path: str | Path) -> Path:
    """Write `cfg` as JSON atomically (write, then rename), for a torchrun entry point's --config.
    Readable by its owner only: it holds launcher.env, where tokens go."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(dump_config(cfg), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def from_json_file(cls: type[C], path: str | Path) -> C:
    """Read a spec written by to_json_file (errors name the file and key, like load_config)."""
    return load_config(cls, path)
