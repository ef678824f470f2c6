"""The model core against Hugging Face transformers on tiny random checkpoints of every family."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.model.generate import SamplingParams, generate
from posttrain.registry.hf import hf_state_dict, load_pretrained, save_pretrained
from tests.support.hf_models import FAMILIES, make_hf_model

ATOL = 1e-4  # fp32; observed differences are ~1e-6 (see the closing note of issue 2)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, path)
    ours = load_pretrained(path).eval()
    return request.param, hf, ours, path


def test_logits_match(pair):
    family, hf, ours, _ = pair
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    diff = (ref - got).abs().max().item()
    print(f"{family}: max |logit diff| = {diff:.2e}")
    assert diff < ATOL


def test_padded_batch_matches(pair):
    """Right- and left-padded rows: real positions match HF given the same mask and positions."""
    family, hf, ours, _ = pair
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, 9:] = 0  # right padding
    mask[1, :4] = 0  # left padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, position_ids=pos, attention_mask=mask)
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max() < ATOL
    assert torch.isfinite(got).all()  # padding rows never produce NaN


def test_packed_batch_matches_separate_documents(pair):
    family, hf, ours, _ = pair
    g = torch.Generator().manual_seed(3)
    lengths = [5, 9, 3, 7]
    docs = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    packed = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        got = ours(packed, position_ids=position_ids)[0]
        refs = torch.cat([hf(d[None]).logits[0] for d in docs])
    assert (got - refs).abs().max() < ATOL


def test_greedy_generation_matches_hf(pair):
    family, hf, ours, _ = pair
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (6, 3, 9)]
    T0, new = 9, 12
    ids = torch.zeros(3, T0, dtype=torch.long)
    mask = torch.zeros(3, T0, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T0 - len(p):] = torch.tensor(p)
        mask[b, T0 - len(p):] = 1
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[:, T0:]
    got = generate(ours, prompts, SamplingParams(max_new_tokens=new, temperature=0), pad_id=0)
    assert [r.tokens for r in got] == ref.tolist()
    assert all(r.finish_reason == "length" for r in got)


def test_save_load_roundtrip_is_bit_exact(pair, tmp_path):
    family, hf, ours, src = pair
    save_pretrained(ours, tmp_path / "out")
    again = load_pretrained(tmp_path / "out")
    for (k, a), (k2, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    # and the files hold exactly the tensors transformers wrote
    from safetensors.torch import load_file

    original = load_file(str(src / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    if hf.config.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)


def test_export_loads_in_transformers(pair, tmp_path):
    family, hf, ours, _ = pair
    from transformers import AutoModelForCausalLM

    save_pretrained(ours, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="sdpa").eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (reloaded(ids).logits - hf(ids).logits).abs().max() < ATOL
