"""Each stage's config, and the stage names a pipeline wires them by.

A stage's spec is self-contained: model, data, layout and loop, plus its own launcher and tracking
when it is run alone (`launcher: None` = the pipeline's). Building blocks come from their owners:
ModelConfig (core.model.config), LoRAConfig (core.lora.config), ParallelConfig
(core.parallel.config), OptimConfig (core.optim), DataConfig (core.data.config),
CheckpointConfig (core.checkpoint.config), ReliabilityConfig (core.reliability.config),
TrackingConfig (core.tracking), LauncherConfig (stages.launch.config)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from core.checkpoint.config import CheckpointConfig
from core.config import ConfigModel, Dtype
from core.data.config import DataConfig
from core.lora.config import LoRAConfig
from core.model.config import ModelConfig
from core.optim import OptimConfig
from core.parallel.config import ParallelConfig
from core.reliability.config import ReliabilityConfig
from core.tracking import TrackingConfig
from stages.launch.config import LauncherConfig


KINDS = ("data_prep", "sft", "distill", "dpo", "evaluate")
"""The stage kinds; kind `k` runs as `python -m stages.<k>` (a pipeline node names its kind)."""


def model_shorthand(v: Any) -> Any:
    """`model: sft` (a node name, path or preset) means `model: {name_or_path: sft}`."""
    return {"name_or_path": v} if isinstance(v, str) else v


def data_shorthand(v: Any) -> Any:
    """`data: prep` or `data: [a.jsonl, b.jsonl]` means `data: {sources: [...]}`."""
    if isinstance(v, str):
        return {"sources": [v]}
    if isinstance(v, list):
        return {"sources": v}
    return v


def check_layout(parallel: ParallelConfig, launcher: LauncherConfig) -> None:
    """ValueError when the launcher's ranks cannot hold the parallel layout; checked when the
    config loads, so an impossible layout never starts a process."""
    try:
        parallel.resolve(launcher.nnodes * launcher.nproc_per_node)
    except ValueError as e:
        raise ValueError(f"parallel: {e} (the launcher starts {launcher.nnodes} node(s) x "
                         f"{launcher.nproc_per_node} ranks)") from None


class StageConfig(ConfigModel):
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
    chat_template: str | None = Field(
        None, description="Template name, Jinja file or text the rows are rendered with; None = the tokenizer's.")
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

    model: ModelConfig = Field(ModelConfig(), description="The model being trained (in a pipeline: a node name).")
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

    _model = field_validator("model", mode="before")(model_shorthand)
    _data = field_validator("data", mode="before")(data_shorthand)

    @model_validator(mode="after")
    def _check_train(self) -> TrainStageConfig:
        if self.save == "adapter" and not self.lora.enabled:
            raise ValueError("save='adapter' needs lora.enabled=true")
        if self.launcher is not None:
            check_layout(self.parallel, self.launcher)
        self.check_stage_layout()
        return self

    def check_stage_layout(self) -> None:
        """ValueError naming the key when this stage cannot run under cfg.parallel (the layouts
        core.parallel itself cannot take are checked against the world and the model)."""
        p = self.parallel
        if p.pp > 1:
            self._check_pipeline()

    def pipeline_rows(self) -> int:
        """Rows of one micro-batch under pipeline parallelism (the schedule's fixed shape)."""
        return self.data.micro_batch_size

    def _check_pipeline(self) -> None:
        """What pipeline parallelism needs: fixed (rows, tokens) microbatches, and dimensions it
        does not combine with in the stages yet."""
        p, data = self.parallel, self.data
        if p.cp > 1:
            raise ValueError(f"parallel.cp: context parallelism (cp={p.cp}) with pipeline parallelism (pp={p.pp}) "
                             "does not run in the stages yet; use pp with FSDP / TP, or cp without pp")
        if p.ep > 1:
            raise ValueError(f"parallel.ep: mixture-of-experts models (ep={p.ep}) do not run under pipeline "
                             f"parallelism (pp={p.pp}) in the stages yet; use EP x FSDP")
        if self.lora.enabled and self.lora.quantize_base:
            raise ValueError(f"lora.quantize_base: an NF4 base (QLoRA) does not run under pipeline parallelism "
                             f"(pp={p.pp}) yet; use FSDP")
        if data.batch_tokens is not None:
            raise ValueError(f"data.batch_tokens: pipeline parallelism (pp={p.pp}) runs fixed microbatch shapes; "
                             "set data.micro_batch_size (packed rows of data.max_seq_len tokens) instead")
        microbatches = p.pp_microbatches or p.pp
        if data.micro_batch_size % microbatches:
            raise ValueError(f"data.micro_batch_size: {data.micro_batch_size} rows do not split into "
                             f"{microbatches} pipeline microbatches (parallel.pp_microbatches, default pp); "
                             "make it a multiple")
        if p.tp > 1 and p.sequence_parallel and data.max_seq_len % p.tp:
            raise ValueError(f"data.max_seq_len: {data.max_seq_len} tokens per row do not split over tp={p.tp} "
                             "(sequence parallelism under pipeline parallelism); make it a multiple")

    @model_validator(mode="after")
    def _check_adapters(self) -> TrainStageConfig:
        """What several adapters trained at once (stages/adapters.py) cannot do yet."""
        lora = self.lora
        if not (lora.enabled and lora.multi):
            return self
        if self.parallel.pp > 1:
            raise ValueError(f"parallel: several adapters (lora.adapter_names) are routed per token, which the "
                             f"pipeline stages (pp={self.parallel.pp}) do not carry yet; set parallel.pp=1 "
                             "(FSDP, DDP, TP and CP run)")
        for key in ("mode", "pairs"):
            if getattr(self, key, None) == "on_policy":
                raise ValueError(f"lora: several adapters with {key}='on_policy', which samples from the policy, is "
                                 "not supported (which adapter would sample?); train them offline, or one per node")
        sources = [os.path.abspath(s) for s in self.data.sources]
        for name, srcs in lora.adapter_sources.items():
            for src in srcs:
                if os.path.abspath(src) not in sources:
                    raise ValueError(f"lora: adapter_sources.{name}: {src!r} is not one of data.sources "
                                     f"{self.data.sources}")
        return self


class SFTConfig(TrainStageConfig):
    data: DataConfig = Field(DataConfig(format="sft"), description="Prompt/response or chat data.")


class TeacherConfig(ModelConfig):
    parallel: ParallelConfig | None = Field(
        None, description="The teacher's own layout over the job's ranks (e.g. {dp_shard: 8} to shard a big "
                          "teacher while the student replicates); None = the student's. Its tp and cp must be the "
                          "student's (the loss meets them on the same vocab slice and sequence chunks).")


class DistillConfig(TrainStageConfig):
    model: ModelConfig = Field(ModelConfig(), description="The student (the model being trained).")
    teacher: TeacherConfig = Field(TeacherConfig(), description="The frozen teacher; same vocabulary.")
    data: DataConfig = Field(DataConfig(format="sft"), description="Prompts (and responses).")
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = Field("forward_kl", description="Divergence minimized.")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of both; loss scaled by T^2.")
    jsd_beta: float = Field(0.5, ge=0, le=1, description="Generalized JSD weight (0 fwd KL, 1 rev KL).")
    mode: Literal["online", "on_policy", "offline"] = Field(
        "online", description="Teacher scores data live, scores student samples, or was precomputed.")
    on_policy_ratio: float = Field(0.5, ge=0, le=1, description="on_policy: share of student batches.")
    max_new_tokens: int = Field(64, gt=0, description="On-policy generation length.")
    top_k: int | None = Field(None, gt=0, description="Teacher's top-k logits only (offline: required).")
    teacher_cache: str | None = Field(
        None, description="Offline: where the teacher's top-k log-probs are kept, by teacher, k and data (reused "
                          "by later runs); None = <output_dir>/teacher_cache (a pipeline: <workspace>/.cache/teacher).")
    ce_weight: float = Field(0.0, ge=0, description="Weight of a hard-label cross-entropy term.")

    _teacher = field_validator("teacher", mode="before")(model_shorthand)

    @model_validator(mode="after")
    def _check_distill(self) -> DistillConfig:
        if self.mode == "offline" and self.top_k is None:
            raise ValueError("mode='offline' stores teacher logits per token; set top_k (e.g. 64)")
        return self

    def check_stage_layout(self) -> None:
        super().check_stage_layout()
        t = self.teacher.parallel
        if t is not None:
            for key in ("tp", "cp", "pp"):
                if getattr(t, key) != getattr(self.parallel, key):
                    raise ValueError(f"teacher.parallel.{key}: {getattr(t, key)}, but the student's parallel.{key} is "
                                     f"{getattr(self.parallel, key)}; the distillation loss meets teacher and student "
                                     "on the same vocab slices, sequence chunks and last pipeline stage, so they must "
                                     "be equal")
            if self.launcher is not None:
                try:
                    check_layout(t, self.launcher)
                except ValueError as e:
                    raise ValueError(f"teacher.{e}") from None

    def teacher_layout(self) -> ParallelConfig:
        """The teacher's layout: teacher.parallel, else the student's (without expert parallelism,
        which the teacher's own experts may not divide; offline the teacher scores whole documents
        before training, so without context parallelism)."""
        layout = self.teacher.parallel or self.parallel.model_copy(update={"ep": 1})
        if self.mode == "offline":
            layout = layout.model_copy(update={"cp": 1})
        return layout


class DPOConfig(TrainStageConfig):

    def pipeline_rows(self) -> int:
        return 2 * self.data.micro_batch_size  # a pair's chosen and rejected rows

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
        "offline", description="Pairs from the data, or the policy's samples for the data's prompts ranked by "
                              "`judge` or `reward` (best = chosen, worst = rejected).")
    num_samples: int = Field(4, ge=2, description="On-policy samples per prompt.")
    max_new_tokens: int = Field(64, gt=0, description="On-policy generation length.")
    gen_temperature: float = Field(1.0, gt=0, description="On-policy sampling temperature.")
    reward: str = Field(
        "exact_match", description="On-policy reward of a completion against the row's reference: 'exact_match', "
                                   "'normalized_match', or a verifier 'module:function(prompt, completion, row) -> float'.")
    reference_column: str = Field("answer", description="On-policy: the row field the reward compares against.")
    judge: ModelConfig | None = Field(
        None, description="On-policy: score completions by this model's mean log-likelihood instead of `reward`.")

    _judge = field_validator("judge", mode="before")(model_shorthand)

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


