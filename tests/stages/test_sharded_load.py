"""Sharded loading: a policy built on the meta device, given LoRA, parallelized, then materialized
with only this rank's shards (posttrain.stages.common.load_model(meta=True) -> apply_lora ->
posttrain.stages.recipe.parallelize_policy -> materialize_model, open_session's order) holds, gathered,
exactly what load_pretrained (+ apply_lora) gives one process, bit for bit.

Checkpoints are tiny HF models made with transformers: Llama-shaped (tied embeddings, llama3
RoPE) and Qwen2-shaped (qkv bias, untied, yarn RoPE), vocab 98 so tp=2 splits it; plus the
`debug` preset (random init from the seed). Layouts on forked gloo ranks: FSDP (dp_shard=2),
TP + SP (tp=2), FSDP x TP (2 x 2: 49 vocab rows per tp rank split 25 / 24 by FSDP, torch's
uneven chunks), DDP (dp_replicate=2), PP (pp=2: each rank its stage's blocks only); and one process,
for every family.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open

from posttrain.core.model.config import ModelConfig
from posttrain.registry.hf import CheckpointError, load_pretrained
from tests.support.hf_models import FAMILIES, make_hf_model
from tests.core.parallel._dist import TOL, run_ranks

VOCAB = 98
LORA = {"enabled": True, "rank": 4, "alpha": 8.0}
# source -> the LoRA settings it is also loaded with (gaussian A, two adapters: other draws)
CASES = {"llama": LORA, "qwen2": dict(LORA, init_lora_weights="gaussian"),
         "debug": dict(LORA, adapter_names=["default", "second"])}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_load")
    for family in ("llama", "qwen2"):
        make_hf_model(family, root / family, vocab_size=VOCAB)
    return root


def stage_config(source: str, parallel: dict, lora: dict | None):
    from posttrain.stages.config import SFTConfig

    return SFTConfig(model={"name_or_path": source}, parallel=parallel, lora=lora or {})


def old_path(cfg):
    """open_session before sharded loading: the whole model on every rank, then LoRA."""
    from posttrain.core.lora import apply_lora
    from posttrain.stages.common import load_model

    torch.manual_seed(cfg.seed)
    model, _ = load_model(cfg.model, torch.device("cpu"), cfg.seed)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
    return model


def new_path(cfg, d):
    """open_session's order: meta -> LoRA -> parallelize -> this rank's shards."""
    from posttrain.core.lora import apply_lora
    from posttrain.stages.common import load_model, load_on_meta, materialize_model
    from posttrain.stages.recipe import parallelize_policy

    assert load_on_meta(cfg.lora)
    torch.manual_seed(cfg.seed)
    model, _ = load_model(cfg.model, d.device, cfg.seed, meta=True)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
    d.mesh = parallelize_policy(model, cfg, d)
    materialize_model(model, cfg.model, d.device, cfg.seed)
    return model


def _load_everything(root: str, parallel: dict) -> dict:
    """On each rank, every case loaded the new way and compared with the old way: this rank's
    part of each tensor and, on rank 0, the gathered state (the keys whose values differ at all);
    the loss on a batch against the old model's; the bytes read of each checkpoint tensor."""
    from posttrain.core.parallel import full_state_dict
    from posttrain.core.parallel.config import ParallelConfig
    from posttrain.core.parallel.materialize import local_part
    from posttrain.registry.hf_sharded import load_sharded
    from posttrain.stages.common import start_distributed
    from tests.core.parallel._dist import batch, dp_reference_loss, par_loss_fn

    d = start_distributed(ParallelConfig(backend="gloo", device="cpu"))
    out: dict = {"differ": {}, "gathered_differ": {}, "loss": 0.0, "read": {}}
    for source, lora in CASES.items():
        path = source if source == "debug" else f"{root}/{source}"
        if parallel.get("pp", 1) > 1:  # several adapters do not run under pp (routing): one, drawn the same way
            lora = {k: v for k, v in lora.items() if k != "adapter_names"}
        for with_lora in (None, lora):
            cfg = stage_config(path, parallel, with_lora)
            model = new_path(cfg, d)
            ref = old_path(cfg)
            pp = d.mesh is not None and d.mesh.dims.pp > 1
            case = f"{source}{'+lora' if with_lora else ''}"
            want = ref.state_dict()
            mine = {k: local_part(t) for k, t in model.state_dict().items()}
            # a pipeline stage holds its blocks (and the tied head's copy of the embedding) only
            odd = set(mine) - set(want) if pp else set(want) ^ set(mine)
            out["differ"][case] = sorted(odd) + [
                k for k, (t, block) in mine.items() if k in want and not torch.equal(t, want[k][block])]
            if not torch.equal(model.inv_freq, ref.inv_freq):
                out["differ"][case].append("inv_freq")
            if pp and not all(torch.equal(m.inv_freq, ref.inv_freq) for m in d.pipeline.modules):
                out["differ"][case].append("stage inv_freq")
            state = full_state_dict(model, d.mesh.group("pp") if pp else None)
            if d.rank == 0:
                out["gathered_differ"][case] = sorted(set(want) ^ set(state)) + [
                    k for k in want if k in state and not torch.equal(state[k], want[k])]
            if d.mesh is not None and not pp:  # the sharded model computes with what it loaded
                ids, _ = batch(model.args)
                _, loss = par_loss_fn(d.mesh, ids)(model)
                want_loss = dp_reference_loss(ids, None, d.mesh.size("dp"))(ref)
                out["loss"] = max(out["loss"], abs(float(loss) - want_loss.item()))
            if source != "debug" and not with_lora:
                out["read"][source] = load_sharded(path, model, torch.float32)
    return out


