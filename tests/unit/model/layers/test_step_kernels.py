"""The fast path's C++ step kernels (baton.model.layers.step_kernels) against the torch steps
they replace (baton.model.layers.fused, run eagerly), on slots that are not consecutive and not
in order: each kernel updates exactly its batch's pool rows, in place, and leaves every other
row as it was (bit for bit); results agree to float32 rounding (sums in another order). With
destination slots apart from the source ones (a verify pass's next position) the recurrent
kernels write exactly the in-place result there and leave the sources as they were."""

from __future__ import annotations

import pytest
import torch

from baton.model.layers import fused
from baton.model.layers.step_kernels import kernels

K = kernels()
pytestmark = pytest.mark.skipif(K is None, reason="step kernels not built on this machine")
SLOTS = torch.tensor([5, 1, 3])
OTHERS = [0, 2, 4, 6]
DST = torch.tensor([2, 6, 0])


def _moved(step, inputs, pools: list[torch.Tensor], in_place: list[torch.Tensor], got):
    """`step` from SLOTS into DST on the pools as they were: the same output and the in-place
    states, bit for bit, in DST; every other row unchanged."""
    before = [p.clone() for p in pools]
    out = step(inputs, pools, SLOTS, DST)
    assert torch.equal(out, got)
    for p, b, want in zip(pools, before, in_place, strict=True):
        assert torch.equal(p[DST], want)
        keep = [i for i in range(p.shape[0]) if i not in DST.tolist()]
        assert torch.equal(p[keep], b[keep])


def _gen():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("H, P, G, N, bias", [
    (4, 8, 2, 16, True),   # AVX-512: conv 16 channels at a time (96), state rows of 16
    (3, 12, 1, 16, False),  # conv 68 channels: 4 in the scalar tail; no conv bias
    (4, 8, 2, 12, True),   # state rows of 12: the scalar state loop
])
def test_mamba2_step_updates_its_slots_in_place(H, P, G, N, bias):
    g = _gen()
    inter = H * P
    C = inter + 2 * G * N
    dims = (inter, H, P, G, N, 0.0, float("inf"), inter // G, 1e-5)
    zx = torch.randn(3, inter + C + H, generator=g)
    conv, ssm = torch.randn(7, C, 3, generator=g), torch.randn(7, H, P, N, generator=g) * 0.1
    params = (torch.randn(C, 4, generator=g), torch.randn(C, generator=g) if bias else None,
              torch.randn(H, generator=g), torch.randn(H, generator=g),
              torch.randn(H, generator=g), torch.randn(inter, generator=g))
    want_conv, want_ssm = conv[SLOTS].clone(), ssm[SLOTS].clone()
    want = fused.mamba2_step(*dims, zx, want_conv, want_ssm, *params)
    before_conv, before_ssm = conv.clone(), ssm.clone()
    got = K.mamba2_step(zx, conv, ssm, SLOTS, SLOTS, *params, *dims)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[SLOTS], want_conv, rtol=0, atol=0)  # a shift: exact
    torch.testing.assert_close(ssm[SLOTS], want_ssm, rtol=1e-5, atol=1e-6)
    assert torch.equal(conv[OTHERS], before_conv[OTHERS])
    assert torch.equal(ssm[OTHERS], before_ssm[OTHERS])
    _moved(lambda x, p, s, d: K.mamba2_step(x, *p, s, d, *params, *dims), zx,
           [before_conv, before_ssm], [conv[SLOTS], ssm[SLOTS]], got)


