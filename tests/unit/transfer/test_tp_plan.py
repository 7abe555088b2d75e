"""The heterogeneous-TP transfer plan, byte by byte.

Every cache tensor at TP 1 is filled with its element index; each source rank holds its
shard of it, cut by an independent reference (`reference_local`, written here with plain
numpy slicing, not with the code under test). The plan's pieces are applied to empty
destination ranks, recording for each destination byte which source rank and byte offset
wrote it. Then, for every prefill / decode TP pair in {1, 2, 4}: every destination byte is
written exactly once, holds the element the reference puts there, and came from the
one source rank chosen for it (of those holding it, the nearest to d*src_tp // dst_tp,
ties to the lower), at that element's offset there.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from baton.model import tp_shard
from baton.model.config import config_from_dict
from baton.model.nemotron_h.config import ModelConfig
from baton.model.tp_shard import SectionShard, TensorShard, model_shards
from bench.harness.testbed import tiny_model, tiny_qwen
from transfer import tp_plan
from transfer.tp_plan import pieces_for, plan_tp

TPS = (1, 2, 4)
TPB = 4
# mamba heads 8 x 4, state 4: conv x 32 rows, B and C 4*G rows; 4 attention / 2 KV heads
GROUPS4 = ModelConfig.from_dict(tiny_model("M*M-", mamba_num_heads=8, n_groups=4))
GROUPS1 = ModelConfig.from_dict(tiny_model("M*M-", mamba_num_heads=8, n_groups=1))
ONE_KV = ModelConfig.from_dict(tiny_model("M*", mamba_num_heads=8, n_groups=1,
                                          num_key_value_heads=1))
# DeltaNet: 2 key heads x 4 (q, k), 4 value heads x 6 (v, recurrent [4, 4, 6] float32)
QWEN = config_from_dict(tiny_qwen("GG*G", intermediate_size=64))
CONFIGS = {"groups4": GROUPS4, "groups1": GROUPS1, "one_kv_head": ONE_KV, "qwen3_5": QWEN}
INT = {2: np.int16, 4: np.int32}


def global_shape(cfg, name):
    if name == "kv":
        return (2, TPB, cfg.num_key_value_heads, cfg.head_dim)
    return next(t.shape for t in cfg.state_tensors if t.name == name)


def reference_local(cfg, name, tp, r, g):
    """Rank r's shard of the TP-1 tensor g, by the layouts peers agree on."""
    if name == "kv":
        k = cfg.num_key_value_heads
        if k >= tp:
            return g[:, :, r * k // tp:(r + 1) * k // tp]
        return g[:, :, r // (tp // k):r // (tp // k) + 1]  # replicated: division
    if cfg.family == "qwen3_5":
        return _deltanet_local(cfg, name, tp, r, g)
    H = cfg.mamba_num_heads
    if name == "ssm":
        return g[r * H // tp:(r + 1) * H // tp]
    inner, gn = cfg.mamba_intermediate, cfg.n_groups * cfg.ssm_state_size
    x = g[r * inner // tp:(r + 1) * inner // tp]
    if cfg.n_groups == 1:  # B and C whole on every rank
        b, c = g[inner:inner + gn], g[inner + gn:inner + 2 * gn]
    else:
        b = g[inner + r * gn // tp:inner + (r + 1) * gn // tp]
        c = g[inner + gn + r * gn // tp:inner + gn + (r + 1) * gn // tp]
    return np.concatenate([x, b, c])


def _deltanet_local(cfg, name, tp, r, g):
    """q and k by key heads (replicated by division when TP exceeds them), v and the
    recurrent state by value heads."""
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    if name == "recurrent":
        return g[r * hv // tp:(r + 1) * hv // tp]
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    kd = hk * dk
    if hk >= tp:
        lo, hi = r * hk // tp * dk, (r + 1) * hk // tp * dk
    else:
        lo = r // (tp // hk) * dk
        hi = lo + dk
    v = g[2 * kd + r * hv // tp * dv:2 * kd + (r + 1) * hv // tp * dv]
    return np.concatenate([g[lo:hi], g[kd + lo:kd + hi], v])


def simulate(cfg, src_tp, dst_tp, dtype="bfloat16"):
    """Problems found moving every tensor from src_tp ranks to dst_tp ranks (empty: exact)."""
    src_shards, dst_shards = (model_shards(cfg, t, dtype, TPB) for t in (src_tp, dst_tp))
    plan = plan_tp(src_shards, dst_shards)
    problems = []
    for shard in src_shards:
        name, it = shard.name, shard.itemsize
        g = np.arange(int(np.prod(global_shape(cfg, name))), dtype=INT[it])
        g = g.reshape(global_shape(cfg, name))
        src = [np.ascontiguousarray(reference_local(cfg, name, src_tp, r, g))
               for r in range(src_tp)]
        want = [np.ascontiguousarray(reference_local(cfg, name, dst_tp, r, g))
                for r in range(dst_tp)]
        dst = [np.full_like(w, -1) for w in want]
        writes = [np.zeros(w.nbytes, np.int64) for w in want]
        from_rank = [np.full(w.nbytes, -1, np.int64) for w in want]
        from_off = [np.full(w.nbytes, -1, np.int64) for w in want]
        for p in (p for p in plan if p.tensor == name):
            sb, db = src[p.src_rank].view(np.uint8).reshape(-1), dst[p.dst_rank].view(
                np.uint8).reshape(-1)
            for k in range(p.repeat):
                so, do = p.src_offset + k * p.src_stride, p.dst_offset + k * p.dst_stride
                if so + p.length > sb.size or do + p.length > db.size:
                    problems.append(f"{name}: {p} run {k} outside the rank's bytes")
                    continue
                db[do:do + p.length] = sb[so:so + p.length]
                writes[p.dst_rank][do:do + p.length] += 1
                from_rank[p.dst_rank][do:do + p.length] = p.src_rank
                from_off[p.dst_rank][do:do + p.length] = np.arange(so, so + p.length)
        for d in range(dst_tp):
            problems += _check_rank(name, d, dst_tp, it, src, dst[d], want[d], writes[d],
                                    from_rank[d], from_off[d])
    return problems


def _check_rank(name, d, n_dst, it, src, got, want, writes, from_rank, from_off):
    out = []
    if (writes != 1).any():
        b = int(np.flatnonzero(writes != 1)[0])
        out.append(f"{name} dst {d}: byte {b} written {int(writes[b])} times")
    if not np.array_equal(got, want):
        e = int(np.flatnonzero(got.reshape(-1) != want.reshape(-1))[0])
        out.append(f"{name} dst {d}: element {e} holds {int(got.reshape(-1)[e])}, "
                   f"want {int(want.reshape(-1)[e])}")
        return out
    # provenance: byte b is byte (b % it) of element want[b // it]; its writer must be the
    # chosen holder of that element, at that element's offset there
    prefer = d * len(src) // n_dst
    for b in range(0, want.nbytes, it):
        elem = want.reshape(-1)[b // it]
        holders = [r for r, s in enumerate(src) if (s.reshape(-1) == elem).any()]
        r = min(holders, key=lambda h: (abs(h - prefer), h))
        off = int(np.flatnonzero(src[r].reshape(-1) == elem)[0]) * it
        if from_rank[b] != r or list(from_off[b:b + it]) != list(range(off, off + it)):
            out.append(f"{name} dst {d}: byte {b} from rank {from_rank[b]} offset "
                       f"{from_off[b]}, want rank {r} offset {off}")
            break
    return out


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dst_tp", TPS)
@pytest.mark.parametrize("src_tp", TPS)
def test_every_destination_byte_comes_from_its_one_source(cfg, src_tp, dst_tp):
    assert simulate(cfg, src_tp, dst_tp) == []


def test_float32_pools_and_piece_counts():
    """Exact in 4-byte elements too; and the plan's shape: equal TP is one piece per tensor
    per rank; TP 1 -> 2 with n_groups 1: rank 0 takes x0, then B|C (contiguous on both
    sides, so one piece); rank 1 takes x1|B|C, which follow each other on both sides."""
    assert simulate(GROUPS1, 4, 2, dtype="float32") == []
    same = plan_tp(*(model_shards(GROUPS1, 2, "float32", TPB) for _ in range(2)))
    assert [(p.tensor, p.src_rank, p.dst_rank, p.src_offset, p.repeat) for p in same] == [
        ("kv", 0, 0, 0, 1), ("kv", 1, 1, 0, 1), ("conv", 0, 0, 0, 1), ("conv", 1, 1, 0, 1),
        ("ssm", 0, 0, 0, 1), ("ssm", 1, 1, 0, 1)]
    up = plan_tp(model_shards(GROUPS1, 1, "float32", TPB), model_shards(GROUPS1, 2, "float32",
                                                                          TPB))
    conv = [(p.dst_rank, p.src_offset, p.dst_offset, p.length) for p in up if p.tensor == "conv"]
    row = 3 * 4  # K-1 = 3 float32 per channel
    assert conv == [(0, 0, 0, 16 * row), (0, 32 * row, 16 * row, 8 * row),
                    (1, 16 * row, 0, 24 * row)]


def test_replicated_kv_heads_written_once_per_destination_copy():
    """Prefill TP 4 (2 KV heads: ranks 0,1 hold head 0, ranks 2,3 head 1) to decode TP 1:
    only ranks 0 and 2 write KV; all four write their Mamba state."""
    plan = plan_tp(model_shards(GROUPS4, 4, "float32", TPB), model_shards(GROUPS4, 1,
                                                                            "float32", TPB))
    assert sorted({p.src_rank for p in plan if p.tensor == "kv"}) == [0, 2]
    assert {p.src_rank for p in plan if p.tensor == "ssm"} == {0, 1, 2, 3}
    assert [p.tensor for p in pieces_for(plan, 1)] == ["conv", "conv", "conv", "ssm"]
    # TP 4 -> 2 with n_groups 1: each decode rank takes its replicated B/C from its own
    # aligned prefill rank (0 and 2), never from both of its sources
    plan = plan_tp(model_shards(GROUPS1, 4, "float32", TPB), model_shards(GROUPS1, 2,
                                                                            "float32", TPB))
    conv = [(p.src_rank, p.dst_rank, p.length // 12) for p in plan if p.tensor == "conv"]
    assert conv == [(0, 0, 8), (1, 0, 8), (0, 0, 8), (2, 1, 8), (3, 1, 8), (2, 1, 8)]


# --- regression tests named after the peers' bugs: each fails on a wrong planner --------

def one_block_state_shard(spec, tp, itemsize):
    """The bug: the conv state cut as one block of channels, not per section."""
    return TensorShard(spec.name, spec.shape, spec.shard_axis,
                       (SectionShard("all", spec.shape[spec.shard_axis], 1),), tp, itemsize)


def test_peer_bug_conv_sliced_as_one_block(monkeypatch):
    assert simulate(GROUPS4, 1, 2) == [] and simulate(GROUPS1, 2, 4) == []
    monkeypatch.setattr(tp_shard, "state_shard", one_block_state_shard)
    bad = simulate(GROUPS4, 1, 2)
    # rank 0's slot: x rows 0..15, then its B rows (global 32..39): its element 48 (row 16)
    # must be global element 96 (row 32, B row 0); one block gave it x row 16 instead
    assert bad == ["conv dst 0: element 48 holds 48, want 96",
                   "conv dst 1: element 0 holds 96, want 48"]
    assert simulate(GROUPS4, 2, 2) == []  # equal TP hides it, as it did for the peers


def test_peer_bug_tp_ratio_applied_to_replicated_groups(monkeypatch):
    """The bug (vLLM #55208): B/C of n_groups == 1 scaled by the TP ratio like x, so a
    decode rank read part of C where B belongs."""
    assert simulate(GROUPS1, 1, 2) == []
    real = tp_shard.state_shard
    monkeypatch.setattr(tp_shard, "state_shard", lambda spec, tp, it: real(
        dataclasses.replace(spec, section_units=()), tp, it))
    bad = simulate(GROUPS1, 1, 2)
    # conv rows (3 elements each): x 0..31, B 32..35, C 36..39; a rank's slot is x 16 rows,
    # B 4, C 4. Its element 54 (row 18, B row 2) must hold global element 102 (row 34);
    # the wrong plan put C's row 0 (element 108) there and left the slot's tail unwritten
    assert bad[:2] == ["conv dst 0: byte 120 written 0 times",
                       "conv dst 0: element 54 holds 108, want 102"]
    assert simulate(GROUPS4, 1, 2) == []  # with n_groups % TP == 0 the bug is invisible


def modulo_held_units(units, tp, rank):
    """The bug (SGLang #30997): replicated head index by modulo, not division."""
    if units % tp == 0:
        per = units // tp
        return rank * per, rank * per + per
    return rank % units, rank % units + 1


def test_peer_bug_kv_head_index_by_modulo(monkeypatch):
    assert simulate(GROUPS4, 1, 4) == []
    monkeypatch.setattr(tp_shard, "held_units", modulo_held_units)
    monkeypatch.setattr(tp_plan, "held_units", modulo_held_units)
    bad = simulate(GROUPS4, 1, 4)
    # KV block [2, 4 tokens, 2 heads, 8]: decode rank 1 must hold head 0 (element 0), the
    # modulo gave it head 1 (element 8), and rank 2 head 0 where head 1 belongs
    assert bad == ["kv dst 1: element 0 holds 8, want 0", "kv dst 2: element 0 holds 0, want 8"]
    assert simulate(GROUPS4, 2, 2) == []  # no replication, no difference
