"""Each stage's config, and the stage names a pipeline wires them by.

A stage's spec is self-contained: model, data, layout and loop, plus its own launcher and tracking
when it is run alone (`launcher: None` = the pipeline's). Building blocks come from their owners:
ModelConfig (posttrain.core.model.config), LoRAConfig (posttrain.core.lora.config), ParallelConfig
(posttrain.core.parallel.config), OptimConfig (posttrain.core.optim), DataConfig (posttrain.core.data.config),
CheckpointConfig (posttrain.core.checkpoint.config), ReliabilityConfig (posttrain.core.reliability.config),
TrackingConfig (posttrain.core.tracking), LauncherConfig (posttrain.stages.launch.config).

Why this file is long: it is the one schema every entry point reads (the CLI, the pipeline's
nodes, the Prefect run form's JSON schema, the docs' field tables): each stage kind's fields and
the cross-field checks the kinds share (pipeline and engine layouts) side by side, declarative
code that reads top to bottom; split by kind, the shared checks would have to move out and every
kind import them back."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from posttrain.core.checkpoint.config import CheckpointConfig
from posttrain.core.config import ConfigModel, Dtype
from posttrain.core.data.config import DataConfig
from posttrain.core.lora.config import LoRAConfig
from posttrain.core.model.config import ModelConfig
from posttrain.core.optim import OptimConfig
from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.precision import PrecisionConfig, check_precision
from posttrain.core.qat import QATConfig, check_qat
from posttrain.core.preference_types import (F_DIVERGENCE_LOSSES, REFERENCE_FREE_LOSSES, SMOOTHED_LOSSES, SORTING_LOSSES)
from posttrain.core.reliability.config import ReliabilityConfig
from posttrain.core.tracking import TrackingConfig
from posttrain.stages.launch.config import LauncherConfig


KINDS = ("data_prep", "sft", "distill", "dpo", "grpo", "evaluate")
"""The stage kinds; kind `k` runs as `python -m posttrain.stages.<k>` (a pipeline node names its kind)."""


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
    tokenizer: str | None = Field(None, description="HF tokenizer or model dir, .gguf file or packaged model "
                                                    "(smollm2-135m-instruct); None = train a small BPE one.")
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


Sampler = Literal["static", "engine"]
SAMPLER = Field("static", description="Who samples: 'static' (posttrain.core.model.generate: a left-padded batch, any layout) "
                "or 'engine' (posttrain.core.generation: paged KV cache, continuous batching, the n samples of a prompt "
                "sharing its blocks; the model whole on each rank or split by tp; see docs/generation.md).")


def check_engine_layout(sampler: str, p: ParallelConfig) -> None:
    """sampler: engine runs the model whole on each rank or split by tensor parallelism:
    ValueError naming the key for a layout that pipelines or shards it (what is known before
    launch; FSDP by world size is found at run time)."""
    if sampler != "engine":
        return
    split = {k: getattr(p, k) for k in ("pp", "cp", "ep", "dp_shard") if getattr(p, k) > 1}
    if split:
        raise ValueError(f"sampler: 'engine' needs the model whole on each rank or split by tp, but parallel sets "
                         f"{', '.join(f'{k}={v}' for k, v in split.items())}; use sampler: static")


class TrainStageConfig(StageConfig):
    """What SFT, distillation and DPO share: the model being trained and the loop around it."""

    model: ModelConfig = Field(ModelConfig(), description="The model being trained (in a pipeline: a node name).")
    lora: LoRAConfig = Field(LoRAConfig(), description="Adapters; disabled = full fine-tuning.")
    parallel: ParallelConfig = Field(ParallelConfig(), description="Mesh and parallelism.")
    optim: OptimConfig = Field(OptimConfig(), description="Optimizer and LR schedule.")
    precision: PrecisionConfig = Field(
        PrecisionConfig(), description="'full' (model.dtype throughout), or mixed: 'bf16', 'fp16' (loss-scaled), "
        "'fp8' (torchao float8 linears), each with float32 master weights (core/precision.py).")
    qat: QATConfig = Field(
        QATConfig(), description="Quantization-aware training: fake-quantized int4/int8 weights (and int8 inputs) "
        "while training, the quantized model exported beside the float one (core/qat.py).")
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
        check_precision(self.precision, lora=self.lora.enabled, tp=self.parallel.tp, pp=self.parallel.pp,
                        fsdp_param_dtype=self.parallel.mixed_precision_param)
        lora = self.lora
        check_qat(self.qat, precision=self.precision.mode, multi_adapter=lora.enabled and lora.multi,
                  dora=lora.enabled and lora.use_dora, quantize_base=lora.enabled and bool(lora.quantize_base),
                  tp=self.parallel.tp)
        self.check_stage_layout()
        return self

    def check_stage_layout(self) -> None:
        """ValueError naming the key when this stage cannot run under cfg.parallel (the layouts
        posttrain.core.parallel itself cannot take are checked against the world and the model)."""
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
        split = 2 * p.cp * (p.tp if p.sequence_parallel else 1)
        if p.cp > 1 and data.max_seq_len % split:
            raise ValueError(f"data.max_seq_len: {data.max_seq_len} tokens per row do not split into the 2 x cp "
                             f"load-balanced chunks{' x tp' if p.tp > 1 and p.sequence_parallel else ''} "
                             f"(cp={p.cp} under pipeline parallelism); make it a multiple of {split}")
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


class GenerationConfig(ConfigModel):
    """Where a stage's policy samples (core/generation/remote.py, docs/generation.md): in the
    trainer's own processes (colocated), or in generator worker processes the trainer's lead rank
    spawns on its host and syncs versioned weights to (disaggregated)."""

    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="'colocated': the trainer's ranks switch to sampling (with `sampler`); "
                                 "'disaggregated': generator workers run the paged-KV engine beside the trainer.")
    workers: int = Field(1, ge=1, le=64, description="Disaggregated: generator worker processes.")
    device: str = Field("cpu", description="Disaggregated: the workers' device ('cpu', 'cuda:1', ...); "
                                           "'cuda' = the first GPU after the trainer's local ranks, for every worker.")
    threads: int = Field(0, ge=0, description="Disaggregated: torch threads per worker; 0 = torch's default.")
    sync: Literal["auto", "full", "lora"] = Field(
        "auto", description="What a weight sync moves: 'lora' the adapters only (the workers load the same base), "
                            "'full' every weight; 'auto' = lora when adapters are trained, else full.")
    prefetch: Literal[0, 1] = Field(
        0, description="Disaggregated: 0 = strictly on-policy (a round is sampled with the weights it trains); "
                       "1 = round k+1 is sampled while round k trains, with weights one round older.")
    max_staleness: int = Field(1, ge=0, description="Rounds a sample's weights may lag the trainer's at full weight.")
    stale: Literal["drop", "reweight"] = Field(
        "drop", description="A sample older than max_staleness: dropped, or its advantage scaled by "
                            "stale_decay ** (lag - max_staleness).")
    stale_decay: float = Field(0.5, gt=0, le=1, description="stale: reweight's factor per round beyond the bound.")
    timeout_s: float = Field(300.0, gt=0, description="Disaggregated: a worker with no answer this long is "
                                                      "restarted (the trainer never waits longer per try).")
    max_restarts: int = Field(2, ge=0, description="Disaggregated: restarts per worker before the stage fails.")

    @model_validator(mode="after")
    def _check_generation(self) -> GenerationConfig:
        if self.prefetch > self.max_staleness and self.stale == "drop":
            raise ValueError(f"generation.prefetch: {self.prefetch} makes every sample {self.prefetch} round(s) old, "
                             f"beyond max_staleness {self.max_staleness} with stale 'drop' (every sample dropped); "
                             "raise max_staleness or set stale: reweight")
        if self.mode == "colocated" and self.prefetch:
            raise ValueError("generation.prefetch: overlapping sampling with training needs mode: disaggregated")
        return self

def check_generation(cfg, samples: bool, what: str) -> None:
    """generation: disaggregated where a stage that samples once per step or once in all (on-policy
    DPO, on-policy distillation) can use it: something to sample, one adapter, no pipeline."""
    g = cfg.generation
    if g.mode != "disaggregated":
        return
    if not samples:
        raise ValueError(f"generation.mode: 'disaggregated' starts generator workers, but this stage samples "
                         f"nothing ({what}); leave generation out")
    if g.prefetch:
        raise ValueError("generation.prefetch: 1 overlaps sampling of the next round with training (GRPO); this "
                         "stage samples with the weights it trains next, so prefetch must be 0")
    if cfg.lora.enabled and cfg.lora.multi:
        raise ValueError("generation.mode: 'disaggregated' with several adapters (lora.multi) is not supported: "
                         "the workers sample with one policy")
    if cfg.parallel.pp > 1:
        raise ValueError(f"generation.mode: 'disaggregated' under parallel.pp={cfg.parallel.pp} is not supported "
                         "(the weight sync gathers a policy held whole or sharded by FSDP/TP, not split in "
                         "pipeline stages); use mode: colocated")


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
    sampler: Sampler = SAMPLER
    generation: GenerationConfig = Field(GenerationConfig(), description="Colocated or disaggregated sampling "
                                                                         "(on-policy only; prefetch 0).")
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
        if self.mode == "on_policy" and self.generation.mode == "colocated":  # workers: any layout
            check_engine_layout(self.sampler, self.parallel)
        check_generation(self, self.mode == "on_policy" and self.on_policy_ratio > 0, f"mode: {self.mode}")
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
        which the teacher's own experts may not divide). Offline, it scores whole documents before
        training as an ordinary model (posttrain.stages.distill.score_teacher), and the held-out KL runs
        it on the student's context-parallel shards."""
        return self.teacher.parallel or self.parallel.model_copy(update={"ep": 1})



