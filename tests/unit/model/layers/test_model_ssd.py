"""The chunked SSD scan against the one-token recurrence it must reproduce."""

from __future__ import annotations

import pytest
import torch

from baton.model.layers import step_kernels
from baton.model.layers.ssd import segment_sum, ssd_scan, ssd_step
from baton.model.layers.ssd_fast import ssd_scan_fast

pytestmark = pytest.mark.usefixtures("model_single_thread")


def _inputs(T, H=4, P=3, G=2, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=g)
    dt = torch.rand(T, H, generator=g) * 0.5
    A = -torch.rand(H, generator=g) * 3
    B = torch.randn(T, G, N, generator=g)
    C = torch.randn(T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    state = torch.randn(H, P, N, generator=g)
    return x, dt, A, B, C, D, state


def _loop(x, dt, A, B, C, D, state):
    ys = []
    s = state[None]
    for t in range(x.shape[0]):
        y, s = ssd_step(s, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D)
        ys.append(y[0])
    return torch.stack(ys), s[0]


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (8, 4), (23, 8), (23, 64)])
def test_scan_equals_step_loop_from_a_state(T, chunk):
    x, dt, A, B, C, D, state = _inputs(T)
    y, final = ssd_scan(x, dt, A, B, C, D, chunk, state)
    y_ref, final_ref = _loop(x, dt, A, B, C, D, state)
    assert torch.allclose(y, y_ref, atol=1e-5)
    assert torch.allclose(final, final_ref, atol=1e-5)


def test_scan_without_state_starts_from_zeros():
    x, dt, A, B, C, D, state = _inputs(10, seed=1)
    a, fa = ssd_scan(x, dt, A, B, C, D, 4, None)
    b, fb = ssd_scan(x, dt, A, B, C, D, 4, torch.zeros_like(state))
    assert torch.equal(a, b) and torch.equal(fa, fb)


def test_segment_sum():
    out = segment_sum(torch.tensor([1.0, 2.0, 3.0]))
    inf = float("inf")
    assert out.tolist() == [[0.0, -inf, -inf], [2.0, 0.0, -inf], [5.0, 3.0, 0.0]]


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("P", [3, 16])
@pytest.mark.parametrize("T,chunk,with_state", [(1, 4, True), (7, 4, False), (8, 4, True),
                                                (23, 8, True), (23, 64, False)])
def test_fast_scan_equals_step_loop(T, chunk, with_state, P, kernel, monkeypatch):
    """The fast path's scan (per group, chunks of its own size, states carried in order), with
    its C++ kernels and without, against the recurrence; a batch of two, each as alone. Head
    size 16 takes the outputs' fused decay matmul (`decay_matmul`), 3 the decay matrix and a
    batched matmul."""
    if not kernel:
        monkeypatch.setattr(step_kernels, "kernels", lambda: None)
    xs, fins = [], []
    for seed in (2, 3):
        x, dt, A, B, C, D, state = _inputs(T, H=6, P=P, G=3, seed=seed)
        g = torch.Generator().manual_seed(9)  # A and D shared by the batch
        A, D = -torch.rand(6, generator=g) * 3, torch.randn(6, generator=g)
        state = state if with_state else torch.zeros_like(state)
        y_ref, final_ref = _loop(x, dt, A, B, C, D, state)
        xs.append((x, dt, B, C, state))
        fins.append((y_ref, final_ref))
    stack = [torch.stack(t) for t in zip(*xs, strict=True)]
    y, final = ssd_scan_fast(stack[0], stack[1], A, stack[2], stack[3], D,
                             stack[4] if with_state else None, chunk)
    assert y.is_contiguous()  # the mixer views it as [rows, H * P]
    for i, (y_ref, final_ref) in enumerate(fins):
        assert torch.allclose(y[i], y_ref, atol=1e-5)
        assert torch.allclose(final[i], final_ref, atol=1e-5)
