"""Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba` split into Qwen3.5's projections
give exactly the q, k, v, z, b, a transformers' `fix_query_key_value_ordering` derives."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from baton.model.qwen3_next.convert import split_ba, split_qkvz  # noqa: E402


@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 6), (4, 8)])
def test_split_matches_fix_query_key_value_ordering(hk, hv):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cfg = transformers.Qwen3NextConfig(
        hidden_size=32, linear_num_key_heads=hk, linear_num_value_heads=hv,
        linear_key_head_dim=8, linear_value_head_dim=4, num_experts=4,
    )
    gdn = Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    torch.manual_seed(hk * 10 + hv)
    torch.nn.init.normal_(gdn.in_proj_qkvz.weight)
    torch.nn.init.normal_(gdn.in_proj_ba.weight)
    # the identity as 32 tokens: each projection's output row t is its weight's column t,
    # exactly (one product by 1, the rest by 0), so the split rows must equal them bit for bit
    # (random inputs round differently through one matmul and the split ones)
    x = torch.eye(32).reshape(1, 32, 32)
    with torch.no_grad():
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x),
                                                            gdn.in_proj_ba(x))
    want_qkv = torch.cat([t.reshape(32, -1) for t in (q, k, v)], dim=-1)
    w_qkv, w_z = split_qkvz(gdn.in_proj_qkvz.weight.detach(), hk, 8, hv, 4)
    w_b, w_a = split_ba(gdn.in_proj_ba.weight.detach(), hk, hv)
    assert torch.equal(w_qkv.T, want_qkv)
    assert torch.equal(w_z.T, z.reshape(32, -1))
    assert torch.equal(w_b.T, b.reshape(32, -1))
    assert torch.equal(w_a.T, a.reshape(32, -1))
    assert w_qkv.shape == (2 * hk * 8 + hv * 4, 32) and w_b.shape == (hv, 32)
