"""Supervised fine-tuning: full or LoRA/QLoRA, packed padding-free batches, periodic validation
loss, resume from the stage's own checkpoints, HF/PEFT export and a manifest.

    torchrun --nproc-per-node 2 -m stages.sft --config spec.json
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from core.checkpoint import CheckpointManager
from core.config import SFTConfig
from core.loop import fit
from core.objectives import sft_objective
from core.reliability import Reliability
from stages.common import close_distributed, init_distributed, parse_spec, progress, stage_run
from stages.training import (DeviceLoader, build_policy, build_trainer, doc_loader, finish,
                             mean_loss, sft_documents, total_steps)

log = logging.getLogger("posttrain.sft")


def run(cfg: SFTConfig) -> dict:
    d = init_distributed(cfg.reliability.collective_timeout_s)
    out = Path(cfg.output_dir or "sft")
    model, tok, upstream, d = build_policy(cfg, d)  # d: now with the mesh
    train_docs = sft_documents(cfg.data.sources, "train", tok, cfg.data)
    val_docs = sft_documents(cfg.data.sources, "val", tok, cfg.data)
    train = DeviceLoader(doc_loader(train_docs, cfg.data, d, epochs=cfg.epochs), d.device)
    steps = total_steps(cfg, len(train))
    trainer = build_trainer(model, cfg, d, steps)
    manager = CheckpointManager.from_config(out / "checkpoints", cfg.checkpoint, trainable_only=cfg.lora.enabled,
                                            config=cfg.model_dump(mode="json"))

    def validate() -> dict[str, float]:
        if not val_docs:
            return {}
        val = DeviceLoader(doc_loader(val_docs, cfg.data, d, epochs=1, evaluation=True), d.device)
        return {"val/loss": mean_loss(model, val, sft_objective, d)}

    with stage_run(cfg, "sft", d.is_main) as run_:
        before = validate()
        run_.log_metrics({"val/loss_initial": before.get("val/loss", float("nan"))}, step=0)
        t0 = time.time()
        with progress(steps, "sft", d.is_main) as advance:
            last = fit(trainer, train, sft_objective, max_steps=steps, grad_accum=cfg.optim.grad_accum_steps,
                       manager=manager, resume=cfg.checkpoint.resume, log_every=cfg.tracking.log_every,
                       on_metrics=run_.log_metrics, evaluate=validate, eval_every=cfg.eval_interval,
                       advance=lambda n, **kw: advance(n, **kw),
                       reliability=Reliability.from_config(cfg.reliability, out / "watchdog"))
        manager.close()
        metrics = {"train/loss": last.get("loss"), "val/loss": last.get("val/loss"),
                   "val/loss_initial": before.get("val/loss"), "steps": trainer.step,
                   "train/seconds": time.time() - t0}
        manifest = finish("sft", model, tok, cfg, out, d, run_, metrics,
                          inputs={"model": (upstream or {}).get("digest", cfg.model.name_or_path)},
                          step=trainer.step)
    close_distributed()
    return manifest or {}


def main(argv: list[str] | None = None) -> None:
    run(parse_spec(SFTConfig, argv))


if __name__ == "__main__":
    main()
