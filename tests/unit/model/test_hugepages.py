"""Weights and pools on transparent huge pages (baton.model.hugepages): the same bytes at the
same strides in a mapping advised MADV_HUGEPAGE (its `hg` flag in /proc/self/smaps), tied
weights still tied, tensors that shared a storage still sharing one, the fast path's caches of
the old storages dropped, and a model's logits bit for bit what they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from baton.model import hugepages
from baton.model.layers import linear

pytestmark = pytest.mark.skipif(not hugepages.available(),
                                reason="this machine offers no transparent huge pages")


def _advised(t: torch.Tensor) -> bool:
    """Whether t's first byte lies in a mapping whose VmFlags hold `hg` (MADV_HUGEPAGE)."""
    addr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    return False


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 48)
        self.up = nn.Linear(48, 96, bias=False)
        self.down = nn.Linear(96, 48, bias=True)
        self.head = nn.Linear(48, 64, bias=False)
        self.head.weight = self.embed.weight  # tied
        stack = torch.randn(4, 48, 48)
        self.register_buffer("first", stack[0])  # two buffers on one storage
        self.register_buffer("third", stack[2])
        self.norm = nn.LayerNorm(48)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h))) + h @ self.first + h @ self.third
        return self.head(self.norm(h))


def test_weights_move_in_place_with_the_same_bits_ties_and_views(monkeypatch):
    monkeypatch.setattr(hugepages, "MIN_BYTES", 4096)
    torch.manual_seed(0)
    net = linear.install(_Net().eval())
    ids = torch.tensor([[3, 9, 27, 1]])
    with torch.no_grad():
        want = net(ids)
    before = {n: p.detach().clone() for n, p in net.state_dict().items()}
    embed_param = net.embed.weight
    net.up._packed()  # a cached view of the old storage
    norm_at = net.norm.weight.data_ptr()
    moved = hugepages.place_on_huge_pages(net)
    assert moved >= sum(t.numel() * 4 for n, t in before.items() if t.numel() * 4 >= 4096)
    assert net.embed.weight is embed_param and net.head.weight is embed_param
    assert "_baton_packed" not in net.up.__dict__
    for n, t in net.state_dict().items():
        assert torch.equal(t, before[n]), n
    for t in (net.up.weight, net.down.weight, net.embed.weight, net.first):
        assert _advised(t)
    assert net.norm.weight.data_ptr() == norm_at  # under MIN_BYTES: left where it was
    assert net.first.untyped_storage().data_ptr() == net.third.untyped_storage().data_ptr()
    assert net.third.data_ptr() - net.first.data_ptr() == 2 * 48 * 48 * 4
    with torch.no_grad():
        assert torch.equal(net(ids), want)
    assert net.up._packed().data_ptr() == net.up.weight.data_ptr()


def _rss_mb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


def test_moving_weights_does_not_keep_the_old_copies_resident(monkeypatch):
    # 8 weights of 8 MiB: under glibc's dynamic mmap threshold once it has risen, so freed
    # into its heap (kept resident) unless the move gives them back
    monkeypatch.setattr(hugepages, "MIN_BYTES", 4096)
    net = nn.Sequential(*[nn.Linear(1024, 2048, bias=False) for _ in range(8)])
    for m in net:
        m.weight.data = m.weight.data.clone()  # each on a fresh heap allocation
    want = [m.weight.detach().clone() for m in net]
    before = _rss_mb()
    assert hugepages.place_on_huge_pages(net) == 8 * 8 << 20
    assert _rss_mb() - before < 24  # the 64 MiB copy, not another 64 kept
    assert all(torch.equal(m.weight, w) for m, w in zip(net, want, strict=True))


def test_huge_zeros_commits_its_memory_at_once():
    before = _rss_mb()
    t = hugepages.huge_zeros((16 << 20,), torch.float32)  # 64 MiB, written as torch.zeros is
    assert _rss_mb() - before >= 60 and _advised(t)


def test_huge_zeros():
    big = hugepages.huge_zeros((3, hugepages.MIN_BYTES // 4), torch.float32)
    assert big.shape == (3, hugepages.MIN_BYTES // 4) and big.dtype == torch.float32
    assert big.is_contiguous() and _advised(big) and not big.any()
    assert big.data_ptr() % hugepages.HUGE == 0
    big[2, -1] = 5.0  # writable to its last element
    assert float(big.sum()) == 5.0
    small = hugepages.huge_zeros((4, 4), torch.float16)
    assert small.dtype == torch.float16 and not small.any()


def test_pools_are_on_huge_pages():
    from baton.model.nemotron_h.config import ModelConfig
    from baton.model.nemotron_h.make import checkpoint_config
    from baton.model.pools import Pools, PoolSpec

    cfg = ModelConfig.from_dict(checkpoint_config("tiny"))
    spec = PoolSpec.for_model(cfg, num_blocks=512, tokens_per_block=16, num_slots=64,
                              dtype=torch.float32, device="cpu")
    pools = Pools(spec)
    big = 0
    for t in [pools.kv, *pools.state.values()]:
        assert not t.any()
        if t.numel() * 4 >= hugepages.MIN_BYTES:  # (a smaller one may sit in a region torch
            assert _advised(t)                     # advised itself: THP_MEM_ALLOC_ENABLE)
            big += 1
    assert big >= 2
