"""KV stored in bfloat16 or fp8 e4m3 (`cache.kv_dtype`, baton.model.paged): the fp8 rows and
their scales, and the attention kernels that read them a tile at a time. Each kernel over a
bfloat16 / fp8 pool gives, bit for bit, what the float32 kernel gives over a pool holding the
widened values (`paged.dequantize`), alone or in a batch, on 1 or 2 threads, across tiles."""

from __future__ import annotations

import pytest
import torch

from baton.model import paged
from baton.model.layers.step_kernels import kernels

K = kernels()
needs_kernels = pytest.mark.skipif(K is None, reason="step kernels not built on this machine")
FP8 = torch.float8_e4m3fn
FORMATS = {"bfloat16": (torch.bfloat16, 1), "float8_e4m3": (FP8, 2)}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_fp8_rows_hold_values_then_their_scale():
    g = _gen()
    x = torch.randn(5, 3, 16, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0
    rows = paged.quantize_fp8(x)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 3, 20)
    scale = rows[..., 16:].contiguous().view(torch.float32)[..., 0]
    amax = x.abs().amax(-1)
    want = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    assert torch.equal(scale, want)
    assert scale[2, 1] == 1 and (rows[2, 1, :16] == 0).all()  # a zero row: scale 1, zeros
    back = paged.dequantize(rows, 16)
    # e4m3: 3 mantissa bits, so within 1/16 of the value (relative), exact at the row's max
    assert ((back - x).abs() <= x.abs() / 16 + 1e-30).all()
    top = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, top), x.gather(-1, top), rtol=1e-6, atol=0)
    # round to nearest: the value / scale converted as torch converts
    assert torch.equal(rows[..., :16].view(FP8).float(), (x / want[..., None]).to(FP8).float())


def test_a_rows_bytes_depend_on_that_row_alone():
    g = _gen(1)
    x = torch.randn(7, 4, 32, generator=g)
    whole = paged.quantize_fp8(x)
    for i in range(7):
        assert torch.equal(paged.quantize_fp8(x[i:i + 1]), whole[i:i + 1])
    other = x.clone()
    other[3] *= 1000  # another token in the same block: row 2's bytes unchanged
    assert torch.equal(paged.quantize_fp8(other)[2], whole[2])


@needs_kernels
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_kernels_store_the_bytes_torch_stores(fmt):
    """The decode kernels quantize the new token's k, v themselves (`kv_rows`): the same bytes
    as `paged.stored_rows` (torch's conversion), halfway cases, tiny and huge rows included."""
    g = _gen(3)
    x = torch.randn(64, 4, 32, generator=g) * torch.logspace(-30, 30, 64)[:, None, None]
    x[0] = 0
    x[1, :, :8] = torch.tensor([1.0, 1.0625, 1.125, 1.1875, -1.0625, 3.0, 0.5, 448.0])
    x[2] = torch.arange(128).view(4, 32) * 2 ** -12  # subnormal fp8 values after scaling
    dt, code = FORMATS[fmt]
    pool = torch.zeros(1, 2, 1, 4, 36 if dt == FP8 else 32, dtype=dt)
    want = paged.stored_rows(pool, x).view(torch.uint8)
    assert torch.equal(K.kv_rows(x, code), want)


def _pools(fmt: str, blocks: int, tpb: int, kvh: int, hd: int, g):
    """(a pool of `fmt`, the float32 pool of its widened values), random contents."""
    dt, _ = FORMATS[fmt]
    x = torch.randn(blocks, 2, tpb, kvh, hd, generator=g)
    if dt == FP8:
        rows = paged.quantize_fp8(x)
        return rows.view(FP8), paged.dequantize(rows, hd)
    return x.to(dt), x.to(dt).float()


