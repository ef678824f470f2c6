"""optim.offload under FSDP2 (CPUOffloadPolicy) on 2 gloo processes: the run with the optimizer
state offloaded is the run without (on CPU the policy moves nothing, but its code path runs:
pinned-memory copies skipped, the step on the CPU shards); and the layouts that cannot offload
refuse it by name."""

from __future__ import annotations

import pytest
import torch

from posttrain.stages.common import StageError
from tests.stages.test_stage_parallel import (assert_same_run, in_process, optim, reference, root, sft_config,  # noqa: F401
                                 torchrun_stage)


@pytest.mark.slow
def test_fsdp_with_optimizer_offload_matches_one_process_and_fsdp_without(reference):
    from posttrain.registry.hf import load_pretrained

    root, ref_records = reference
    runs = {}  # bitwise the same steps and weights as without offload; as close to one process as FSDP is
    for offload in (False, True):
        name = f"fsdp-offload-{offload}"
        cfg = sft_config(root, name, parallel={"dp_shard": 2}, optim={**optim(1), "offload": offload})
        runs[offload] = torchrun_stage(cfg, root / f".work-{name}", 2)
        assert_same_run(runs[offload], ref_records, root / name, root / "ref", ("val/loss_initial", "val/loss"))
    same = ("loss", "grad_norm", "tokens")
    assert [{k: r[k] for k in same} for r in runs[True] if "grad_norm" in r] == \
        [{k: r[k] for k in same} for r in runs[False] if "grad_norm" in r]
    got = load_pretrained(root / "fsdp-offload-True" / "model").state_dict()
    want = load_pretrained(root / "fsdp-offload-False" / "model").state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), "offload changed the weights"


def test_offload_without_fsdp_is_refused(root):
    cfg = sft_config(root, "offload-one-process", optim={**optim(1), "offload": True})
    with pytest.raises(StageError, match="optim.offload"):
        in_process(cfg)
