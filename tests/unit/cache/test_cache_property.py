"""Random request lifecycles keep the manager consistent and every restore exact.

A fake model writes, for each token position, a value that identifies the whole prefix
up to it (KV) and, at each chunk end, the value of the prefix computed so far (state).
An admission must then see exactly the prefix values of what it claims to have cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.cache.manager import HybridCacheManager
from baton.config.cache import CacheConfig, MambaStateConfig
from baton.errors import CapacityError
from baton.model.pools import Pools, PoolSpec
from tests.unit.cache.test_cache_manager import MODEL

TPB = 4


def prefix_values(tokens: list[int]) -> list[float]:
    """values[i] identifies tokens[:i+1]; exact in float32 (< 2**24)."""
    out, h = [], 7
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
        out.append(float(h))
    return out


@dataclass
class Sim:
    m: HybridCacheManager
    tokens: dict[str, list[int]] = field(default_factory=dict)
    prompt_len: dict[str, int] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)

    def compute(self, rid: str, end: int) -> None:
        m, toks = self.m, self.tokens[rid]
        vals, table, slot = prefix_values(toks[:end]), m.block_table(rid), m.slot(rid)
        for i in range(self.computed[rid], end if m.pools.has_kv else 0):
            m.pools.kv[:, table[i // TPB], :, i % TPB] = vals[i]
        if m.pools.has_state:
            m.pools.conv[:, slot] = vals[end - 1]
            m.pools.ssm[:, slot] = vals[end - 1]
        self.computed[rid] = end

    def check_restored(self, rid: str, cached: int, state: bool = True) -> None:
        m, toks = self.m, self.tokens[rid]
        vals, table, slot = prefix_values(toks[:cached]), m.block_table(rid), m.slot(rid)
        kv = m.pools.has_kv
        assert len(table) * TPB >= cached or not kv
        for i in range(cached if kv else 0):
            assert torch.all(m.pools.kv[:, table[i // TPB], :, i % TPB] == vals[i]), (rid, i)
        if state and m.pools.has_state:
            want = vals[cached - 1] if cached else 0.0
            assert torch.all(m.pools.conv[:, slot] == want)
            assert torch.all(m.pools.ssm[:, slot] == want)


OPS = ["admit", "admit", "step", "finish", "finish", "abort", "evict"]


def build(d) -> HybridCacheManager:
    per_conv = d.draw(st.booleans(), "per_conversation")
    offsets = st.lists(st.integers(1, 12), max_size=2), st.lists(st.integers(0, 5), max_size=3)
    policy = MambaStateConfig(
        periodic_snapshot_interval=0 if per_conv else d.draw(st.sampled_from([0, 4, 8])),
        additional_snapshot_offsets_from_start=tuple(d.draw(offsets[0])),
        additional_snapshot_offsets_from_end=tuple(d.draw(offsets[1])),
        decode_end_snapshot=d.draw(st.booleans()),
        per_conversation=per_conv,
        max_num_turns=d.draw(st.integers(0, 2)) if per_conv else 0,
    )
    max_live = d.draw(st.integers(1, 3))
    blocks = d.draw(st.integers(4, 20))
    slots = max_live + d.draw(st.integers(1, 4))
    cfg = CacheConfig(tokens_per_block=TPB, num_blocks=blocks, num_state_slots=slots,
                      mamba_state_config=policy)
    layers = d.draw(st.sampled_from([None, None, (0,), (1,)]), "stage layers")  # (0,): no KV
    spec = PoolSpec.for_model(MODEL, num_blocks=blocks, tokens_per_block=TPB, num_slots=slots,
                              layers=layers)
    return HybridCacheManager(cfg, Pools(spec), max_live)


def step_prefill(sim: Sim, d, rid: str) -> None:
    m, n, L = sim.m, sim.computed[rid], sim.prompt_len[rid]
    points = m._live[rid].points
    end = min([L, n + d.draw(st.integers(1, 6))] + [p for p in points if p > n])
    m.ensure_blocks(rid, end)
    sim.compute(rid, end)
    taken = m.commit(rid, sim.tokens[rid][:end])
    assert end in points or not taken  # a point may still be skipped when no page/slot is free


def step_decode(sim: Sim, d, rid: str) -> None:
    sim.tokens[rid].append(d.draw(st.integers(0, 3)))
    n = len(sim.tokens[rid])
    sim.m.ensure_blocks(rid, n)
    sim.compute(rid, n)


def complete(sim: Sim, d, rid: str) -> None:
    """Run the rest of the prompt, decode a few tokens, finish (the engine's order)."""
    while sim.computed[rid] < sim.prompt_len[rid]:
        step_prefill(sim, d, rid)
    for _ in range(d.draw(st.integers(0, 5), "generated")):
        step_decode(sim, d, rid)
    sim.m.finish(rid, sim.tokens[rid])


def admit(sim: Sim, d, i: int) -> None:
    m, base = sim.m, [1, 2, 3, 0, 1, 2, 3, 0, 2, 2, 1, 3, 0, 0, 1]
    rid, remote = f"r{i}", d.draw(st.booleans(), "remote")
    if sim.tokens and d.draw(st.booleans(), "continue a past conversation"):
        prev = d.draw(st.sampled_from(sorted(sim.tokens)))
        prompt = sim.tokens[prev] + d.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
    else:
        suffix = d.draw(st.lists(st.integers(0, 3), max_size=8))
        prompt = base[: d.draw(st.integers(0, 15))] + suffix
    prompt = prompt[:40] or [1]
    session = d.draw(st.sampled_from([None, "s1", "s2"]))
    try:
        adm = (m.admit_remote if remote else m.admit)(rid, prompt, session)
    except CapacityError:
        return
    assert adm.cached_tokens < len(prompt) or remote
    sim.tokens[rid], sim.prompt_len[rid] = list(prompt), len(prompt)
    sim.computed[rid] = adm.cached_tokens
    sim.check_restored(rid, adm.cached_tokens, state=not remote)
    if remote:  # the transfer lands the rest of the prompt's KV and its state
        sim.compute(rid, len(prompt))


def drain(m: HybridCacheManager) -> None:
    while m.tree.evict_block():
        pass
    while m.tree.evict_snapshot():
        pass


@pytest.mark.filterwarnings("ignore:cache.enable_prefix_reuse is true")
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_lifecycles_keep_integrity_and_return_everything(data):
    d = data
    sim = Sim(build(d))
    m = sim.m
    for i in range(d.draw(st.integers(5, 40), "steps")):
        live = sorted(m.live_requests())
        op = d.draw(st.sampled_from(OPS))
        if op == "admit" or not live:
            admit(sim, d, i)
        elif op == "step":
            rid = d.draw(st.sampled_from(live))
            try:
                if sim.computed[rid] < sim.prompt_len[rid]:
                    step_prefill(sim, d, rid)
                else:
                    step_decode(sim, d, rid)
            except CapacityError:
                m.abort(rid)
        elif op == "finish":
            rid = d.draw(st.sampled_from(live))
            try:
                complete(sim, d, rid)
            except CapacityError:
                m.abort(rid)
        elif op == "abort":
            m.abort(d.draw(st.sampled_from(live)))
        else:
            (m.tree.evict_block if d.draw(st.booleans()) else m.tree.evict_snapshot)()
        m.check_integrity()
    for rid in list(m.live_requests()):
        m.abort(rid)
    m.check_integrity()
    assert m.num_free_slots == m.slots.num_slots
    if m.blocks is not None:
        assert m.can_allocate(m.blocks.num_blocks) and not m.can_allocate(m.blocks.num_blocks + 1)
    drain(m)
    m.check_integrity()
    assert m.slots.num_free == m.slots.num_slots and m.tree.num_nodes == 0
    assert m.blocks is None or m.blocks.num_free == m.blocks.num_blocks
