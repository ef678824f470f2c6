"""The fault policy fit applies: spike screening, skip accounting, rollback decisions, and the
session of the preemption handler and the watchdog. Its counters and spike window are checkpointed."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from posttrain.core.reliability.preemption import Preemption
from posttrain.core.reliability.recorder import RECORDER
from posttrain.core.reliability.spikes import SpikeDetector
from posttrain.core.reliability.watchdog import Watchdog

log = logging.getLogger("posttrain.reliability")


class TrainingDiverged(RuntimeError):
    """Bad steps persist and no rollback can help; the message says how many and why."""


class Reliability:
    """The fault policy `posttrain.core.loop.fit` applies: spike screening, skip accounting and rollback
    decisions, preemption and the watchdog. Its counters and the spike window are checkpointed."""

    def __init__(self, *, spike_zscore: float = 6.0, spike_window: int = 100, max_bad_steps: int = 5,
                 max_rollbacks: int = 3, preemption: Preemption | None = None, watchdog: Watchdog | None = None):
        self.spike = SpikeDetector(spike_zscore, spike_window) if spike_zscore > 0 else None
        self.max_bad_steps, self.max_rollbacks = max_bad_steps, max_rollbacks
        self.preemption, self.watchdog = preemption, watchdog
        self.bad_steps = 0  # skipped steps in a row
        self.rollbacks = 0  # in this process
        self.counts = {"skipped_nonfinite": 0, "skipped_spike": 0, "skipped_overflow": 0, "rollback": 0}
        self._spike_z: float | None = None

    @classmethod
    def from_config(cls, cfg: Any, watchdog_dir: str | os.PathLike | None = None,
                    preemption: bool = True) -> Reliability:
        """From a posttrain.core.config.ReliabilityConfig; the watchdog needs a dir all ranks see."""
        wd = Watchdog(watchdog_dir, cfg.hang_timeout_s) if cfg.hang_timeout_s and watchdog_dir else None
        return cls(spike_zscore=cfg.spike_zscore, spike_window=cfg.spike_window, max_bad_steps=cfg.max_bad_steps,
                   max_rollbacks=cfg.max_rollbacks, preemption=Preemption(cfg.preempt_grace_s) if preemption else None,
                   watchdog=wd)

    # -- session -----------------------------------------------------------------------------

    def start(self) -> None:
        if self.preemption is not None:
            self.preemption.install()
        if self.watchdog is not None:
            self.watchdog.start()

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.preemption is not None:
            self.preemption.uninstall()

    def beat(self, step: int | None = None, phase: str | None = None) -> None:
        if step is not None:
            RECORDER.step = step
        if self.watchdog is not None:
            self.watchdog.beat(step, phase)

    def stop_requested(self, device: torch.device | None = None) -> bool:
        return self.preemption is not None and self.preemption.agreed(device)

    # -- bad steps -----------------------------------------------------------------------------

    def skip_if(self, metrics: dict[str, float]) -> bool:
        """Trainer.optim_step's screen, before the update: is this step's (global) loss a spike?"""
        self._spike_z = self.spike.is_spike(metrics["loss"]) if self.spike is not None else None
        return self._spike_z is not None

    def after_step(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """Account for an attempted step; returns the events to log (empty for a normal step)."""
        z, self._spike_z = self._spike_z, None
        if not metrics.get("skipped"):
            self.bad_steps = 0
            if self.spike is not None:
                self.spike.accept(metrics["loss"])
            return {}
        if metrics.get("overflow"):  # fp16: the loss scale backed off (posttrain.core.precision.LossScaler); not a bad step
            self.counts["skipped_overflow"] += 1
            log.info("step %d skipped: fp16 gradients overflowed; loss scale now %.4g", step,
                     metrics.get("loss_scale", float("nan")) / 2)
            return {"events/skipped_overflow": float(self.counts["skipped_overflow"])}
        kind = "skipped_spike" if z is not None else "skipped_nonfinite"
        self.counts[kind] += 1
        self.bad_steps += 1
        events = {f"events/{kind}": float(self.counts[kind]), "events/bad_steps_in_a_row": float(self.bad_steps),
                  "events/skipped_loss": metrics["loss"], "events/skipped_grad_norm": metrics["grad_norm"]}
        if z is not None:
            events["events/spike_zscore"] = z
        log.warning("step %d skipped (%s): loss %.4g, grad norm %.4g%s; %d bad step(s) in a row", step,
                    kind.removeprefix("skipped_"), metrics["loss"], metrics["grad_norm"],
                    f", z-score {z:.1f}" if z is not None else "", self.bad_steps)
        return events

    def needs_rollback(self) -> bool:
        return self.max_bad_steps > 0 and self.bad_steps >= self.max_bad_steps

    def check_rollback_allowed(self, step: int, have_manager: bool) -> None:
        why = (f"{self.bad_steps} bad steps in a row at step {step} "
               f"({self.counts['skipped_nonfinite']} non-finite, {self.counts['skipped_spike']} spikes so far)")
        if not have_manager:
            raise TrainingDiverged(f"{why} and no checkpoint manager to roll back with")
        if self.rollbacks >= self.max_rollbacks:
            raise TrainingDiverged(f"{why} after {self.rollbacks} rollback(s) (max_rollbacks={self.max_rollbacks}); "
                                   "lower the lr, check the data, or raise spike_zscore")

    def rolled_back(self, state: dict[str, Any] | None, from_step: int, to_step: int) -> dict[str, float]:
        """After the checkpoint is loaded: take its spike window, count the rollback."""
        skipped = self.bad_steps
        self.load_state_dict(state, counters=False)
        self.bad_steps = 0
        self.rollbacks += 1
        self.counts["rollback"] += 1
        log.warning("rolled back from step %d to the checkpoint of step %d after %d bad steps; the data "
                    "position stays past the bad batches", from_step, to_step, skipped)
        return {"events/rollback": float(self.counts["rollback"]), "events/rollback_to_step": float(to_step),
                "events/rollback_from_step": float(from_step)}

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"spike": self.spike.state_dict() if self.spike is not None else None,
                "bad_steps": self.bad_steps, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any] | None, counters: bool = True) -> None:
        if not state:
            return
        if self.spike is not None and state.get("spike"):
            self.spike.load_state_dict(state["spike"])
        if counters:
            self.bad_steps = int(state.get("bad_steps", 0))
            self.counts.update({k: int(v) for k, v in state.get("counts", {}).items() if k in self.counts})
