"""End-to-end NIXL handoffs between real stage processes (one NIXL agent per process)."""

from __future__ import annotations

import pytest

from bench.harness.testbed import (
    Testbed,
    check_pp_matrix,
    events_ok,
    tiny_model,
    tiny_qwen,
    two_handoffs,
)
from bench.harness.verify import Handoff

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

@pytest.fixture(scope="module")
def bed():
    tb = Testbed(max_prefill=3, max_decode=2)
    yield tb
    tb.close()


def test_pp_matrix_bit_exact(bed):
    check_pp_matrix(bed, "nixl")


@pytest.mark.parametrize("pp,dp", [(p, d) for p in (1, 2, 3) for d in (1, 2)])
def test_unequal_worker_splits_bit_exact(bed, pp, dp):
    """The pipeline-parallel workers' case: `MMM*-M*-` with prefill [3, 3, 2] (attention-free
    stage 0, Mamba-free stage 2) and decode [5, 3]; canaries prove nothing else changed."""
    parts = ({1: [], 2: [4, 4], 3: [3, 3, 2]}[pp], {1: [], 2: [5, 3]}[dp])
    bed.configure("nixl", tiny_model("MMM*-M*-"), pp, dp, seed=3 + pp * 10 + dp,
                  partitions=parts)
    hs = two_handoffs(f"split-{pp}x{dp}")
    assert events_ok(bed.run(hs), [h.rid for h in hs]) is None
    assert bed.mismatch(hs) is None


def test_layerwise_streaming_bit_exact(bed):
    bed.configure("nixl", tiny_model("MM-MM*-*M"), 3, 2, seed=7, layerwise=True)
    hs = two_handoffs("layerwise")
    assert events_ok(bed.run(hs), [h.rid for h in hs]) is None
    assert bed.mismatch(hs) is None


MISMATCHES = [  # (field named in the error, decode-side overrides, prefill-side overrides)
    ("dtype", {}, {"dtype": "bfloat16"}),
    ("tokens_per_block", {}, {"tokens_per_block": 8}),
    ("num_layers", {}, {"model": tiny_model("MM-MM*-*MM")}),
    ("ssm_shape", {}, {"model": tiny_model("MM-MM*-*M", mamba_num_heads=2, mamba_head_dim=8)}),
    ("conv_sections", {}, {"model": tiny_model("MM-MM*-*M", mamba_num_heads=6, n_groups=1)}),
    ("conv_shape", {}, {"model": tiny_model("MM-MM*-*M", conv_kernel=3)}),
]


