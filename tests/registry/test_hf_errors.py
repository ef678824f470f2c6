"""Clear errors for bad checkpoints, and presets."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.core.model import PRESETS, build_model, get_preset
from posttrain.registry.hf import CheckpointError, load_pretrained, save_pretrained
from tests.support.hf_models import make_hf_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", path)
    return path


def copy_dir(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_directory_and_files(tmp_path, llama_dir):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    d = copy_dir(llama_dir, tmp_path / "a")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json: missing"):
        load_pretrained(d)
    d = copy_dir(llama_dir, tmp_path / "b")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_pretrained(d)


def test_pickle_weights_refused(tmp_path, llama_dir):
    d = copy_dir(llama_dir, tmp_path / "p")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_pretrained(d)


def test_unsupported_model_type_lists_supported(tmp_path, llama_dir):
    d = copy_dir(llama_dir, tmp_path / "g")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unsupported model_type 'gpt2'.*llama, mistral, qwen2, mixtral, qwen2_moe"):
        load_pretrained(d)


def test_shape_mismatch_names_the_tensor(tmp_path, llama_dir):
    d = copy_dir(llama_dir, tmp_path / "s")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight.*shape"):
        load_pretrained(d)


def test_missing_tensor_is_named(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    d = copy_dir(llama_dir, tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_pretrained(d)


def test_truncated_safetensors(tmp_path, llama_dir):
    d = copy_dir(llama_dir, tmp_path / "t")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable or truncated"):
        load_pretrained(d)


def test_sharded_checkpoint_roundtrip(tmp_path):
    model = build_model(get_preset("debug-moe"))
    save_pretrained(model, tmp_path / "sharded", max_shard_bytes=200_000)
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    again = load_pretrained(tmp_path / "sharded")
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_save_is_atomic_on_failure(tmp_path, monkeypatch):
    model = build_model(get_preset("debug"))
    out = save_pretrained(model, tmp_path / "ckpt")
    before = (out / "model.safetensors").read_bytes()
    import posttrain.registry.hf as hf

    def boom(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(hf, "save_file", boom)
    with pytest.raises(OSError):
        save_pretrained(build_model(get_preset("debug"), seed=1), tmp_path / "ckpt")
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dirs left behind


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_on_meta(name):
    args = get_preset(name)
    with torch.device("meta"):
        from posttrain.core.model import Transformer

        model = Transformer(args)
    n = sum(p.numel() for p in model.parameters())
    assert n == args.num_params()


def test_known_preset_sizes():
    # Published parameter counts (rounded): SmolLM2-135M, Qwen2.5-0.5B, Llama-3.2-1B (tied).
    assert abs(get_preset("smollm2-135m").num_params() / 1e6 - 134.5) < 1
    assert abs(get_preset("qwen2.5-0.5b").num_params() / 1e6 - 494) < 2
    assert abs(get_preset("llama-3.2-1b").num_params() / 1e9 - 1.236) < 0.01
    with pytest.raises(KeyError, match="unknown model preset 'nope'"):
        get_preset("nope")


def test_tied_embeddings_stay_tied_after_build_and_load(tmp_path):
    model = build_model(get_preset("debug"))
    assert model.lm_head.weight is model.embed.weight
    save_pretrained(model, tmp_path / "tied")
    again = load_pretrained(tmp_path / "tied")
    assert again.lm_head.weight is again.embed.weight
    assert sum(p.numel() for p in model.parameters()) == get_preset("debug").num_params()
