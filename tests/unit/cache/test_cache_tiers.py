"""The disk tier behind a tiny pool: what leaves the pool comes back exactly (KV + state, one
entry), survives a restart, and every damaged, partial or foreign entry is a miss.

Pools as in test_cache_manager.py: tokens_per_block 4, FIFO ids.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from baton.cache.manager import HybridCacheManager
from baton.cache.tiers import Tiers
from baton.cache.tiers.disk import DiskTier
from baton.cache.tiers.entry import PREFIX, Header, Layout
from baton.cache.tiers.fileio import FileIO
from baton.config.cache import CacheConfig, MambaStateConfig
from baton.config.cache_tiers import EvictionConfig
from baton.errors import ConfigError
from baton.model.pools import Pools, PoolSpec
from tests.unit.cache.test_cache_manager import MODEL, TPB, run_prefill

ENTRY = None  # bytes of one 8-token entry, filled by the first test that needs it


def pools(blocks=12, slots=3) -> Pools:
    return Pools(PoolSpec.for_model(MODEL, num_blocks=blocks, tokens_per_block=TPB,
                                    num_slots=slots))


def disk(path, capacity=1 << 20, layout=None, io=None) -> DiskTier:
    layout = layout or Layout(pools(), "tiny")
    clock = iter(range(1, 1 << 30))
    return DiskTier(str(path), capacity, layout, io or FileIO(), EvictionConfig(),
                    lambda: next(clock))


def make(path, blocks=12, slots=3, max_live=1, capacity=1 << 20, io=None, key=b""):
    """Snapshot budget 2: the third snapshot evicts the least recently used one."""
    cfg = CacheConfig(tokens_per_block=TPB, num_blocks=blocks, num_state_slots=slots,
                      mamba_state_config=MambaStateConfig(decode_end_snapshot=False))
    p = pools(blocks, slots)
    layout = Layout(p, "tiny", key)
    tiers = Tiers(layout, disk(path, capacity, layout, io))
    return HybridCacheManager(cfg, p, max_live, tiers=tiers)


def compute(m: HybridCacheManager, rid: str, prompt: list[int], seed: float):
    """Admit, 'compute' the uncached part by writing recognisable KV and state, commit, finish."""
    adm = m.admit(rid, prompt)
    m.ensure_blocks(rid, len(prompt))
    table = m.block_table(rid)
    for i in range(adm.cached_tokens // TPB, len(table)):
        m.pools.kv[:, table[i]] = seed + i
    m.pools.conv[:, adm.slot] = seed
    m.pools.ssm[:, adm.slot] = seed + 0.5
    run_prefill(m, rid, prompt)
    m.finish(rid, prompt)
    m.check_integrity()
    return adm


def state_of(m, slot) -> tuple[float, float]:
    return float(m.pools.conv[0, slot, 0, 0]), float(m.pools.ssm[0, slot, 0, 0, 0])


A = [1, 2, 3, 4, 5, 6, 7, 8, 9]            # snapshot at 9 (2 blocks + a 1-token tail)
B = [20, 21, 22, 23, 24, 25, 26, 27, 28]
C = [40, 41, 42, 43, 44, 45, 46, 47, 48]


def test_evicted_snapshot_comes_back_from_disk_with_kv_and_state(tmp_path):
    m = make(tmp_path)
    compute(m, "a", A, 10.0)
    compute(m, "b", B, 20.0)
    compute(m, "c", C, 30.0)  # budget 2: A's snapshot leaves the pool, as one entry
    assert m.tiers.disk.stats.admitted == 1 and m.tree.match(A + [99], 9).cached_tokens == 0
    assert m.cached_prefix(A + [99]) == 9  # what admit will restore: from the disk
    [name] = [n for n in os.listdir(tmp_path) if n.endswith(".snap")]
    adm = m.admit("a2", A + [99])
    assert adm.cached_tokens == 9
    assert state_of(m, adm.slot) == (10.0, 10.5)
    kv = m.pools.kv
    assert [float(kv[0, b, 0, 0, 0, 0]) for b in adm.block_table] == [10.0, 11.0, 12.0]
    assert m.stats().tier_hit_tokens == 9 and m.stats().tiers["disk"]["hits"] == 1
    m.abort("a2")
    m.check_integrity()
    assert name  # the entry stays on disk after the hit


def test_restart_finds_predecessors_entries_after_checking_them(tmp_path):
    m = make(tmp_path)
    for rid, p, s in (("a", A, 10.0), ("b", B, 20.0), ("c", C, 30.0)):
        compute(m, rid, p, s)
    del m
    m2 = make(tmp_path)  # a new worker, a new id, the same folder
    assert m2.tiers.disk.lengths() == [9]
    adm = m2.admit("x", A + [5, 5])
    assert adm.cached_tokens == 9 and state_of(m2, adm.slot) == (10.0, 10.5)
    m2.abort("x")
    m2.check_integrity()


def _entry_file(path) -> str:
    [name] = [n for n in os.listdir(path) if n.endswith(".snap")]
    return os.path.join(path, name)


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate"])
def test_damaged_entry_is_a_miss_and_removed(tmp_path, damage):
    m = make(tmp_path)
    for rid, p, s in (("a", A, 10.0), ("b", B, 20.0), ("c", C, 30.0)):
        compute(m, rid, p, s)
    f = _entry_file(tmp_path)
    raw = bytearray(open(f, "rb").read())
    if damage == "flip_payload":
        raw[-3] ^= 0x40
    elif damage == "flip_header":
        raw[PREFIX.size + 2] ^= 0x01
    else:
        raw = raw[:-5]
    open(f, "wb").write(bytes(raw))
    m2 = make(tmp_path) if damage != "flip_payload" else m
    adm = m2.admit("x", A + [1])
    assert adm.cached_tokens == 0
    assert m2.tiers.disk.stats.corrupt == 1 and not os.path.exists(f)
    m2.abort("x")
    m2.check_integrity()


def test_entry_without_state_is_never_a_hit(tmp_path):
    """LMCache's failure on hybrids: KV present, state absent must be a miss."""
    m = make(tmp_path)
    layout = m.layout
    h, payload = layout.gather(A, [0, 1, 2], 0)
    kv_only = payload[: h.tokens + h.kv]
    bad = Header(h.fmt, h.n, h.tpb, h.tokens, h.kv, 0,
                 __import__("zlib").crc32(kv_only.numpy()))
    (_, key), = m.tiers.keys(A, [9])
    with open(os.path.join(tmp_path, m.tiers.disk.key(key) + ".snap"), "wb") as f:
        f.write(bad.encode() + kv_only.numpy().tobytes())
    m2 = make(tmp_path)
    assert m2.tiers.disk.lengths() == [] and m2.tiers.disk.stats.corrupt == 1
    assert m2.admit("x", A + [1]).cached_tokens == 0
    m2.abort("x")