@pytest.mark.parametrize("field,dec_over,pre_over", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_mismatched_peers_refused_no_bytes_move(bed, field, dec_over, pre_over):
    ep = bed.pair("nixl", dec_over, pre_over)
    before = bed.decode[0].call("dump")
    r = bed.prefill[0].call("connect", endpoint=ep)
    assert not r["ok"] and f"'{field}'" in r["error"], r["error"]
    bed.decode[0].call("expect", rid="m", blocks=[0, 1], slot=0, lease_s=5)
    bed.prefill[0].call("send", rid="m", endpoints=[ep], src_blocks=[0, 1], src_slot=0,
                        dst_blocks=[0, 1], dst_slot=0)
    ev = bed.prefill[0].call("wait", rids=["m"], timeout=5)["events"]
    assert len(ev) == 1 and ev[0][1] is False and f"'{field}'" in ev[0][2], ev
    assert bed.decode[0].call("dump") == before


def test_sender_abort_frees_decode_before_lease(bed):
    ep = bed.pair("nixl")
    bed.decode[0].call("expect", rid="x", blocks=[3], slot=1, lease_s=30)
    bed.prefill[0].call("send", rid="x", endpoints=[ep], src_blocks=[99], src_slot=0,
                        dst_blocks=[3], dst_slot=1)
    pre = bed.prefill[0].call("wait", rids=["x"], timeout=5)
    dec = bed.decode[0].call("wait", rids=["x"], timeout=5)
    assert pre["events"][0][:2] == ["x", False] and "99" in pre["events"][0][2]
    assert dec["events"][0][:2] == ["x", False] and "aborted by prefill" in dec["events"][0][2]
    assert dec["elapsed"] < 5


def test_prefill_killed_decode_lease_expires(bed):
    bed.pair("nixl", lease_seconds=1.5)
    bed.decode[0].call("expect", rid="k", blocks=[0, 1, 2], slot=2, lease_s=1.5)
    bed.prefill[0].kill()
    dec = bed.decode[0].call("wait", rids=["k"], timeout=10)
    bed.respawn("prefill", 0)
    (rid, ok, err), = dec["events"]
    assert (rid, ok) == ("k", False) and "lease expired" in err
    assert dec["elapsed"] < 4  # freed within the lease (plus polling), not stranded


def test_decode_killed_sender_reports_error(bed):
    ep = bed.pair("nixl", lease_seconds=3)
    assert bed.prefill[0].call("connect", endpoint=ep)["ok"]
    bed.decode[0].kill()
    bed.prefill[0].call("send", rid="d", endpoints=[ep], src_blocks=[0, 1], src_slot=0,
                        dst_blocks=[0, 1], dst_slot=0)
    pre = bed.prefill[0].call("wait", rids=["d"], timeout=10)
    bed.respawn("decode", 0)
    (rid, ok, err), = pre["events"]
    assert (rid, ok) == ("d", False) and err, pre
    assert pre["elapsed"] < 4


def garbage_messages() -> list[list[bytes]]:
    import msgpack

    hello = msgpack.packb({"v": 1, "op": "hello", "fingerprint": {}, "backend": "nixl"})
    return [
        [b"\x93\x01"],                                   # truncated msgpack array
        [bytes(range(256)) * 4],                         # random bytes
        [hello[: len(hello) // 2]],                      # truncated map
        [msgpack.packb([1, 2, 3])],                      # not a map
        [msgpack.packb({"v": 1, "op": "hello", "fingerprint": "x", "backend": 3})],
        [msgpack.packb({"v": 1, "op": "launch_missiles"})],
        [msgpack.packb({"v": 2, "op": "hello"})],
        [msgpack.packb({"v": 1, "op": "abort", "rid": 5, "error": None})],
        [b"part one", b"part two"],                      # multi-frame
        [b""],
    ]


def test_garbage_on_side_channel_rejected_listener_survives(bed):
    import msgpack
    import zmq

    bed.configure("nixl", tiny_model("MM-MM*-*M"), 1, 1)
    ep = bed.endpoints[0]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ep)
    try:
        for frames in garbage_messages():
            sock.send_multipart(frames)
            if len(frames) == 1:  # one-frame garbage gets an answer naming the problem
                assert sock.poll(5000), frames
                reply = msgpack.unpackb(sock.recv())
                assert reply["op"] == "refused" and reply["field"] == "message", reply
        big = ctx.socket(zmq.DEALER)  # over max_message_bytes: dropped by ZeroMQ, no answer
        big.setsockopt(zmq.LINGER, 0)
        big.connect(ep)
        big.send(b"\0" * (17 * 1024 * 1024))
        assert not big.poll(500)
        big.close()
    finally:
        sock.close()
        ctx.term()
    hs = [Handoff("after-garbage", [0, 1], 0, [2, 3], 1)]
    assert events_ok(bed.run(hs), ["after-garbage"]) is None
    assert bed.mismatch(hs) is None


@pytest.mark.parametrize(("pp", "dp"), [(2, 1), (1, 2)])
def test_qwen3_5_kv_and_deltanet_state_bit_exact(bed, pp, dp):
    """KV plus both DeltaNet tensors (conv window, float32 recurrent matrix) across stage
    splits with a KV-free stage ([3, 3] of GGG*G*); decode pools start as canaries and
    every byte outside the moved blocks and slots is checked unchanged."""
    bed.configure("nixl", tiny_qwen("GGG*G*"), pp, dp, seed=40 + pp, dtype="bfloat16")
    hs = two_handoffs(f"qwen-{pp}x{dp}")
    assert events_ok(bed.run(hs), [h.rid for h in hs]) is None
    assert bed.mismatch(hs) is None, bed.mismatch(hs)