@needs_kernels
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kvh, heads, hd, lens", [
    (2, 4, 32, [13, 6, 1]),
    (4, 12, 64, [150, 70, 129]),  # past one 64-key tile
    (1, 8, 32, [65, 64, 2]),
    (1, 10, 16, [13, 100, 1]),  # 10 per kv head: the dot-and-axpy loop
    (2, 4, 12, [40, 7, 1]),  # hd not a multiple of 16: the dot-and-axpy loop
])
def test_paged_attention_over_stored_rows_equals_float32_over_the_widened(fmt, kvh, heads, hd,
                                                                           lens):
    g, tpb = _gen(2), 4
    nb = -(-max(lens) // tpb)
    blocks = 3 * nb + 2
    pool, wide = _pools(fmt, blocks, tpb, kvh, hd, g)
    perm = torch.randperm(blocks - 1, generator=g) + 1
    tables = torch.stack([perm[i * nb:(i + 1) * nb] for i in range(3)])
    lens_t = torch.tensor(lens)
    q = torch.randn(3, heads, hd, generator=g)
    k, v = torch.randn(3, kvh, hd, generator=g), torch.randn(3, kvh, hd, generator=g)
    kq, vq = paged.stored_rows(pool, k), paged.stored_rows(pool, v)
    _, code = FORMATS[fmt]
    before = pool.clone()
    got = K.paged_attention_q(q, kq.view(torch.uint8), vq.view(torch.uint8),
                              pool.view(torch.uint8), tables, lens_t, hd ** -0.5, None, code)
    # the new rows are written as `stored_rows` gives them, nothing else moved
    pos = lens_t - 1
    blk = tables[torch.arange(3), pos // tpb]
    want_pool = before.clone()
    want_pool.view(torch.uint8)[blk, 0, pos % tpb] = kq.view(torch.uint8).view(3, kvh, -1)
    want_pool.view(torch.uint8)[blk, 1, pos % tpb] = vq.view(torch.uint8).view(3, kvh, -1)
    assert torch.equal(pool.view(torch.uint8), want_pool.view(torch.uint8))
    kw, vw = (paged.dequantize(t.view(3, kvh, -1), hd).contiguous() for t in (kq, vq))
    ref_pool = wide.clone()
    ref = K.paged_attention(q, kw, vw, ref_pool, tables, lens_t, hd ** -0.5, None)
    assert torch.equal(ref_pool, paged.dequantize(
        pool.view(torch.uint8) if pool.dtype == FP8 else pool, hd))  # the same values written
    assert torch.equal(got, ref)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for i in range(3):  # alone (at 2 threads split over its kv heads): its batch row
                p = want_pool.clone()
                alone = K.paged_attention_q(q[i:i + 1], kq[i:i + 1].view(torch.uint8),
                                            vq[i:i + 1].view(torch.uint8), p.view(torch.uint8),
                                            tables[i:i + 1], lens_t[i:i + 1], hd ** -0.5, None,
                                            code)
                assert torch.equal(alone[0], got[i])
    finally:
        torch.set_num_threads(old)


@needs_kernels
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", [(1, 200, 4, 2, 32), (2, 37, 12, 4, 64), (1, 90, 4, 4, 24),
                                   (2, 19, 8, 1, 12)])
def test_prefill_attention_over_stored_rows_equals_float32_over_the_widened(fmt, shape):
    n, T, H, Hk, D = shape
    g = _gen(7)
    starts = [0, 40][:n]
    S = max(starts) + T
    q = torch.randn(n, T, H, D, generator=g)
    dt, code = FORMATS[fmt]
    x = torch.randn(2, n, Hk, S, D, generator=g)
    rows = paged.quantize_fp8(x) if dt == FP8 else x.to(dt).view(torch.uint8)
    wide = paged.dequantize(rows if dt == FP8 else rows.view(dt), D)
    pos = torch.arange(T)[None, :] + torch.tensor(starts)[:, None]
    got = K.prefill_attention_q(q, rows[0], rows[1], pos, D ** -0.5, code)
    assert torch.equal(got, K.prefill_attention(q, wide[0], wide[1], pos, D ** -0.5))


