"""A verifier the GRPO tests name by entry point ('tests.support.grpo_verifiers:overlap'), importable by the
stage in-process and under torchrun: partial credit, so an untrained policy's groups differ."""

from __future__ import annotations


def overlap(prompt: str, completion: str, row: dict) -> float:
    """The share of the reference answer's distinct characters the completion contains."""
    want = set(str(row["answer"]))
    return len(want & set(completion)) / max(len(want), 1)


def overlap_killing_a_generator(prompt: str, completion: str, row: dict) -> float:
    """`overlap`, and on its first call SIGKILLs generator worker 0 of this process
    (posttrain.core.generation.remote spawns them as children of the trainer's lead rank), as a fault drill:
    with generation.prefetch the workers are then sampling the next round."""
    import multiprocessing
    import os
    import signal

    global _killed
    if not _killed:
        # worker 0: the one a round's first request goes to (active_children's order is arbitrary)
        workers = [p for p in multiprocessing.active_children() if p.name == "posttrain-generator-0"]
        if workers:
            os.kill(workers[0].pid, signal.SIGKILL)
            _killed = True
    return overlap(prompt, completion, row)


_killed = False
