"""The layer runner (`DecodeLayers`, step_kernels/layers.cpp) that `fast_decode` hands a
decode step's layers to: how a model's parts become programs and module fallbacks, that a
plan with fallbacks between programs gives the module path's bits, that a changed norm
weight or new weights rebuild it, and that a malformed part is refused before it runs.

(The runner with every part covered is what tests/unit/model/layers/test_fast_decode_layers.py and the
decode tests check bit for bit against the module path for every family.)
"""

from __future__ import annotations

import pytest
import torch

from baton.model.layers import cpu_kernels, fast_blocks, fast_decode, step_kernels
from baton.model.nemotron_h.model import nemotron_parts
from baton.model.qwen3_5.model import qwen_parts
from tests.support.engine_helpers import decode_rows, engine_for, make_checkpoint, prompt

pytestmark = pytest.mark.skipif(cpu_kernels.gemv() is None or step_kernels.kernels() is None,
                                reason="kernels not built")

LENGTHS = (20, 35, 7)


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def model(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(f"runner-{request.param}"),
                           family=request.param)
    return engine_for(path).model


def _layers(model):
    return model.model.layers if hasattr(model, "model") else model.backbone.layers


def _pools(model):
    pools = model.make_pools(num_blocks=16, tokens_per_block=16, num_slots=4)
    for i, n in enumerate(LENGTHS):
        model.prefill(torch.tensor(prompt(i, n)), 0, list(range(4 * i, 4 * i + 4)), i, pools)
    return pools


def _state(pools) -> list[torch.Tensor]:
    return [t.clone() for t in (*pools.state.values(), *([pools.kv] if pools.has_kv else []))]


def _steps(model, pools, fast: bool, n: int = 4) -> list[torch.Tensor]:
    return decode_rows(model, pools, list(range(len(LENGTHS))), LENGTHS, n, seed=70,
                       direct=fast)


def _segments(model) -> list[tuple[str, int]]:
    """The plan's segments: ("program", parts) or ("module", 1) each."""
    plan = _layers(model).__dict__["_baton_plan"]
    return [("program", len(run.__self__)) if is_program else ("module", 1)
            for run, is_program in plan.segments]


def _same_as_modules(model):
    """Decode steps through the plan equal the module path's: logits, state slots, KV."""
    pools = _pools(model)
    start = _state(pools)
    fast = _steps(model, pools, fast=True)
    after = _state(pools)
    for t, s in zip((*pools.state.values(), *([pools.kv] if pools.has_kv else [])), start,
                    strict=True):
        t.copy_(s)
    slow = _steps(model, pools, fast=False)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after, _state(pools), strict=True))


def _parts(model) -> int:
    parts = qwen_parts if hasattr(model, "model") else nemotron_parts
    return sum(len(parts(layer)) for layer in _layers(model))


def test_covered_model_is_one_program(model):
    _layers(model).__dict__.pop("_baton_plan", None)
    _same_as_modules(model)
    assert _segments(model) == [("program", _parts(model))]


def test_uncovered_parts_run_their_modules_between_programs(model, monkeypatch):
    """Parts 1 and 2 (a feed-forward and a mixer for Qwen3.5; two blocks for NemotronH) get no
    body: the plan is program [0], their two modules, program [3..], with the same bits."""
    seen = []
    mixer_part, mlp_part = fast_blocks.mixer_part, fast_blocks.mlp_part

    def counted(build):
        def part(*a):
            seen.append(len(seen))
            return None if len(seen) - 1 in (1, 2) else build(*a)
        return part

    monkeypatch.setattr(fast_decode, "mixer_part", counted(mixer_part))
    monkeypatch.setattr(fast_decode, "mlp_part", counted(mlp_part))
    _layers(model).__dict__.pop("_baton_plan", None)
    _same_as_modules(model)
    n = _parts(model)
    assert _segments(model) == [("program", 1), ("module", 1), ("module", 1),
                                ("program", n - 3)]
    assert len(seen) == n  # every part was offered once
    monkeypatch.undo()
    _layers(model).__dict__.pop("_baton_plan", None)


def test_plan_is_rebuilt_when_a_norm_changes_in_place(model):
    layers = _layers(model)
    layers.__dict__.pop("_baton_plan", None)
    pools = _pools(model)
    _steps(model, pools, fast=True, n=1)
    first = layers.__dict__["_baton_plan"]
    _steps(model, pools, fast=True, n=1)
    assert layers.__dict__["_baton_plan"] is first  # nothing changed: the same plan
    norm = (layers[0].input_layernorm if hasattr(model, "model") else layers[0].norm).weight
    saved = norm.detach().clone()
    try:
        with torch.no_grad():
            norm.mul_(1.5)
        _steps(model, pools, fast=True, n=1)
        assert layers.__dict__["_baton_plan"] is not first
        _same_as_modules(model)  # with the changed weight, the same bits as the modules
    finally:
        with torch.no_grad():
            norm.copy_(saved)


def _ffn(model):
    """A feed-forward Body of `model` and its norm (weight, eps) as the plan passes them."""
    for layer in _layers(model):
        for w, eps, _, m, mixer in (qwen_parts(layer) if hasattr(model, "model")
                                    else nemotron_parts(layer)):
            if not mixer:
                return w, eps, fast_blocks.mlp_part(m)
    raise AssertionError("no feed-forward part")


def test_malformed_parts_are_refused(model):
    w, eps, body = _ffn(model)
    runner = step_kernels.kernels().DecodeLayers(cpu_kernels.gemv().api())
    with pytest.raises(RuntimeError, match="no part kind 9"):
        runner.add(9, [w], [], [eps])
    with pytest.raises(RuntimeError, match=f"part kind {body.kind} takes"):
        runner.add(body.kind, [w, *body.tensors[:-1]], body.ints, [eps, *body.floats])
    with pytest.raises(RuntimeError, match=f"part kind {body.kind} needs tensor 1"):
        runner.add(body.kind, [w, None, *body.tensors[1:]], body.ints, [eps, *body.floats])
    assert len(runner) == 0
    with pytest.raises(RuntimeError, match="api\\(\\) capsule"):
        step_kernels.kernels().DecodeLayers(_capsule())
    runner.add(body.kind, [w, *body.tensors], body.ints, [eps, *body.floats])
    assert len(runner) == 1
    with pytest.raises(RuntimeError, match="no part 1"):
        runner.body(1, torch.zeros(1, w.numel()), torch.zeros(1, w.numel()))


def _capsule():
    """A capsule that is not the gemv module's table."""
    import ctypes

    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                   ctypes.c_void_p]
    return new(ctypes.addressof(ctypes.c_int(1)), b"something.else", None)