@pytest.mark.parametrize("hk, hv, dk, dv", [
    (2, 4, 16, 8),
    (1, 2, 32, 128),  # Qwen3.5's value head: AVX-512 in registers, AVX2 in column passes
    (1, 1, 16, 72),   # AVX2: a 64-column pass and an 8-column one; AVX-512: the scalar loop
    (1, 1, 8, 12),    # the scalar loop
])
def test_deltanet_step_updates_its_slots_in_place(hk, hv, dk, dv):
    g = _gen()
    C = 2 * hk * dk + hv * dv
    qkv = torch.randn(3, C, generator=g)
    conv, rec = torch.randn(7, C, 3, generator=g), torch.randn(7, hv, dk, dv, generator=g) * 0.1
    gates = (torch.randn(3, hv, generator=g), torch.randn(3, hv, generator=g),
             torch.randn(3, hv * dv, generator=g))
    params = (torch.randn(C, 4, generator=g), torch.randn(hv, generator=g),
              torch.randn(hv, generator=g), torch.randn(dv, generator=g))
    want_conv, want_rec = conv[SLOTS].clone(), rec[SLOTS].clone()
    want = fused.deltanet_step(hk, hv, dk, dv, 1e-6, qkv, want_conv, want_rec, *gates, *params)
    before_conv, before_rec = conv.clone(), rec.clone()
    got = K.deltanet_step(qkv, conv, rec, SLOTS, SLOTS, *gates, *params, hk, hv, dk, dv, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[SLOTS], want_conv, rtol=0, atol=0)
    torch.testing.assert_close(rec[SLOTS], want_rec, rtol=1e-5, atol=1e-6)
    assert torch.equal(conv[OTHERS], before_conv[OTHERS])
    assert torch.equal(rec[OTHERS], before_rec[OTHERS])
    _moved(lambda x, p, s, d: K.deltanet_step(x, *p, s, d, *gates, *params, hk, hv, dk, dv,
                                              1e-6), qkv,
           [before_conv, before_rec], [conv[SLOTS], rec[SLOTS]], got)


