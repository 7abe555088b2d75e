"""The fast path's direct layer calls (`baton.model.layers.fast_decode`) against the module
path they replace, bit for bit.

For every family (NemotronH: Mamba2, attention, MLP; Qwen3.5: DeltaNet, gated attention,
SwiGLU; both with MoE blocks) and weights in float32 and float16: three prompts prefilled,
then six decode steps at batch 3 and at batch 1 from the same pool contents, once with the
layers called directly and once through their modules (`fast_decode.applies` off): every
step's logits, every state slot and the KV pool must be equal (`torch.equal`). And the glue
kernels alone: `swiglu` equals `F.silu(gate) * up` on the column views at widths with and
without a tail, `linear`'s residual and relu2 equal torch's add and square(relu), and
`linear_split` equals `linear_cat`'s column views.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.model.layers import cpu_kernels, fast_decode, linear, step_kernels
from tests.support.engine_helpers import decode_rows, engine_for, make_checkpoint, prompt

pytestmark = pytest.mark.skipif(cpu_kernels.gemv() is None or step_kernels.kernels() is None,
                                reason="kernels not built")

FAMILIES = {"nemotron_h": {}, "qwen3_5": {}, "qwen3_5_moe": {},
            "nemotron_h_moe": {"family": "nemotron_h", "pattern": "ME*EME"}}
LENGTHS = (20, 35, 7)
STEPS = 6


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_dir(request, tmp_path_factory):
    fields = FAMILIES[request.param] or {"family": request.param}
    return make_checkpoint(tmp_path_factory.mktemp(f"fastlayers-{request.param}"), **fields)


def _snapshot(pools) -> list[torch.Tensor]:
    return [t.clone() for t in (*pools.state.values(), *([pools.kv] if pools.has_kv else []))]


def _restore(pools, saved: list[torch.Tensor]) -> None:
    for t, s in zip((*pools.state.values(), *([pools.kv] if pools.has_kv else [])), saved,
                    strict=True):
        t.copy_(s)


def _decode(model, pools, rows: list[int], direct: bool) -> list[torch.Tensor]:
    """STEPS decode steps of the sequences `rows` (their logits), layers called directly or
    through their modules."""
    return decode_rows(model, pools, rows, LENGTHS, STEPS, seed=50, direct=direct)


@pytest.mark.parametrize("weights", ["float32", "float16"])
def test_direct_layers_equal_module_path(model_dir, weights):
    assert linear.decode_path() == "fast"
    model = engine_for(model_dir, model={"weight_dtype": weights}).model
    pools = model.make_pools(num_blocks=16, tokens_per_block=16, num_slots=4)
    for i, n in enumerate(LENGTHS):
        model.prefill(torch.tensor(prompt(i, n)), 0, list(range(4 * i, 4 * i + 4)), i, pools)
    start = _snapshot(pools)
    for rows in ([0, 1, 2], [1]):
        _restore(pools, start)
        with linear.decode_scope():  # the direct calls are taken (else this checks nothing)
            assert fast_decode.applies(torch.zeros(1, 1), pools)
        direct = _decode(model, pools, rows, direct=True)
        after = _snapshot(pools)
        _restore(pools, start)
        modules = _decode(model, pools, rows, direct=False)
        assert all(torch.equal(a, b) for a, b in zip(direct, modules, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(after, _snapshot(pools), strict=True))


@pytest.mark.parametrize("width", [1280, 48, 47, 17])
@pytest.mark.parametrize("rows", [1, 5])
def test_swiglu_is_torchs(width, rows):
    gu = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    want = F.silu(gu[:, :width]) * gu[:, width:]
    assert torch.equal(step_kernels.kernels().swiglu(gu), want)


@pytest.mark.parametrize("rows", [1, 5])
def test_linear_glue_is_torchs(rows):
    g, gen = cpu_kernels.gemv(), torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(72, 96, generator=gen)
    r, b = torch.randn(rows, 72, generator=gen), torch.randn(72, generator=gen)
    assert torch.equal(g.linear(x, w, b, residual=r), r + g.linear(x, w, b))
    assert torch.equal(g.linear(x, w, relu2=True), torch.square(F.relu(g.linear(x, w))))
    ws = [torch.randn(n, 96, generator=gen) for n in (40, 8, 3)]
    cat, lo = g.linear_cat(x, ws), 0
    for y, wi in zip(g.linear_split(x, ws), ws, strict=True):
        assert y.is_contiguous() and torch.equal(y, cat[:, lo:lo + wi.shape[0]])
        lo += wi.shape[0]


@pytest.mark.parametrize("n", [1024, 3072, 47, 16])
def test_gate_sigmoid_is_torchs(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 6
    assert torch.equal(step_kernels.kernels().sigmoid(x), torch.sigmoid(x))


def test_rms_norm_reads_rows_at_any_strides():
    """Qwen's q at batch > 1: every other hd-run of a wider projection's rows, normed as each
    row alone (the kernel, not torch's fallback: a row's bits do not depend on its batch)."""
    s, gen = step_kernels.kernels(), torch.Generator().manual_seed(2)
    y, w = torch.randn(3, 2048 + 512, generator=gen), torch.rand(128, generator=gen) + 0.5
    q = y[:, :2048].view(3, 8, 256).chunk(2, dim=-1)[0]
    both = s.rms_norm(q, w, 1e-6)
    for i in range(3):
        assert torch.equal(both[i], s.rms_norm(q[i:i + 1].contiguous(), w, 1e-6)[0])
