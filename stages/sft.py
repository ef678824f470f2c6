"""Supervised fine-tuning: full or LoRA/QLoRA, on packed (or padded) batches, with periodic
validation loss; under every layout of posttrain.core.parallel, pipeline parallelism included (the
schedule then runs each micro-batch: posttrain.core.pipeline_objectives.pipelined_sft). The skeleton
(stages/recipe.py) does the rest: resume from the stage's own checkpoints, throughput, HF/PEFT
export and the manifest.

    torchrun --nproc-per-node 2 -m posttrain.stages.sft --config spec.json
"""

from __future__ import annotations

from posttrain.stages.config import SFTConfig
from posttrain.core.objectives import sft_objective
from posttrain.core.pipeline_objectives import pipelined_sft
from posttrain.stages.adapters import adapter_routing, per_adapter_loss, routed, trained_adapters
from posttrain.stages.common import parse_spec
from posttrain.stages.recipe import Plan, Session, run_training
from posttrain.stages.training import DeviceLoader, doc_loader, mean_loss, pipeline_of, sft_documents


class SFT:
    name = "sft"

    def setup(self, s: Session) -> Plan:
        cfg, d = s.cfg, s.dist
        routing, names = adapter_routing(cfg.lora), trained_adapters(cfg)
        train_docs = sft_documents(cfg.data.sources, "train", s.tok, cfg.data, routing)
        val_docs = sft_documents(cfg.data.sources, "validation", s.tok, cfg.data, routing)
        objective = sft_objective
        pipe = pipeline_of(d)
        if pipe is not None:  # the schedule runs forward and backward over its microbatches
            objective = pipelined_sft(pipe, cfg.pipeline_rows(), cfg.data.max_seq_len, d.mesh.group("pp"))
        if names:  # each document through its adapter
            objective = routed(objective, names)

        def val_loss(docs) -> float:
            val = DeviceLoader(doc_loader(docs, cfg.data, d, epochs=1, evaluation=True), d.device)
            return mean_loss(s.model, val, objective, d)

        def validate() -> dict[str, float]:
            if not val_docs:
                return {}
            if names:  # val/loss/<adapter> too
                return per_adapter_loss(val_docs, names, val_loss, "val/loss")
            return {"val/loss": val_loss(val_docs)}

        train = DeviceLoader(doc_loader(train_docs, cfg.data, d, epochs=cfg.epochs), d.device)
        return Plan(train, objective, validate)


def run(cfg: SFTConfig) -> dict:
    return run_training(SFT(), cfg)


def main(argv: list[str] | None = None) -> None:
    run(parse_spec(SFTConfig, argv))


if __name__ == "__main__":
    main()
