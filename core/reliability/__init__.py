"""Surviving faults in a training job: bad steps, hangs and preemption. `posttrain.core.loop.fit` drives it.

- Bad steps. A step whose loss or gradient norm is not finite is skipped by the Trainer; a step
  whose loss is a spike (z-score against a rolling window of accepted losses above a threshold) is
  skipped too. After `max_bad_steps` skipped steps in a row the loop rolls back to the last
  checkpoint, keeping the data position, so the bad batches are not seen again.
- Preemption. SIGTERM only sets a flag; at the next step boundary the ranks agree on it (one
  all-reduce), write a final checkpoint and exit with EXIT_PREEMPTED (75, sysexits' EX_TEMPFAIL:
  "try again"; the flow's retry resumes from that checkpoint). If that takes longer than the
  grace period, a timer exits hard: checkpoints are atomic, so `latest` stays the previous one.
- Hangs. Every rank beats a heartbeat (in memory each micro-step; a thread writes it to
  `<dir>/<session>/heartbeat-rank*.json` every few seconds). Rank 0's thread watches all of them:
  when a rank makes no progress for `timeout_s`, every rank dumps its Python stacks
  (faulthandler) and the collectives it issued last (our ring buffer, plus torch's flight recorder
  when TORCH_FR_BUFFER_SIZE is set), and rank 0 ends the job with EXIT_HUNG and the message
  "watchdog: rank R made no progress for S s; stacks in DIR". The watchdog dir must be visible to
  every rank (a shared filesystem, as checkpoints need). Collective timeouts
  (`prepare_process_group`) are the backstop and must be longer than the watchdog's.

What else survives what, and where it is handled:
- A killed rank: torchrun (`launcher.max_restarts`) restarts the group, which resumes from the
  latest complete checkpoint (model, optimizer, schedule, RNG, data position, spike window) to
  the same weights as an uninterrupted run; past the restarts the flow retries the stage.
- A corrupt or truncated checkpoint: posttrain.core.checkpoint verifies hashes and falls back to the
  previous one; fit logs `events/checkpoint_skipped`.
- A full disk or I/O error while saving: `checkpoint.on_save_error` = "continue" (train on,
  retry at the next save) or "fail"; either way `latest` stays the previous complete checkpoint.
- The flow process or torchrun killed outright: torchrun dies with the flow's launching thread and
  each rank with its torchrun (PR_SET_PDEATHSIG; a training rank checkpoints on the SIGTERM), the
  next launch of the stage waits for any leftovers, and the rerun resumes from the checkpoint; the
  rerun's flow ends the killed runs' MLflow runs as KILLED (flows/recovery.py). tests/flows/test_chaos.py
  kills ranks, launchers and the flow at random and checks the outputs are an uninterrupted run's.
- MLflow down: posttrain.core.tracking buffers and retries in the background; training never waits on it.
- Prefect's API down: stages never talk to Prefect (only flows/ do; tests/core/test_reliability.py
  checks no stage or core module imports it), so a running stage is unaffected; the flow's own
  client retries, and a re-run flow skips finished stages (cache) and resumes the others.

One module per idea: `recorder` (the ring buffer of recent collectives, torch's flight recorder,
the collective timeout), `spikes` (loss-spike detection), `preemption` (SIGTERM to a checkpoint and
exit 75), `watchdog` (heartbeats, hang detection, stack dumps) and `policy` (Reliability: what fit
applies, built from a ReliabilityConfig).

Names load on first use (posttrain.core.lazy): `posttrain.core.reliability.config` (ReliabilityConfig) imports without torch.
"""

from posttrain.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "CollectiveRecord": "posttrain.core.reliability.recorder",
    "DUMP_SIGNAL": "posttrain.core.reliability.watchdog",
    "EXIT_HUNG": "posttrain.core.reliability.watchdog",
    "EXIT_PREEMPTED": "posttrain.core.reliability.preemption",
    "FlightRecorder": "posttrain.core.reliability.recorder",
    "Preempted": "posttrain.core.reliability.preemption",
    "Preemption": "posttrain.core.reliability.preemption",
    "RECORDER": "posttrain.core.reliability.recorder",
    "Reliability": "posttrain.core.reliability.policy",
    "SpikeDetector": "posttrain.core.reliability.spikes",
    "TrainingDiverged": "posttrain.core.reliability.policy",
    "Watchdog": "posttrain.core.reliability.watchdog",
    "all_reduce": "posttrain.core.reliability.recorder",
    "prepare_process_group": "posttrain.core.reliability.recorder",
})