def tensor_bytes(path) -> dict[str, int]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {n: f.get_tensor(n).nbytes for n in f.keys()}


def short(differ: dict[str, list[str]]) -> dict[str, list[str]]:
    return {case: keys[:3] + ["..."] * (len(keys) > 3) for case, keys in differ.items() if keys}


LAYOUTS = {
    "fsdp": ({"dp_shard": 2}, 2),
    "tp_sp": ({"tp": 2, "sequence_parallel": True}, 2),
    "fsdp_tp": ({"dp_shard": 2, "tp": 2}, 4),
    "ddp": ({"dp_replicate": 2, "dp_shard": 1}, 2),
    "pp": ({"pp": 2}, 2),  # a block per rank; a tied head is the last stage's copy of the embedding
}


@pytest.fixture(scope="module")
def runs(checkpoints):
    """layout -> each rank's results of _load_everything (each layout runs once)."""
    cache: dict[str, list[dict]] = {}

    def run(layout: str) -> list[dict]:
        if layout not in cache:
            parallel, world = LAYOUTS[layout]
            cache[layout] = run_ranks(_load_everything, world, str(checkpoints), parallel)
        return cache[layout]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_load_equals_whole_load(runs, layout):
    results = runs(layout)
    cases = sorted(f"{s}{x}" for s in CASES for x in ("", "+lora"))
    for rank, r in enumerate(results):
        assert sorted(r["differ"]) == cases
        assert not any(r["differ"].values()), f"{layout}, rank {rank}: its shards differ: {short(r['differ'])}"
    gathered = results[0]["gathered_differ"]
    assert sorted(gathered) == cases
    assert not any(gathered.values()), f"{layout}: the gathered state differs from the whole load: {short(gathered)}"
    worst = max(r["loss"] for r in results)
    assert worst <= TOL, f"{layout}: loss differs by {worst}"


@pytest.mark.slow
def test_each_fsdp_rank_reads_only_its_half(runs, checkpoints):
    """dp_shard=2: every tensor is split by rows, so each rank reads a part of each, never a
    whole one; the parts add up to the checkpoint exactly, and each rank reads about half."""
    results = runs("fsdp")
    for source in ("llama", "qwen2"):
        whole = tensor_bytes(checkpoints / source)
        reads = [r["read"][source] for r in results]
        for name, n in whole.items():
            assert all(0 < r[name] < n for r in reads), (source, name, [r[name] for r in reads], n)
            assert sum(r[name] for r in reads) == n, (source, name)
        total = sum(whole.values())
        for r in reads:
            assert sorted(r) == sorted(whole)
            assert abs(sum(r.values()) - total / 2) <= 0.01 * total, (source, sum(r.values()), total)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_process_load_equals_load_pretrained(tmp_path, family):
    from posttrain.stages.common import load_model, materialize_model

    make_hf_model(family, tmp_path)
    want = load_pretrained(tmp_path)
    cfg = ModelConfig(name_or_path=str(tmp_path))
    model, _ = load_model(cfg, torch.device("cpu"), meta=True)
    assert model.embed.weight.is_meta
    read = materialize_model(model, cfg, torch.device("cpu"))
    got = model.state_dict()
    assert got.keys() == want.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in want.state_dict().items())
    assert torch.equal(model.inv_freq, want.inv_freq)
    assert (model.lm_head.weight is model.embed.weight) == want.args.tie_embeddings
    assert read == sum(tensor_bytes(tmp_path).values())


