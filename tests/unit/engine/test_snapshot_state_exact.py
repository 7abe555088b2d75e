"""Every snapshot the policy takes restores exactly the state a full recompute gives: for each
point (periodic, offsets from start and end, the prompt's end, the decode end), whatever the
prefill chunking, the restored recurrent state (every declared tensor) and KV equal a one-shot
prefill of those tokens, for NemotronH and Qwen3.5."""

from __future__ import annotations

import pytest
import torch

from baton.engine.request import Request
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

POLICY = {"periodic_snapshot_interval": 32, "additional_snapshot_offsets_from_start": [20, 65],
          "additional_snapshot_offsets_from_end": [0, 5], "decode_end_snapshot": True}
TPB = 16
TOL = 1e-5


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"snap-{request.param}")
    if request.param == "qwen3_5":
        return make_checkpoint(root, "qwen", family="qwen3_5", pattern="GG*G", seed=4)
    return make_checkpoint(root, pattern="M*M-M", seed=4)


def _recompute(model, ids: list[int]):
    """(state per tensor [layers, ...], KV [layers, p, 2, ...]) of a one-shot prefill."""
    n = -(-len(ids) // TPB)
    pools = model.make_pools(n, TPB, 1)
    model.prefill(torch.tensor(ids), 0, list(range(n)), 0, pools)
    return {k: v[:, 0] for k, v in pools.state.items()}, _kv(pools, list(range(n)), len(ids))


def _kv(pools, table: list[int], p: int) -> torch.Tensor:
    if not pools.has_kv:
        return torch.zeros(0)
    kv = pools.kv[:, table].transpose(2, 3)  # [layers, blocks, tpb, 2, heads, hd]
    return kv.reshape(kv.shape[0], -1, *kv.shape[3:])[:, :p]


@pytest.mark.parametrize("chunk", [7, 32, 64])
def test_every_snapshot_restores_the_recomputed_state(model_dir, chunk):
    eng = engine_for(model_dir, worker={"prefill_chunk_size": chunk, "max_batch_tokens": chunk},
                     cache={"tokens_per_block": TPB, "mamba_state_config": POLICY})
    ids = prompt(11, 90)
    out = run_all(eng, [Request("r", ids, greedy(6))])["tokens"]["r"]
    points = eng.cache.snapshot_points(len(ids))
    assert points == [20, 32, 64, 65, 85, 90]
    full = ids + out
    held = []
    for p in range(1, len(full) + 1):
        adm = eng.cache.hold_snapshot(f"h{p}", full[:p])
        if adm is None:
            continue
        held.append(p)
        state, kv = _recompute(eng.model, full[:p])
        for name, want in state.items():
            got = eng.pools.state[name][:, adm.slot]
            assert torch.allclose(got, want, atol=TOL, rtol=0), (p, name)
        assert torch.allclose(_kv(eng.pools, adm.block_table, p), kv, atol=TOL, rtol=0), p
        eng.cache.abort(f"h{p}")
    # every policy point, except 85: within one block only the latest partial snapshot is
    # kept (90 replaces it); then the decode end (prompt + all 6 answer tokens)
    assert held == [20, 32, 64, 65, 90, 96], held
    eng.cache.check_integrity()