PreferenceLoss = Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
                         "aot", "aot_pair", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft",
                         "orpo", "kto"]


class DPOConfig(TrainStageConfig):

    def pipeline_rows(self) -> int:
        return 2 * self.data.micro_batch_size  # a pair's chosen and rejected rows

    lora: LoRAConfig = Field(LoRAConfig(enabled=True), description="Adapters; the base is the reference.")
    optim: OptimConfig = Field(OptimConfig(lr=5e-5), description="Optimizer; DPO wants a small lr.")
    data: DataConfig = Field(DataConfig(format="preference"), description="Pairs, or prompts (on_policy).")
    beta: float = Field(0.1, gt=0, description="Strength of the implicit KL to the reference (ORPO: its lambda, "
                                             "the odds-ratio weight, as in TRL).")
    loss_type: PreferenceLoss | list[PreferenceLoss] = Field(
        "sigmoid", description="The preference loss (docs/preference_losses.md): DPO (sigmoid), IPO, SLiC hinge, "
                               "robust DPO, SimPO, EXO, NCA, BCO, SPPO, AOT, APO, DiscoPOP, sigmoid_norm, sft, "
                               "ORPO, KTO (chosen desirable, rejected undesirable); a list is a weighted sum "
                               "(`loss_weights`).")
    loss_weights: list[float] | None = Field(
        None, description="Weights of a list of loss types, one each (default: 1 each).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Assumed label-flip rate (cDPO/rDPO/AOT, SimPO); "
                                                                "EXO's epsilon (> 0 for exo_pair).")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO target reward margin.")
    sft_weight: float = Field(0.0, ge=0, description="Weight of an NLL term on chosen responses (RPO).")
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = Field(
        "reverse_kl", description="f-DPO: the divergence to the reference (reverse KL is DPO); only for loss types "
                                  "built on the chosen-minus-rejected score.")
    f_alpha_divergence_coef: float = Field(0.5, ge=0, description="alpha of f_divergence_type='alpha_divergence'.")
    discopop_tau: float = Field(0.05, gt=0, description="DiscoPOP temperature of the log-ratio modulation.")
    ld_alpha: float | None = Field(
        None, ge=0, le=1, description="LD-DPO: weight of the tokens past the shorter response's length "
                                      "(1 = plain DPO, 0 = ignore them); none = off.")
    use_weighting: bool = Field(False, description="WPO: weigh each pair by the policy's own (detached) "
                                                   "length-normalized probability of its two responses.")
    kto_desirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the desirable (chosen) responses "
                                                               "(TRL's desirable_weight, accepted too).")
    kto_undesirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the undesirable (rejected) ones "
                                                                 "(TRL's undesirable_weight).")
    kto_kl_estimate: Literal["batch", "mismatched"] = Field(
        "batch", description="KTO's reference point: from the micro-batch's own responses ('batch'), or, as TRL, "
                             "from mismatched pairs (each prompt with the previous pair's responses: 'mismatched', "
                             "two extra no-grad forwards; needs a live reference and micro_batch_size >= 2).")
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
    sampler: Sampler = SAMPLER
    generation: GenerationConfig = Field(GenerationConfig(), description="Colocated or disaggregated sampling "
                                                                         "(on-policy only; prefetch 0).")
    reward: str = Field(
        "exact_match", description="On-policy reward of a completion against the row's reference: 'exact_match', "
                                   "'normalized_match', 'unit_tests' (HumanEval's layout, run in the "
                                   "sandbox), or a verifier 'module:function(prompt, completion, row) -> float'.")
    reference_column: str = Field("answer", description="On-policy: the row field the reward compares against.")
    allow_unsafe_exec: bool = Field(
        False, description="unit_tests: where generated code cannot be isolated (not root), run it anyway with "
                           "resource limits only (no network or file isolation).")
    judge: ModelConfig | None = Field(
        None, description="On-policy: score completions by this model's mean log-likelihood instead of `reward`.")

    _judge = field_validator("judge", mode="before")(model_shorthand)

    @model_validator(mode="before")
    @classmethod
    def _trl_kto_names(cls, data: Any) -> Any:
        """TRL's KTOConfig names, desirable_weight and undesirable_weight, for kto_desirable_weight
        and kto_undesirable_weight."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for trl_name in ("desirable_weight", "undesirable_weight"):
            if trl_name in data:
                ours = f"kto_{trl_name}"
                if ours in data and data[ours] != data[trl_name]:
                    raise ValueError(f"{trl_name} (TRL's name) and {ours} are the same knob; set one")
                data[ours] = data.pop(trl_name)
        return data

    @model_validator(mode="after")
    def _check_dpo(self) -> DPOConfig:
        if self.pairs == "on_policy" and self.generation.mode == "colocated":  # workers: any layout
            check_engine_layout(self.sampler, self.parallel)
        check_generation(self, self.pairs == "on_policy", f"pairs: {self.pairs}")
        if not self.reference_free and self.reference == "disable_adapter":
            if not self.lora.enabled:
                raise ValueError("reference='disable_adapter' needs lora.enabled=true; "
                                 "use reference='precomputed' for full fine-tuning")
            if self.lora.init_lora_weights == "pissa":
                raise ValueError("reference='disable_adapter' with PiSSA init is not the original model")
        types = self.loss_types
        if self.label_smoothing and not set(types) & set(SMOOTHED_LOSSES):
            raise ValueError(f"label_smoothing applies to loss_type {'/'.join(SMOOTHED_LOSSES)}, "
                             f"not {self.loss_type!r}")
        if self.label_smoothing and set(types) & {"ipo", "hinge"}:
            raise ValueError(f"label_smoothing must be 0 with loss_type ipo or hinge, got {self.loss_type!r}")
        if "exo_pair" in types and not self.label_smoothing:
            raise ValueError("loss_type exo_pair needs label_smoothing > 0 (EXO's epsilon, e.g. 1e-3)")
        if not types:
            raise ValueError("loss_type: name at least one loss")
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            raise ValueError(f"loss_weights has {len(self.loss_weights)} weights for {len(types)} loss_type entries")
        if self.f_divergence_type != "reverse_kl" and not set(types) <= set(F_DIVERGENCE_LOSSES):
            raise ValueError(f"f_divergence_type={self.f_divergence_type!r} applies only to loss_type "
                             f"{', '.join(F_DIVERGENCE_LOSSES)}; got {self.loss_type!r}")
        if self.use_weighting and set(types) & set(SORTING_LOSSES):
            raise ValueError("use_weighting (WPO) cannot apply to the aot losses: they sort the pairs")
        p = self.parallel
        if self.kto_kl_estimate == "mismatched":
            if "kto" not in types:
                raise ValueError("kto_kl_estimate='mismatched' applies to loss_type kto")
            if self.reference == "precomputed":
                raise ValueError("kto_kl_estimate='mismatched' needs a live reference (reference 'disable_adapter' "
                                 "or 'model'): the mismatched pairs change with every batch")
            if self.data.micro_batch_size < 2:
                raise ValueError("kto_kl_estimate='mismatched' needs data.micro_batch_size >= 2")
        if self.kto_kl_estimate == "mismatched" and p.pp > 1:
            raise ValueError("kto_kl_estimate='mismatched' is not wired under parallel.pp > 1: use 'batch'")
        if self.ld_alpha is not None and (p.pp > 1 or p.cp > 1):
            raise ValueError("ld_alpha needs whole sequences' per-token log-probs: not under parallel.pp > 1 or "
                             "parallel.cp > 1")
        if self.use_weighting and (p.pp > 1 or p.cp > 1 or p.tp > 1):
            raise ValueError("use_weighting (WPO) needs the whole vocabulary per token: not under parallel.tp, "
                             "pp or cp > 1")
        return self

    @property
    def loss_types(self) -> tuple[str, ...]:
        return (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)

    @property
    def reference_free(self) -> bool:
        """Whether every loss type does without reference log-probs (simpo, orpo, sft)."""
        return set(self.loss_types) <= set(REFERENCE_FREE_LOSSES)

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of posttrain.core.preference.dpo_loss beyond beta and the log-probs."""
        return {"loss_type": self.loss_types, "label_smoothing": self.label_smoothing,
                "simpo_gamma": self.simpo_gamma, "sft_weight": self.sft_weight, "loss_weights": self.loss_weights,
                "f_divergence_type": self.f_divergence_type, "f_alpha_divergence_coef": self.f_alpha_divergence_coef,
                "discopop_tau": self.discopop_tau, "desirable_weight": self.kto_desirable_weight,
                "undesirable_weight": self.kto_undesirable_weight}


