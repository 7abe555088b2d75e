"""End-to-end handoffs on the `ucx` backend (ucxx), between real stage processes.

Same PP matrix as the NIXL suite, plus layer-wise streaming, refusal and a dead peer.
"""

from __future__ import annotations

import pytest

from bench.harness.testbed import Testbed, check_pp_matrix, events_ok, tiny_model, two_handoffs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

@pytest.fixture(scope="module")
def bed():
    tb = Testbed(max_prefill=3, max_decode=2)
    yield tb
    tb.close()


def test_pp_matrix_bit_exact(bed):
    check_pp_matrix(bed, "ucx")


def test_layerwise_streaming_bit_exact(bed):
    bed.configure("ucx", tiny_model("MMMM--**"), 3, 2, seed=5, layerwise=True)
    hs = two_handoffs("layerwise")
    assert events_ok(bed.run(hs), [h.rid for h in hs]) is None
    assert bed.mismatch(hs) is None


def test_mismatched_peer_refused(bed):
    ep = bed.pair("ucx", prefill_overrides={"dtype": "bfloat16"})
    r = bed.prefill[0].call("connect", endpoint=ep)
    assert not r["ok"] and "'dtype'" in r["error"], r


def test_backend_mismatch_refused(bed):
    ep = bed.pair("ucx")
    nixl = bed.respawn("prefill", 0)  # a fresh process: NIXL and ucxx never share one
    setup = nixl.call("setup", role="prefill", seed=1, backend="nixl",
                      model=tiny_model("MM-MM*-*M"), layers=list(range(9)), num_blocks=12,
                      tokens_per_block=4, num_slots=3)
    r = nixl.call("connect", endpoint=ep)
    mixed = nixl.call("setup", role="prefill", seed=1, backend="ucx",
                      model=tiny_model("MM-MM*-*M"), layers=list(range(9)), num_blocks=12,
                      tokens_per_block=4, num_slots=3)
    bed.respawn("prefill", 0)
    assert setup["ok"] and not r["ok"] and "'backend'" in r["error"], r
    assert not mixed["ok"] and "two UCX copies" in mixed["error"], mixed


def test_prefill_killed_decode_lease_expires(bed):
    bed.pair("ucx", lease_seconds=1.5)
    bed.decode[0].call("expect", rid="k", blocks=[0, 1, 2], slot=2, lease_s=1.5)
    bed.prefill[0].kill()
    dec = bed.decode[0].call("wait", rids=["k"], timeout=10)
    bed.respawn("prefill", 0)
    (rid, ok, err), = dec["events"]
    assert (rid, ok) == ("k", False) and "lease expired" in err
    assert dec["elapsed"] < 4


def test_decode_killed_sender_reports_error(bed):
    ep = bed.pair("ucx", lease_seconds=3)
    assert bed.prefill[0].call("connect", endpoint=ep)["ok"]
    bed.decode[0].kill()
    bed.prefill[0].call("send", rid="d", endpoints=[ep], src_blocks=[0, 1], src_slot=0,
                        dst_blocks=[0, 1], dst_slot=0)
    pre = bed.prefill[0].call("wait", rids=["d"], timeout=10)
    bed.respawn("decode", 0)
    (rid, ok, err), = pre["events"]
    assert (rid, ok) == ("d", False) and err, pre
    print("sender error after decode died:", err)
    assert pre["elapsed"] < 4
