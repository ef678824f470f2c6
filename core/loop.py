"""The training loop every training stage shares, built on the Trainer primitives:
resume, accumulate, step, log, validate, checkpoint (with the data position), stop."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from core.trainer import Objective, Trainer

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
) -> dict[str, float]:
    """Train until `max_steps` optimizer steps or the loader is exhausted; returns the metrics of
    the last step (plus the last evaluation). `loader` is a StatefulLoader: its position is saved
    with every checkpoint, so a resumed run sees exactly the batches it had not yet seen."""
    if manager is not None and resume:
        extra = trainer.load_state(manager)
        if extra is not None:
            loader.load_state_dict(extra["data"])
            log.info("resumed from step %d", trainer.step)
    if advance is not None and trainer.step:
        advance(trainer.step)
    batches: Iterable = iter(loader)
    last: dict[str, float] = {}
    done = trainer.step >= max_steps
    while not done:
        if before_step is not None:
            before_step(trainer.step)
        n = 0
        for batch in batches:
            trainer.forward_backward(batch, objective)
            n += 1
            if n == grad_accum:
                break
        if n == 0:
            break  # data exhausted on a step boundary
        last = trainer.optim_step()
        step = trainer.step
        done = step >= max_steps or n < grad_accum
        if evaluate is not None and ((eval_every and step % eval_every == 0) or done):
            last.update(evaluate())
        if on_metrics is not None and (step % log_every == 0 or done or "val/loss" in last):
            on_metrics(last, step)
        if advance is not None:
            advance(1, loss=last["loss"])
        if manager is not None:
            extra = {"data": loader.state_dict()}
            if done:
                trainer.save_state(manager, extra)
            else:
                manager.maybe_save(step, trainer.model, trainer.optimizer, trainer.scheduler,
                                   extra={"trainer": trainer.state_dict(), **extra})
    if manager is not None:
        manager.wait()
    return last
