"""The training loop every training stage shares, built on the Trainer primitives:
resume, accumulate, step, log, validate, checkpoint (with the data position), stop.

Faults (posttrain.core.reliability): a non-finite or spiking step is skipped; after `max_bad_steps` of them
in a row the loop rolls back to the last checkpoint while the data position moves on past the bad
batches; a preemption signal ends the loop at the next step boundary with a final checkpoint
(`Preempted`, exit code 75); the watchdog sees every micro-step. Each event goes to `on_metrics`
as an `events/*` key at the step being attempted.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

from posttrain.core.monitor import ThroughputMeter, batch_tokens
from posttrain.core.reliability import Preempted, Reliability, TrainingDiverged
from posttrain.core.trainer import Objective, Trainer

log = logging.getLogger("posttrain.loop")


def fit(
    trainer: Trainer,
    loader: Any,
    objective: Objective,
    *,
    max_steps: int,
    grad_accum: int = 1,
    manager: Any = None,
    resume: bool = True,
    on_metrics: Callable[[dict[str, float], int], None] | None = None,
    log_every: int = 10,
    evaluate: Callable[[], dict[str, float]] | None = None,
    eval_every: int = 0,
    advance: Callable[..., None] | None = None,
    before_step: Callable[[int], None] | None = None,
    reliability: Reliability | None = None,
    meter: ThroughputMeter | None = None,
) -> dict[str, float]:
    """Train until `max_steps` optimizer steps or the loader is exhausted; returns the metrics of
    the last applied step (plus the last evaluation). `loader` is a StatefulLoader: its position
    is saved with every checkpoint, so a resumed run sees exactly the batches it had not yet seen.
    `reliability` defaults to spike screening and rollback with ReliabilityConfig's defaults, no
    signal handler and no watchdog (a stage passes Reliability.from_config). `meter` times the
    step's phases (data, forward_backward, optim_step, evaluate, checkpoint) and counts tokens;
    its window report joins the metrics at every logged step."""
    rel = reliability if reliability is not None else Reliability()
    phase = meter.phase if meter is not None else (lambda name: contextlib.nullcontext())

    def emit(events: dict[str, float], step: int) -> None:
        if events and on_metrics is not None:
            on_metrics(events, step)

    def checkpoint_extra() -> dict[str, Any]:
        return {"data": loader.state_dict(), "reliability": rel.state_dict()}

    if manager is not None and resume:
        extra = trainer.load_state(manager)
        report = getattr(manager, "last_report", None)
        if report is not None and report.skipped:
            log.warning("skipped unusable checkpoints: %s", "; ".join(f"step {s}: {why}" for s, why in report.skipped))
            emit({"events/checkpoint_skipped": float(len(report.skipped)),
                  "events/checkpoint_skipped_step": float(max(s for s, _ in report.skipped))}, trainer.step)
        if extra is not None:
            loader.load_state_dict(extra["data"])
            rel.load_state_dict(extra.get("reliability"))
            log.info("resumed from step %d", trainer.step)
            emit({"events/resumed_from_step": float(trainer.step)}, trainer.step)
    if advance is not None and trainer.step:
        advance(trainer.step)
    batches: Iterator = iter(loader)
    last: dict[str, float] = {}
    done = trainer.step >= max_steps
    rel.start()
    try:
        while not done:
            attempt = trainer.step + 1
            rel.beat(attempt, "data")
            if before_step is not None:
                before_step(trainer.step)
            n = 0
            while n < grad_accum:
                with phase("data"):
                    batch = next(batches, None)
                if batch is None:
                    break
                rel.beat(phase="forward_backward")
                with phase("forward_backward"):
                    trainer.forward_backward(batch, objective)
                if meter is not None:
                    meter.add_tokens(batch_tokens(batch))
                n += 1
            if n == 0:
                break  # data exhausted on a step boundary
            rel.beat(phase="optim_step")
            with phase("optim_step"):
                metrics = trainer.optim_step(skip_if=rel.skip_if)
            skipped = bool(metrics["skipped"])
            emit(rel.after_step(metrics, attempt), attempt)
            if skipped and rel.needs_rollback():
                emit(_rollback(trainer, manager, rel, attempt), attempt)
                if advance is not None:
                    advance(trainer.step - (attempt - 1))  # back to the checkpoint's step
            step = trainer.step
            done = step >= max_steps or n < grad_accum
            if not skipped:
                last = metrics
            if evaluate is not None and ((not skipped and eval_every and step % eval_every == 0) or done):
                rel.beat(phase="evaluate")
                with phase("evaluate"):
                    last = {**last, **evaluate()}
            if on_metrics is not None and (done or (not skipped and (step % log_every == 0 or "val/loss" in last))):
                on_metrics({**last, **(meter.report() if meter is not None else {})}, step)
            if advance is not None and not skipped:
                advance(1, loss=last["loss"])
            if manager is not None and (done or not skipped):
                rel.beat(phase="checkpoint")
                with phase("checkpoint"):
                    if done:
                        trainer.save_state(manager, checkpoint_extra())
                    else:
                        manager.maybe_save(step, trainer.model, trainer.optimizer, trainer.scheduler,
                                           extra={"trainer": trainer.state_dict(), **checkpoint_extra()})
            if not done and rel.stop_requested(trainer.device):
                _preempted(trainer, manager, checkpoint_extra())
        if manager is not None:
            rel.beat(phase="checkpoint")
            manager.wait()
    finally:
        rel.stop()
    return last


def _rollback(trainer: Trainer, manager: Any, rel: Reliability, attempt: int) -> dict[str, float]:
    """Load the last good checkpoint (model, optimizer, schedule, RNG, counters, spike window) but
    not its data position: the loader stays past the batches that went bad."""
    rel.check_rollback_allowed(attempt, manager is not None)
    from_step = trainer.step
    extra = trainer.load_state(manager)
    if extra is None:
        raise TrainingDiverged(f"{rel.bad_steps} bad steps in a row at step {attempt} and no checkpoint to roll back to")
    return rel.rolled_back(extra.get("reliability"), from_step, trainer.step)


def _preempted(trainer: Trainer, manager: Any, extra: dict[str, Any]) -> None:
    """Write the final checkpoint (unless this step is saved already) and raise Preempted."""
    path = None
    if manager is not None:
        trainer.save_state(manager, extra, force=False)
        manager.wait()
        latest = manager.latest_step()
        path = str(manager.dir / f"step-{latest:06d}") if latest is not None else None
        if latest != trainer.step:
            log.error("preempted at step %d but its checkpoint failed; latest is step %s", trainer.step, latest)
    e = Preempted(trainer.step, path)
    log.warning("%s", e)
    raise e