def test_one_process_bf16_and_preset():
    from posttrain.stages.common import load_model, materialize_model

    for cfg in (ModelConfig(name_or_path="debug"), ModelConfig(name_or_path="debug", dtype="bfloat16")):
        want, _ = load_model(cfg, torch.device("cpu"), seed=3)
        model, _ = load_model(cfg, torch.device("cpu"), seed=3, meta=True)
        materialize_model(model, cfg, torch.device("cpu"), seed=3)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in want.state_dict().items())


def test_adapters_reading_the_base_load_whole():
    from posttrain.core.lora.config import LoRAConfig
    from posttrain.stages.common import load_on_meta

    assert load_on_meta(LoRAConfig()) and load_on_meta(LoRAConfig(enabled=True))
    for kw in ({"quantize_base": "nf4"}, {"use_dora": True}, {"init_lora_weights": "pissa"}):
        assert not load_on_meta(LoRAConfig(enabled=True, **kw))


def test_bad_checkpoints_fail_as_load_pretrained_does(tmp_path):
    """Names and shapes are checked from the headers, with load_pretrained's messages."""
    from safetensors.torch import load_file, save_file

    from posttrain.stages.common import load_model, materialize_model

    make_hf_model("qwen2", tmp_path / "good")
    tensors = load_file(tmp_path / "good" / "model.safetensors")
    edits = {
        "missing": (lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"), r"missing tensor for 'layers.1.attn.k_proj.bias'"),
        "unexpected": (lambda t: t.update(extra=torch.zeros(2)), r"unexpected tensor 'extra'"),
        "shape": (lambda t: t.update({"model.norm.weight": torch.ones(3)}), r"'norm.weight' .* has shape \(3,\)"),
    }
    for name, (edit, message) in edits.items():
        d = tmp_path / name
        shutil.copytree(tmp_path / "good", d)
        broken = dict(tensors)
        edit(broken)
        save_file(broken, d / "model.safetensors")
        cfg = ModelConfig(name_or_path=str(d))
        with pytest.raises(CheckpointError, match=message):
            load_pretrained(d)
        model, _ = load_model(cfg, torch.device("cpu"), meta=True)
        with pytest.raises(CheckpointError, match=message):
            materialize_model(model, cfg, torch.device("cpu"))


def test_checkpoint_in_several_files(tmp_path):
    """An index and shard files (save_pretrained's split): each tensor is read from its file."""
    from posttrain.registry.hf import save_pretrained
    from posttrain.stages.common import load_model, materialize_model

    make_hf_model("qwen2", tmp_path / "hf")
    want = load_pretrained(tmp_path / "hf")
    save_pretrained(want, tmp_path / "split", max_shard_bytes=40_000)
    assert len(list((tmp_path / "split").glob("model-*-of-*.safetensors"))) > 3
    cfg = ModelConfig(name_or_path=str(tmp_path / "split"))
    model, _ = load_model(cfg, torch.device("cpu"), meta=True)
    materialize_model(model, cfg, torch.device("cpu"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.state_dict().items())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_moe"])  # tied head; qkv bias; experts + shared gate
def test_qlora_from_a_checkpoint_is_quantized_as_it_is_read(tmp_path, family):
    """QLoRA on a checkpoint (posttrain.stages.common.load_quantized): built on meta, each targeted weight
    read just before it is quantized, then the rest. Bit for bit what the whole model + apply_lora
    gives (NF4 codes and scales, adapters, dense rest), double quant on and off, and the same
    logits; nothing left on meta, a tied head still the embedding."""
    from posttrain.stages.common import load_quantized, streams_quantized

    make_hf_model(family, tmp_path / family, vocab_size=VOCAB)
    for double_quant in (True, False):
        cfg = stage_config(str(tmp_path / family), {}, dict(LORA, quantize_base="nf4", double_quant=double_quant))
        assert streams_quantized(cfg.model, cfg.lora)
        want = old_path(cfg)
        torch.manual_seed(cfg.seed)
        got, _ = load_quantized(cfg.model, cfg.lora, torch.device("cpu"))
        w, g = want.state_dict(), got.state_dict()
        assert w.keys() == g.keys()
        assert [k for k in w if not torch.equal(w[k], g[k])] == []
        assert not any(t.is_meta for t in [*got.parameters(), *got.buffers()])
        if got.args.tie_embeddings:
            assert got.lm_head.weight is got.embed.weight
        ids = torch.randint(0, VOCAB, (2, 11))
        with torch.no_grad():
            assert torch.equal(got(ids), want(ids))
    assert not streams_quantized(ModelConfig(name_or_path="debug"), cfg.lora)  # a preset: drawn whole
