"""What a worker reports as its load: free blocks count evictable ones, as the proto says."""

from __future__ import annotations

from types import SimpleNamespace

from baton.engine.request import Request
from baton.worker.load import load_of
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all


def test_free_blocks_count_the_evictable_prefix_cache(tmp_path):
    eng = engine_for(make_checkpoint(tmp_path), cache={"num_blocks": 64, "mamba_state_config": {
        "periodic_snapshot_interval": 16, "decode_end_snapshot": True}})
    loop = SimpleNamespace(engine=eng)
    assert load_of(loop).free_blocks == 64
    run_all(eng, [Request("a", prompt(1, 70), greedy(4))])
    cached = eng.cache.tree.num_evictable_blocks
    assert cached > 0 and eng.cache.num_free_blocks == 64 - cached  # the cache kept blocks
    load = load_of(loop)
    assert (load.free_blocks, load.total_blocks) == (64, 64)  # all of them evictable
    eng.add_request(Request("b", prompt(2, 40), greedy(4)))
    eng.step()  # b holds its prompt blocks now
    held = len(eng.cache.block_table("b"))
    assert held > 0 and load_of(loop).free_blocks == 64 - held