class SelectConfig(ConfigModel):
    metric: str = Field(
        "exact_match", description="Evaluation metric key the best model is chosen by: a metric (exact_match, "
                                   "pass@1, perplexity, ...) or a breakdown such as 'exact_match/task=add'.")
    mode: Literal["max", "min"] = Field("max", description="Higher or lower is better (perplexity, nll: min).")


EVAL_METRICS = ("exact_match", "normalized_match", "reward", "pass@k", "perplexity", "preference_accuracy",
                "win_rate")
"""What EvalConfig.metrics may name. `perplexity` also gives `nll`; `pass@k` gives `pass@<k>` for each
k of pass_k; `win_rate` gives `win_rate/<other model>`."""

LOWER_IS_BETTER = ("perplexity", "nll")


def metric_family(key: str) -> str:
    """The EVAL_METRICS entry that produces a metric key: 'pass@1/task=add' -> 'pass@k',
    'nll' -> 'perplexity', 'win_rate/sft' -> 'win_rate'."""
    base = key.split("/", 1)[0]
    if base.startswith("pass@"):
        return "pass@k"
    return "perplexity" if base == "nll" else base


class EvalConfig(StageConfig):
    models: list[str] = Field(
        ["debug"], min_length=1, description="Models evaluated side by side (in a pipeline: node names), first = "
                                             "the one win rates and deltas are measured for.")
    dtype: Dtype = Field("float32", description="Dtype the models are loaded in.")
    tokenizer: str | None = Field(None, description="Tokenizer dir; None = each model's (or data prep's).")
    kernels: Literal["auto", "torch"] = Field("auto", description="As model.kernels of training stages.")
    parallel: ParallelConfig = Field(
        ParallelConfig(), description="Device, backend and data-parallel ranks the examples are split over "
                                      "(each holds the whole model: tp, pp, cp and ep stay 1).")
    data: DataConfig = Field(DataConfig(), description="Evaluation data: data prep's output or the user's files.")
    split: Literal["validation", "test"] = Field(
        "test", description="Split of data prep's output evaluated (a user's file is evaluated whole).")
    metrics: list[Literal[EVAL_METRICS]] | None = Field(  # type: ignore[valid-type]
        None, description="Metrics computed; None = every one the data and settings allow. One the data cannot "
                          "give (no reference column, no pairs, no completions) is an error before models load.")
    reference_column: str = Field("answer", description="Row field generations are checked against.")
    verifier: str | None = Field(
        None, description="'exact_match', 'normalized_match' or 'module:function(prompt, completion, row) -> "
                          "float': metric `reward` (mean score); it also scores samples for pass@k and win rates.")
    pass_k: list[int] = Field([1], description="k of pass@k (unbiased estimator over num_samples samples).")
    judge: str | None = Field(
        None, description="Model judging win rates by its log-likelihood of each completion; None = the verifier "
                          "(or exact match).")
    group_by: str | None = Field("task", description="Row field metrics are also broken down by (if present).")
    select: SelectConfig | None = Field(
        None, description="Choose the best model by a metric; downstream nodes and the registry get it.")
    max_examples: int | None = Field(None, gt=0, description="At most this many examples; None = all.")
    max_new_tokens: int = Field(64, gt=0, description="Generation length.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    num_samples: int = Field(1, ge=1, description="Samples per prompt (pass@k).")
    batch_size: int = Field(16, gt=0, description="Prompts per generation batch per rank.")
    save_samples: bool = Field(True, description="Log generations as an artifact and an MLflow table.")

    _data = field_validator("data", mode="before")(data_shorthand)

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError("num_samples > 1 with temperature=0 repeats one greedy sample")
        if any(k < 1 for k in self.pass_k):
            raise ValueError(f"pass_k={self.pass_k}: every k must be >= 1")
        if max(self.pass_k, default=1) > self.num_samples:
            raise ValueError(f"pass_k={self.pass_k} needs num_samples >= {max(self.pass_k)}")
        p = self.parallel
        if p.pp > 1 and (p.dp_shard > 1 or p.cp > 1 or p.ep > 1):
            raise ValueError(f"parallel.pp: evaluation under pipeline parallelism (pp={p.pp}) splits each model "
                             "into stages (x tp) with data-parallel replicas; not with dp_shard, cp or ep sharding")
        self._check_metrics()
        if self.launcher is not None:
            check_layout(self.parallel, self.launcher)
        return self

    def _check_metrics(self) -> None:
        """Metric combinations that cannot work whatever the data (the data's own checks run in the
        stage, before any model loads)."""
        asked = set(self.metrics) if self.metrics is not None else None
        if asked is not None and not asked:
            raise ValueError("metrics: [] computes nothing; list metrics or leave it unset (all the data allows)")
        if self.verifier is not None:
            from core.rewards import BUILTIN

            if self.verifier not in BUILTIN and ":" not in self.verifier.strip(":"):
                raise ValueError(f"verifier={self.verifier!r}: give {' or '.join(BUILTIN)}, or 'module:function'")
        if asked is not None and "reward" in asked and self.verifier is None:
            raise ValueError("metrics: reward is the mean score of `verifier`; set verifier "
                             "('module:function' or a built-in)")
        if asked is not None and "win_rate" in asked and len(self.models) < 2:
            raise ValueError(f"metrics: win_rate compares models[0] with the others; models has {len(self.models)}")
        if self.judge is not None:
            if len(self.models) < 2:
                raise ValueError("judge decides win rates between models; evaluate at least 2 models")
            if asked is not None and "win_rate" not in asked:
                raise ValueError("judge only decides win_rate; add win_rate to metrics or unset judge")
        if self.select is not None:
            key = self.select.metric
            family = metric_family(key)
            base = key.split("/", 1)[0]
            if family == "win_rate":
                raise ValueError("select.metric: win rates are measured for models[0] against the others, so they "
                                 "cannot rank every model; select by another metric")
            known = {"exact_match", "normalized_match", "reward", "perplexity", "nll", "preference_accuracy",
                     *(f"pass@{k}" for k in self.pass_k)}
            if base not in known:
                raise ValueError(f"select.metric={key!r}: not a metric this evaluation computes "
                                 f"(one of {', '.join(sorted(known))}, optionally '/<group_by>=<value>')")
            if asked is not None and family not in asked:
                raise ValueError(f"select.metric={key!r} needs {family!r} in metrics")
            if family == "reward" and self.verifier is None:
                raise ValueError(f"select.metric={key!r} needs a verifier")
            if "/" in key:
                group = key.split("/", 1)[1].partition("=")[0]
                if self.group_by is None or group != self.group_by or "=" not in key:
                    raise ValueError(f"select.metric={key!r}: a breakdown key is '<metric>/{self.group_by}=<value>' "
                                     f"(group_by={self.group_by!r})")
            if base in LOWER_IS_BETTER and self.select.mode == "max":
                raise ValueError(f"select.metric={key!r} is lower-is-better; set select.mode: min")


STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    "data_prep": DataPrepConfig, "sft": SFTConfig, "distill": DistillConfig,
    "dpo": DPOConfig, "evaluate": EvalConfig}
"""Stage module name -> its config class (for `python -m stages.<name> --config spec.json`)."""

