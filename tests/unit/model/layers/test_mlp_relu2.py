"""NemotronH's relu2 (its MLP's and its routed experts') squares a matmul's output in place
where nothing else can see it: the same bits as the out-of-place activation, and never in place
on a view or under autograd."""

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


def test_routed_experts_relu2_in_place_gives_the_out_of_place_bits(monkeypatch):
    from baton.model.layers import moe

    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, 8, generator=g)
    up, down = torch.randn(4, 6, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    experts = torch.randint(0, 4, (11, 2), generator=g)
    routing = moe.Routing(experts, torch.rand(11, 2, generator=g))
    monkeypatch.setattr(moe, "_kernel", lambda *a: None)  # the torch.mm path (prefill's)
    with torch.inference_mode():
        got, counts = moe.run_experts(x, routing, up, down, _relu2)
    with torch.no_grad():  # the reference: every pair alone, out of place
        want = torch.zeros(11, 8)
        for t in range(11):
            for j in range(2):
                e = int(experts[t, j])
                want[t] += routing.weights[t, j] * (torch.square(torch.relu(x[t] @ up[e].t()))
                                                    @ down[e].t())
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(moe, "activate", lambda act, h: act(h))  # never in place
    with torch.inference_mode():
        assert torch.equal(moe.run_experts(x, routing, up, down, _relu2)[0], got)
    assert counts.tolist() == torch.bincount(experts.flatten(), minlength=4).tolist()
