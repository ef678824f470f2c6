"""Packed attention per document (DocumentSpans) against the block-diagonal mask path."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.model.args import ModelArgs
from posttrain.core.model.model import DocumentSpans, attention_masks, build_attention_mask, build_model, document_attention


def _positions(*rows: list[int]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def test_spans_group_equal_lengths_and_split_rows():
    spans = DocumentSpans.from_position_ids(_positions([5, 7, 7, 7, 3, 1], [4, 4, 9, 1, 1, 11]))
    assert spans.runs == (((0, 5, 1), (5, 7, 3), (26, 3, 1), (29, 1, 1)),
                          ((0, 4, 2), (8, 9, 1), (17, 1, 2), (19, 11, 1)))
    assert spans.cu_seqlens.tolist() == [0, 5, 12, 19, 26, 29, 30, 34, 38, 47, 48, 49, 60]
    assert spans.max_len == 11
    # A row that starts mid-document (no position 0 at its start) still starts a document there.
    pos = torch.tensor([[3, 4, 0, 1, 2]])
    assert DocumentSpans.from_position_ids(pos).runs == (((0, 2, 1), (2, 3, 1)),)


@pytest.mark.parametrize("heads,kv", [(4, 4), (6, 2)])
def test_document_attention_matches_block_diagonal_mask(heads, kv):
    g = torch.Generator().manual_seed(0)
    pos = _positions([5, 7, 7, 1, 11], [3, 3, 3, 3, 6, 13])
    B, T, hd = pos.shape[0], pos.shape[1], 8
    q = torch.randn(B, heads, T, hd, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, kv, T, hd, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, kv, T, hd, generator=g, dtype=torch.float64, requires_grad=True)
    got = document_attention(q, k, v, DocumentSpans.from_position_ids(pos))  # (B, T, H, hd)
    docs = torch.cumsum(pos == 0, 1)
    slots = torch.arange(T)[None]
    mask = build_attention_mask(slots, slots, None, docs, docs)
    rep = heads // kv
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    dout = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    refs = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _model(**kw) -> torch.nn.Module:
    args = ModelArgs(vocab_size=101, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2,
                     intermediate_size=80, family="llama", **kw)
    return build_model(args, seed=1, dtype=torch.float64)


@pytest.mark.parametrize("window", [None, 4, 64])
def test_model_packed_forward_and_grads_match_mask_path(window):
    """The span path (no attention_mask) equals the mask path (an all-ones attention_mask forces
    it), values and gradients; a sliding window shorter than a document falls back to the mask."""
    model = _model(sliding_window=window) if window else _model()
    pos = _positions([5, 7, 7, 12], [9, 9, 9, 4])
    ids = torch.randint(0, 101, pos.shape, generator=torch.Generator().manual_seed(2))
    kinds = {type(m) for m in attention_masks(model.args, [0, 1], pos, pos.shape[1]).values()}
    assert kinds == ({torch.Tensor} if window == 4 else {DocumentSpans})

    def run(mask):
        model.zero_grad()
        h = model.hidden_states(ids, pos, mask)
        (h * torch.linspace(-1, 1, h.shape[-1], dtype=h.dtype)).sum().backward()
        return h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    h_spans, g_spans = run(None)
    h_mask, g_mask = run(torch.ones_like(ids))
    torch.testing.assert_close(h_spans, h_mask, rtol=1e-10, atol=1e-10)
    assert g_spans.keys() == g_mask.keys() and len(g_mask) > 10
    for name in g_mask:
        torch.testing.assert_close(g_spans[name], g_mask[name], rtol=1e-9, atol=1e-10, msg=name)


def test_compiled_blocks_do_not_recompile_per_packing_layout():
    """Every batch packs differently; document_attention runs eagerly inside a compiled block, so
    the layout (a Python object) never becomes a guard that forces a recompile."""
    import torch._dynamo.testing

    from posttrain.core.parallel.data_parallel import apply_compile

    model = _model()
    counter = torch._dynamo.testing.CompileCounter()
    apply_compile(list(model.layers), backend=counter)
    frames = []
    for lengths in ([5, 7, 4], [5, 7, 4], [3, 3, 10], [2, 9, 2, 3]):
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        ids = torch.randint(0, 101, pos.shape, generator=torch.Generator().manual_seed(len(lengths)))
        model.hidden_states(ids, pos).sum().backward()
        frames.append(counter.frame_count)
    torch._dynamo.reset()
    assert frames[0] > 0 and len(set(frames)) == 1, frames
