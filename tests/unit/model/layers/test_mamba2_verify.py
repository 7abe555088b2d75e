"""The uniform verify path of a Mamba2 layer (baton/model/layers/mamba2_verify.py): its
multi-position SSD step is bit for bit m one-token steps, on both decode paths."""

from __future__ import annotations

import pytest
import torch

from baton.model.layers.linear import set_decode_path
from baton.model.layers.mamba2_verify import ssd_steps_
from baton.model.layers.ssd import ssd_step_


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_ssd_steps_equal_one_token_steps_bit_for_bit(path):
    g = torch.Generator().manual_seed(3)
    b, m, H, P, G, N = 2, 4, 6, 8, 2, 16
    x = torch.randn(b, m, H, P, generator=g)
    dt = torch.rand(b, m, H, generator=g) * 0.1
    A = -torch.rand(H, generator=g) * 4
    B, C = torch.randn(b, m, G, N, generator=g), torch.randn(b, m, G, N, generator=g)
    D = torch.randn(H, generator=g)
    s0 = torch.randn(b, H, P, N, generator=g)
    old = set_decode_path(path)
    try:
        ref, ys, saved = s0.clone(), [], []
        for j in range(m):
            ys.append(ssd_step_(ref, x[:, j], dt[:, j], A, B[:, j], C[:, j], D))
            saved.append(ref.clone())
        got = s0.clone()
        seen = []
        y = ssd_steps_(got, x, dt, A, B, C, D, lambda j, s: seen.append((j, s.clone())))
    finally:
        set_decode_path(old)
    assert torch.equal(y, torch.stack(ys, dim=1))
    assert torch.equal(got, saved[-1])
    assert [j for j, _ in seen] == list(range(m - 1))
    assert all(torch.equal(s, saved[j]) for j, s in seen)