@pytest.mark.parametrize("kvh,heads,hd", [
    (2, 6, 16),  # a group of 3 heads, one 16-lane column at a time (AVX-512)
    (2, 6, 12),  # the scalar loop
    (2, 2, 64),  # 1 head per kv head, 4 columns at a time
    (2, 8, 128),  # Qwen3.5's 4 per kv head, 2 columns at a time
    (1, 8, 32),  # 8 per kv head
    (1, 10, 16),  # 10 per kv head: the dot-and-axpy loop
])
def test_paged_attention_stores_then_reads_through_block_tables(kvh, heads, hd):
    g = _gen()
    tpb = 4
    pool = torch.randn(12, 2, tpb, kvh, hd, generator=g)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 5, 5], [9, 9, 9, 9]])  # padded with column 0
    lens = torch.tensor([13, 6, 1])
    q = torch.randn(3, heads, hd, generator=g)
    k, v = torch.randn(3, kvh, hd, generator=g), torch.randn(3, kvh, hd, generator=g)
    want_pool = pool.clone()
    pos = lens - 1
    blocks = tables[torch.arange(3), pos // tpb]
    want_pool[blocks, 0, pos % tpb], want_pool[blocks, 1, pos % tpb] = k, v
    got = K.paged_attention(q, k, v, pool, tables, lens, hd ** -0.5, None)
    assert torch.equal(pool, want_pool)  # the new K/V at their positions, nothing else moved
    keys = torch.arange(13)
    rows = tables[:, keys // tpb] * (2 * tpb) + keys % tpb
    mask = torch.where(keys[None, :] < lens[:, None], 0.0, float("-inf"))
    want = fused.attention_step(hd ** -0.5, q.view(3, kvh, heads // kvh, hd), want_pool, rows,
                                mask)
    torch.testing.assert_close(got, want.reshape(3, -1), rtol=1e-5, atol=1e-6)
    # a sequence alone (at 2+ threads split over its kv heads) gets its row of the batch
    for i in range(3):
        alone = K.paged_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], pool, tables[i:i + 1],
                                  lens[i:i + 1], hd ** -0.5, None)
        assert torch.equal(alone[0], got[i])
    # explicit key positions (a tree row): the same keys in the same order give the same bits
    pool2 = want_pool.clone()
    keys = torch.zeros(3, 16, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        keys[i, :n] = torch.arange(n)
    assert torch.equal(K.paged_attention(q, k, v, pool2, tables, lens, hd ** -0.5, keys), got)
    # a row that reads positions 0, 1 then 5 and writes its token at 5 equals the token at
    # position 2 of a sequence whose keys sit at 0, 1, 2
    seq, tree = want_pool.clone(), want_pool.clone()
    ref = K.paged_attention(q[2:], k[2:], v[2:], seq, torch.tensor([[9]]), torch.tensor([3]),
                            hd ** -0.5, None)
    got_tree = K.paged_attention(q[2:], k[2:], v[2:], tree, torch.tensor([[9, 10]]),
                                 torch.tensor([3]), hd ** -0.5, torch.tensor([[0, 1, 5]]))
    assert torch.equal(got_tree, ref)
    assert torch.equal(tree[10, :, 1], seq[9, :, 2])


def test_rms_norm_matches_the_module():
    from baton.model.layers.norms import RMSNorm

    g = _gen()
    norm = RMSNorm(24, 1e-5)
    norm.weight.data = torch.randn(24, generator=g)
    x = torch.randn(3, 24, generator=g)
    torch.testing.assert_close(K.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-6, atol=1e-6)


def test_rms_norm_of_strided_rows():
    """Qwen's q: every other head_dim run of its projection; size-1 dims in any stride."""
    from baton.model.layers.gated_norms import ZeroCentredRMSNorm

    g = _gen()
    norm = ZeroCentredRMSNorm(8, 1e-6)
    norm.weight.data = torch.randn(8, generator=g)
    proj = torch.randn(3, 4, 16, generator=g)
    for x in (proj.chunk(2, dim=-1)[0], proj[:1].chunk(2, dim=-1)[1], proj[:, :1, :8],
              proj.view(3, 4, 2, 8)[:, :, 1]):
        got = K.rms_norm(x, norm._scale(), 1e-6)
        assert got is not None and got.is_contiguous()
        torch.testing.assert_close(got, norm(x), rtol=1e-6, atol=1e-6)
    assert K.rms_norm(proj.transpose(0, 1)[:, :, :8], norm._scale(), 1e-6) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_is_max_dim_indices(threads):
    # Greedy sampling's argmax: the index torch's max(dim=-1) gives, on rows shorter than a
    # vector, with a tail, and vocabulary-sized; with ties (the first wins), -0.0 beside 0.0,
    # rows all -inf, NaNs (the first NaN's index), the maximum in the tail; and through
    # sampler.greedy_ids, which takes it for float32 rows on CPU.
    from baton.engine.sampler import greedy_ids

    g = _gen()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b, n in ((1, 1), (3, 7), (2, 8), (5, 17), (32, 16384), (3, 151936)):
            x = torch.randn(b, n, generator=g)
            if n >= 8:
                x[0, 3], x[0, n - 2] = float("nan"), float("nan")
                x[1] = float("-inf")
                if b > 2:
                    x[2] = torch.round(x[2] * 2) / 2  # many ties at the maximum
                x[-1, n - 1] = x[-1].max() + 1  # the maximum in the scalar tail
            if n == 7:
                x[1] = torch.tensor([-0.0, 0.0, -1.0, -2.0, -0.0, 0.0, -5.0])
                x[2, 6] = float("nan")
            want = x.max(dim=-1).indices
            assert torch.equal(K.argmax_rows(x), want), (b, n)
            assert torch.equal(greedy_ids(x), want), (b, n)
            assert torch.equal(K.argmax_rows(x[:, : n // 2 + 1]), x[:, : n // 2 + 1].max(
                dim=-1).indices), (b, n)  # rows a stride apart
        assert K.argmax_rows(torch.tensor([[1.0, 3.0, 3.0, 2.0]])).tolist() == [1]
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        K.argmax_rows(torch.zeros(4, 3).t())
    with pytest.raises(RuntimeError, match="V > 0"):
        K.argmax_rows(torch.zeros(2, 0))