class GRPOConfig(TrainStageConfig):
    """GRPO (stages/grpo.py): groups of the policy's own samples per prompt, rewarded by a verifier
    or judge as on-policy DPO's, trained with the clipped group-relative policy gradient
    (core/grpo.py). Names and defaults follow TRL's GRPOTrainer where they overlap."""

    lora: LoRAConfig = Field(LoRAConfig(enabled=True), description="Adapters; the base is the KL reference.")
    optim: OptimConfig = Field(OptimConfig(lr=1e-5), description="Optimizer; policy gradients want a small lr.")
    data: DataConfig = Field(DataConfig(format="sft"), description="Prompts (with the reward's reference column).")
    reliability: ReliabilityConfig = Field(
        ReliabilityConfig(spike_zscore=0.0), description="Bad steps, hangs, preemption; the loss-spike screen is "
                                                         "off (a policy-gradient loss sits near 0, not on a curve).")
    num_generations: int = Field(8, ge=2, le=1024, description="Completions sampled per prompt (the group, G).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per sampling round, over all ranks; each optimizer "
                                                      "step trains on the round's prompts x num_generations.")
    max_new_tokens: int = Field(64, gt=0, description="Completion length limit (also dr_grpo's constant).")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature (GRPO needs varied samples).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Sample from the k most likely tokens; 0 = all.")
    reward: str = Field(
        "exact_match", description="Reward of a completion against the row's reference: 'exact_match', "
                                   "'normalized_match', 'unit_tests' (HumanEval's layout, run in the "
                                   "sandbox), or a verifier 'module:function(prompt, completion, row) -> float'.")
    reference_column: str = Field("answer", description="The row field the reward compares against.")
    allow_unsafe_exec: bool = Field(
        False, description="unit_tests: where generated code cannot be isolated (not root), run it anyway with "
                           "resource limits only (no network or file isolation).")
    judge: ModelConfig | None = Field(
        None, description="Score completions by this model's mean log-likelihood instead of `reward`.")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Lower clip range of the policy ratio (1 - epsilon).")
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clip range (1 + epsilon_high); None = epsilon. DAPO's clip-higher: 0.28.")
    beta: float = Field(0.0, ge=0, description="Weight of the per-token KL to the reference (k3 estimator); 0 = none.")
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = Field(
        "dapo", description="Token averaging: per-completion then per-group mean (grpo), token mean over the step "
                            "(bnpo, dapo), or token sum over completions x max_new_tokens (dr_grpo).")
    scale_rewards: bool = Field(True, description="Divide advantages by the group's reward std; false = Dr. GRPO.")
    num_iterations: int = Field(1, ge=1, le=64, description="Optimizer steps per sampling round (mu): the ratio "
                                                           "to the sampling-time policy and its clip act from step 2.")
    val_prompts: int = Field(64, ge=0, description="Validation prompts scored (greedy) for val/reward; 0 = none.")
    sampler: Sampler = SAMPLER
    generation: GenerationConfig = Field(GenerationConfig(), description="Colocated or disaggregated sampling "
                                                                         "of the training rounds.")

    _judge = field_validator("judge", mode="before")(model_shorthand)

    @property
    def num_samples(self) -> int:
        """The group size under on-policy DPO's name (posttrain.stages.on_policy.Reward reads it)."""
        return self.num_generations

    @model_validator(mode="after")
    def _check_grpo(self) -> GRPOConfig:
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ValueError(f"epsilon_high: {self.epsilon_high} is below epsilon ({self.epsilon}); clip-higher "
                             "widens the upper range only (leave it unset for a symmetric clip)")
        if self.lora.enabled and self.lora.multi:
            raise ValueError("lora: several adapters in a GRPO stage, which samples from the policy, is not "
                             "supported (which adapter would sample?); train one per node")
        if (self.prompts_per_step * self.num_generations) % self.optim.grad_accum_steps:
            raise ValueError(f"optim.grad_accum_steps: {self.prompts_per_step} prompts x {self.num_generations} "
                             f"generations do not split into {self.optim.grad_accum_steps} micro-batches")
        return self

    def check_stage_layout(self) -> None:
        p = self.parallel
        for key in ("pp", "cp"):
            if getattr(p, key) > 1:
                raise ValueError(f"parallel.{key}: GRPO under {key}={getattr(p, key)} does not run yet; use FSDP, "
                                 "DDP or TP")
        super().check_stage_layout()


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
        None, description="'exact_match', 'normalized_match', 'unit_tests' (HumanEval's layout, run in the sandbox) "
                          "or 'module:function(prompt, completion, row) -> float': metric `reward` (mean score); it "
                          "also scores samples for pass@k and win rates.")
    pass_k: list[int] = Field([1], description="k of pass@k (unbiased estimator over num_samples samples).")
    allow_unsafe_exec: bool = Field(
        False, description="unit_tests: where generated code cannot be isolated (not root), run it anyway with "
                           "resource limits only (no network or file isolation).")
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
    sampler: Sampler = SAMPLER
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
        if p.pp > 1 and p.ep > 1:
            raise ValueError(f"parallel.ep: evaluation under pipeline parallelism (pp={p.pp}) splits each model "
                             "into stages (x tp, x dp_shard / cp sharding); not with expert parallelism")
        check_engine_layout(self.sampler, p)
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
            from posttrain.core.rewards import VERIFIERS

            if self.verifier not in VERIFIERS and ":" not in self.verifier.strip(":"):
                raise ValueError(f"verifier={self.verifier!r}: give {' or '.join(VERIFIERS)}, or 'module:function'")
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
    "dpo": DPOConfig, "grpo": GRPOConfig, "evaluate": EvalConfig}
"""Stage module name -> its config class (for `python -m posttrain.stages.<name> --config spec.json`)."""

