"""NemotronH's relu2 MLP squares up_proj's output in place where nothing else can see it: the
same bits as the out-of-place activation, and never in place on a view or under autograd."""

from __future__ import annotations

import torch

from baton.model.layers.mlp import MLP, _relu2


def _mlp(model_tiny):
    mlps = [m for m in model_tiny.modules() if type(m) is MLP]
    assert mlps and mlps[0].act is _relu2
    return mlps[0]


def test_in_place_relu2_gives_the_out_of_place_bits(model_tiny):
    mlp = _mlp(model_tiny)
    x = torch.randn(37, mlp.up_proj.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = mlp.down_proj(torch.square(torch.relu(mlp.up_proj(x))))
    with torch.inference_mode():
        got = mlp(x)
    assert torch.equal(got, want)
    assert (torch.relu(mlp.up_proj.weight.detach()) != 0).any()  # the activation does cut


def test_a_view_or_a_grad_is_never_changed_in_place(model_tiny, monkeypatch):
    mlp = _mlp(model_tiny)
    x = torch.randn(5, mlp.up_proj.in_features, generator=torch.Generator().manual_seed(1))
    seen = []
    wide = torch.randn(5, 2 * mlp.up_proj.out_features)
    view = wide[:, : mlp.up_proj.out_features]  # up_proj handing back a view of a buffer
    monkeypatch.setattr(mlp.up_proj, "forward", lambda t: seen.append(t) or view)
    before = wide.clone()
    with torch.inference_mode():
        mlp(x)
    assert torch.equal(wide, before)
    fresh = torch.randn(5, mlp.up_proj.out_features)  # not a view, but autograd is on
    kept = fresh.clone()
    monkeypatch.setattr(mlp.up_proj, "forward", lambda t: seen.append(t) or fresh)
    with torch.enable_grad():
        mlp(x)
    assert torch.equal(fresh, kept) and len(seen) == 2