def test_restore_at_exact_block_boundary_never_covers_last_token(tmp_path):
    """An entry after all 8 tokens of an 8-token prompt (2 blocks) is not used for that exact
    prompt: its state already holds the last token, whose logits must be computed."""
    m = make(tmp_path)
    p8 = A[:8]
    compute(m, "a", p8, 10.0)
    compute(m, "b", B, 20.0)
    compute(m, "c", C, 30.0)
    assert m.tiers.disk.lengths() == [8]
    adm = m.admit("again", p8)
    assert adm.cached_tokens == 0 and adm.snapshot_points == (8,)
    m.abort("again")
    adm = m.admit("longer", p8 + [77])
    assert adm.cached_tokens == 8
    m.abort("longer")
    m.check_integrity()


def test_full_tier_evicts_rather_than_fails(tmp_path):
    one = disk(tmp_path / "probe")
    size = Layout(pools(), "tiny").entry_bytes(9)
    m = make(tmp_path / "t", capacity=2 * size, slots=3)
    for i, (rid, p) in enumerate((("a", A), ("b", B), ("c", C), ("d", [60 + x for x in A]),
                                  ("e", [80 + x for x in A]))):
        compute(m, rid, p, 10.0 * (i + 1))
    st = m.tiers.disk.stats
    assert st.admitted == 3 and st.evicted == 1 and len(m.tiers.disk.lengths()) == 1
    assert m.tiers.disk.used <= 2 * size
    del one


def test_bad_paths_fail_in_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"cache.tier.path=.*file/sub.*cannot hold"):
        disk(f / "sub")
    with pytest.raises(ConfigError, match=r"cache.tier.bytes=100 is too small for one entry"):
        disk(tmp_path / "ok", capacity=100)


def test_two_workers_sharing_a_folder_never_overwrite(tmp_path):
    p = pools()
    layout = Layout(p, "tiny")
    t1, t2 = disk(tmp_path, layout=layout), disk(tmp_path, layout=layout)
    p.kv.fill_(1.0)
    h1, pay1 = layout.gather(A, [0, 1, 2], 0)
    p.kv.fill_(2.0)
    h2, pay2 = layout.gather(A, [0, 1, 2], 0)
    assert not torch.equal(pay1, pay2)
    k = t1.key(5)
    assert t1.put(k, h1, pay1) and t2.put(k, h2, pay2)
    got = t1.get(k, A)
    assert got is not None and torch.equal(got[1], pay1)  # the first commit stands
    assert t2.lengths() == [9] and torch.equal(t2.get(k, A)[1], pay1)
    t3 = disk(tmp_path, layout=layout)  # one started later sees both workers' entries
    t1.put(t1.key(6), h2, pay2)
    assert t3.lengths() == [9] and t3.has(t1.key(6)) and t3.has(k)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")] == []