@needs_kernels
def test_every_fp8_byte_widens_as_torch_widens_it():
    """All 254 finite e4m3 values (subnormals, zeros of both signs, +-448) in the rows the
    kernels read, at a few scales: prefill over them equals float32 prefill over torch's
    widening (so each value, vectorised or not, is torch's value times the scale)."""
    vals = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    D, S = 48, 16  # 3 vectors of 16 and a tail, per row
    g = _gen(9)
    byts = vals[torch.randint(0, vals.numel(), (2, 1, 1, S, D), generator=g)]
    scale = torch.tensor([1.0, 2.0 ** -20, 3.5, 1e30])[torch.arange(S) % 4]
    rows = torch.cat([byts, scale.view(1, 1, 1, S, 1).expand(2, 1, 1, S, 1).contiguous()
                      .view(torch.uint8).view(2, 1, 1, S, 4)], dim=-1)
    rows[..., 0, :D] = vals[:D]  # the first key: the values in order
    wide = paged.dequantize(rows, D)
    q = torch.randn(1, S, 2, D, generator=g) * 1e-3
    pos = torch.arange(S)[None]
    got = K.prefill_attention_q(q, rows[0], rows[1], pos, D ** -0.5, 2)
    assert torch.equal(got, K.prefill_attention(q, wide[0], wide[1], pos, D ** -0.5))


@needs_kernels
def test_prefill_over_fp8_rows_does_not_depend_on_the_chunking():
    T, H, Hk, D = 150, 8, 2, 32
    g = _gen(8)
    q = torch.randn(1, T, H, D, generator=g)
    rows = paged.quantize_fp8(torch.randn(2, 1, Hk, T, D, generator=g))
    pos = torch.arange(T)[None]
    whole = K.prefill_attention_q(q, rows[0], rows[1], pos, D ** -0.5, 2)
    parts, s = [], 0
    for e in (1, 64, 65, 149, T):
        parts.append(K.prefill_attention_q(q[:, s:e], rows[0, :, :, :e], rows[1, :, :, :e],
                                           pos[:, s:e], D ** -0.5, 2))
        s = e
    assert torch.equal(torch.cat(parts, 1), whole)


@needs_kernels
def test_the_kernels_refuse_what_they_do_not_take():
    q = torch.randn(1, 4, 16)
    pool = torch.zeros(2, 2, 4, 1, 20, dtype=torch.uint8)
    kq = torch.zeros(1, 20, dtype=torch.uint8)
    t, lens = torch.tensor([[0]]), torch.tensor([1])
    with pytest.raises(RuntimeError, match="fmt 1 \\(bf16\\) or 2 \\(fp8\\)"):
        K.paged_attention_q(q, kq, kq, pool, t, lens, 1.0, None, 0)
    with pytest.raises(RuntimeError, match="pool rows must be 32 bytes"):
        K.paged_attention_q(q, kq, kq, pool, t, lens, 1.0, None, 1)
    with pytest.raises(RuntimeError, match="must be bytes"):
        K.paged_attention_q(q, kq.float(), kq, pool, t, lens, 1.0, None, 2)


def test_tp_shards_of_fp8_kv_take_each_heads_scale_along():
    """A TP rank's KV shard is its heads' rows, each [head_dim values | scale]: the bytes a
    rank's fp8 pool block holds, which the TP handoff plans move."""
    from baton.model.nemotron_h.config import ModelConfig
    from baton.model.pools import PoolSpec
    from baton.model.tp_shard import model_shards

    cfg = ModelConfig.from_dict(dict(
        vocab_size=64, hidden_size=32, hybrid_override_pattern="M*M-", num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=4,
        ssm_state_size=4, n_groups=2))
    (kv, *_) = model_shards(cfg, 2, "float32", 16, "float8_e4m3fn")
    assert kv.name == "kv" and kv.shape == (2, 16, 2, cfg.head_dim + 4) and kv.itemsize == 1
    rank = PoolSpec(attn_layers=(1,), state_layers=(), num_blocks=1, tokens_per_block=16,
                    num_kv_heads=1, head_dim=cfg.head_dim, num_slots=0, state_tensors=(),
                    kv_dtype=FP8)
    assert kv.local_bytes == rank.kv_bytes_per_block()
    (f32, *_) = model_shards(cfg, 2, "float32", 16)
    assert f32.shape == (2, 16, 2, cfg.head_dim) and f32.itemsize == 4
