"""The engine's in-place decode metadata (baton/engine/decode_batch.py): after every step of a
workload where requests join and leave and sequences cross block boundaries, the tensors it
hands the model equal a rebuild from the requests and the cache's lists (what the engine built
before), and the tokens equal an engine that builds them afresh every step."""

from __future__ import annotations

import pytest
import torch

from baton.engine.request import Request
from baton.model.paged import _tables
from tests.support.engine_helpers import (
    engine_for,
    greedy,
    make_checkpoint,
    prompt,
    run_staggered,
    staggered,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("decode-batch"))


def _engine(model_dir):
    return engine_for(model_dir, worker={"max_num_seqs": 6, "prefill_chunk_size": 8},
                      cache={"tokens_per_block": 4})


def _run(eng) -> dict[str, list[int]]:
    """12 staggered requests (`staggered`: many block crossings, batches of every size)."""
    return run_staggered(eng, staggered(), 200)


def test_in_place_metadata_equals_a_rebuild_every_step(model_dir):
    eng = _engine(model_dir)
    assert eng.batch is not None
    update, checked = eng.batch.update, []

    def checked_update(reqs):
        ids, pos, tables, slots = update(reqs)
        want_pos = [r.num_computed for r in reqs]
        assert ids.tolist() == [r.output_ids[-1] for r in reqs]
        assert pos.tolist() == want_pos
        assert slots.tolist() == [eng.cache.slot(r.id) for r in reqs]
        want = _tables([eng.cache.block_table(r.id) for r in reqs], [p + 1 for p in want_pos],
                       eng.pools)
        assert tables.shape == want.shape and torch.equal(tables, want)
        checked.append(len(reqs))
        return ids, pos, tables, slots

    eng.batch.update = checked_update
    tokens = _run(eng)
    # the workload is what it claims: many steps, most of them moved on in place, batches
    # that grew and shrank, sequences that crossed into new blocks
    assert len(checked) > 60 and eng.batch.rebuilds < len(checked) / 2
    assert max(checked) == 6 and min(checked) == 1
    assert eng.batch.tables.shape[1] >= 8
    assert sum(map(len, tokens.values())) > 150

    fresh = _engine(model_dir)
    fresh.batch = None  # the lists the engine built every step before
    assert _run(fresh) == tokens


def test_same_members_moved_on_by_more_than_one_step_are_rebuilt(model_dir):
    """The same requests in the same order whose positions moved on by more than this path's
    one step since its last update (a speculative step in between): rebuilt from the
    requests, not advanced by one."""
    eng = _engine(model_dir)
    reqs = [Request(f"s{i}", prompt(40 + i, 5 + 3 * i), greedy(30)) for i in range(3)]
    for r in reqs:
        eng.add_request(r)
    while any(r.num_computed < len(r.prompt_ids) or not r.output_ids for r in reqs):
        eng.step()
    for r in reqs:
        eng.cache.ensure_blocks(r.id, r.num_computed + 8)
    batch = eng.batch
    batch.update(reqs)
    rebuilds = batch.rebuilds
    for r in reqs:  # as a verify pass that accepted 2 drafts + 1 token would leave them
        r.num_computed += 3
    _, pos, tables, _ = batch.update(reqs)
    assert batch.rebuilds == rebuilds + 1
    assert pos.tolist() == [r.num_computed for r in reqs]
    want = _tables([eng.cache.block_table(r.id) for r in reqs],
                   [r.num_computed + 1 for r in reqs], eng.pools)
    assert torch.equal(tables, want)
    for r in reqs:  # one step on from there: advanced in place
        r.num_computed += 1
    _, pos, _, _ = batch.update(reqs)
    assert batch.rebuilds == rebuilds + 1 and pos.tolist() == [r.num_computed for r in reqs]