def test_an_entry_written_under_another_secret_is_a_miss(tmp_path):
    """A well-formed entry whose MAC was made with another key (another cluster, or anyone who
    can write the folder without the secret) is never restored: a miss, counted and removed."""
    m = make(tmp_path, key=b"k" * 32)
    for rid, p, s in (("a", A, 10.0), ("b", B, 20.0), ("c", C, 30.0)):
        compute(m, rid, p, s)
    f = _entry_file(tmp_path)
    same = make(tmp_path, key=b"k" * 32)
    assert same.admit("y", A + [1]).cached_tokens == 9  # the right key restores it
    same.abort("y")
    other = make(tmp_path, key=b"j" * 32)
    adm = other.admit("x", A + [1])
    assert adm.cached_tokens == 0
    assert other.tiers.disk.stats.corrupt == 1 and not os.path.exists(f)
    other.abort("x")
    other.check_integrity()


def test_other_model_entries_are_kept_apart(tmp_path):
    t1 = disk(tmp_path, layout=Layout(pools(), "model-one"))
    t2 = disk(tmp_path, layout=Layout(pools(), "model-two"))
    h, pay = t1.layout.gather(A, [0, 1, 2], 0)
    t1.put(t1.key(7), h, pay)
    assert t2.lengths() == [] and t1.lengths() == [9]


NIXL_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from pathlib import Path
    from baton.cache.tiers.fileio import FileIO, NixlPosixIO, open_io
    from baton.cache.tiers.entry import Layout
    from tests.unit.cache.test_cache_tiers import A, disk, pools

    tmp = Path(sys.argv[1])
    io = NixlPosixIO()
    assert isinstance(open_io("nixl"), NixlPosixIO)  # the plugin loads: no fallback here
    layout = Layout(pools(), "tiny")
    buf = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
    for i, w in enumerate((io, FileIO())):
        fd = os.open(tmp / f"f{i}", os.O_RDWR | os.O_CREAT)
        w.write(fd, 16, buf)
        assert torch.equal(io.read(fd, 16, buf.numel()), buf)
        assert torch.equal(FileIO().read(fd, 16, buf.numel()), buf)
        os.close(fd)
    a, b = disk(tmp / "n", layout=layout, io=io), disk(tmp / "f", layout=layout)
    h, pay = layout.gather(A, [0, 1, 2], 0)
    k = a.key(3)
    a.put(k, h, pay)
    b.put(k, h, pay)
    assert (tmp / "n" / f"{k}.snap").read_bytes() == (tmp / "f" / f"{k}.snap").read_bytes()
    got = a.get(k, A)
    assert got is not None and torch.equal(got[1], pay)
    print("same bytes", flush=True)
""")


def test_nixl_posix_and_plain_files_write_the_same_bytes(tmp_path):
    """In its own process: one that has loaded NIXL crashes in grpc_tools' protoc later
    (test_proto_stubs.py), and pytest workers run many test files each."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", NIXL_SCRIPT, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "same bytes", out.stderr[-2000:]


KILL_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from baton.cache.tiers.fileio import FileIO
    from tests.unit.cache.test_cache_tiers import disk, pools, A
    from baton.cache.tiers.entry import Layout

    class Slow(FileIO):
        def write(self, fd, offset, buf):
            super().write(fd, offset, buf[: buf.numel() // 2])
            print("half", flush=True)
            time.sleep(60)
    layout = Layout(pools(), "tiny")
    t = disk(sys.argv[1], layout=layout, io=Slow())
    if sys.argv[2] == "background":  # a worker's tiers: the write runs on their I/O thread
        from baton.cache.tiers import Tiers
        Tiers(layout, t, background=True).spill(A, [0, 1, 2], 0, 0.0)
        time.sleep(60)
    h, pay = layout.gather(A, [0, 1, 2], 0)
    t.put(t.key(1), h, pay)
""")


@pytest.mark.parametrize("writer", ["inline", "background"])
def test_kill_9_mid_write_leaves_nothing_that_reads_as_valid(tmp_path, writer):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path), writer],
                            stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"half"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    names = os.listdir(tmp_path)
    assert len(names) == 1 and names[0].startswith(".tmp-")  # only the half-written file
    t = disk(tmp_path)
    assert t.lengths() == [] and os.listdir(tmp_path) == []
    assert t.stats.removed_tmp == 1
    time.sleep(0)


def test_no_room_to_restore_never_uses_a_snapshot_evicted_meanwhile(tmp_path):
    """Making room for a tier entry may evict the pool's own (shallower) match; when the room
    still cannot be had, admission matches again instead of restoring what was dropped."""
    m = make(tmp_path)
    for rid, p, s in (("a", A, 10.0), ("b", B, 20.0), ("c", C, 30.0)):
        compute(m, rid, p, s)  # A (9 tokens) on disk only
    compute(m, "a5", A[:5], 50.0)  # the pool's match for A: 5 tokens
    p5 = next(s for s in m.tree.lru_units()[1] if s.num_tokens == 5)

    def starved(required=True):  # the pool drops the 5-token snapshot, then has no block
        if p5.alive:
            m.tree.drop(p5)
        return None

    m.store.alloc_block = starved
    adm = m.admit("x", A + [99])
    assert adm.cached_tokens == 0 and state_of(m, adm.slot) == (0.0, 0.0)
    assert m.tiers.disk.stats.hits == 0
    m.abort("x")
    m.check_integrity()
