"""Atomic, verified, resumable checkpoints on torch.distributed.checkpoint (torchtitan's manager, here).

Layout of `<dir>`:

    step-000120/     __<rank>_<i>.distcp shards + .metadata (DCP), common.json (rank 0: non-tensor
                     optimizer values, scheduler), rank-00000.json ... (per rank: trainer dict, RNG),
                     manifest.json (step, time, world size, config hash, every file's size + sha256)
    latest           "step-000120": the newest committed checkpoint
    .tmp-step-000140-<nonce>/   a save in progress; never read, removed when stale

A save writes everything into the tmp dir with fsync, then rank 0 (once every rank has reported
its files) writes the manifest, renames the dir to its final name and os.replace()s `latest`. A
crash or an exception at any point leaves no partial dir under a final name, `latest` untouched.

Loading verifies the manifest first (presence, sizes, hashes) and falls back to the previous
complete checkpoint when one is bad, reporting why. Only tensors go through DCP; every other value
is JSON (no pickle), and DCP's `.metadata` is unpickled against an allowlist of DCP's own classes,
so a checkpoint cannot run code on load. Model and optimizer go through `get_*_state_dict` /
`set_*_state_dict`, so FSDP2/DTensor models save per-rank shards and reshard on load to another
world size. The checkpoint dir must be visible to all ranks (a shared filesystem), as DCP needs.

Modules: manager (CheckpointManager: when to save, what to keep, verified loads), writer (the
save: snapshot, write, commit; sync or on a background thread), state (JSON codec, RNG, state
dicts), layout (names on disk, the inventory, the allowlisted metadata unpickler).

Names load on first use (posttrain.core.lazy): `posttrain.core.checkpoint.config` (CheckpointConfig) imports without torch.
"""

import warnings

from posttrain.core.lazy import lazy_exports

# DCP warns on every save/load without a process group; single-process use is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "COMMON": "posttrain.core.checkpoint.layout",
    "CheckpointError": "posttrain.core.checkpoint.layout",
    "CheckpointManager": "posttrain.core.checkpoint.manager",
    "FORMAT": "posttrain.core.checkpoint.layout",
    "LATEST": "posttrain.core.checkpoint.layout",
    "LoadReport": "posttrain.core.checkpoint.layout",
    "MANIFEST": "posttrain.core.checkpoint.layout",
    "Stateful": "posttrain.core.checkpoint.state",
    "config_hash": "posttrain.core.checkpoint.state",
    "read_metadata": "posttrain.core.checkpoint.layout",
    "step_dir_name": "posttrain.core.checkpoint.layout",
})
