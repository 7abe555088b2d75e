"""A transfer that fails after its sender was granted the write: its bytes may still land
(a link that went down mid-transfer delivers them when it comes back, seconds after the
decode worker gave up). The decode worker keeps those blocks and the slot quarantined until
the late bytes landed, so another request never gets them; real NIXL between processes, the
decode side a real DecodeService over an engine, the delay a deterministic hook."""

from __future__ import annotations

import time

import pytest

from baton.model.nemotron_h.make import checkpoint_config
from bench.harness.loopback import StageProc
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BLOCKS, TPB, SLOTS, SEQS = 12, 16, 6, 4


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    model_dir = make_checkpoint(tmp_path_factory.mktemp("late"), "tiny")
    dec, pre = StageProc(), StageProc()
    try:
        ep = _ok(dec.call("decode_worker", model_dir=str(model_dir), num_blocks=BLOCKS,
                          tokens_per_block=TPB, num_slots=SLOTS, max_num_seqs=SEQS))["endpoint"]
        model = checkpoint_config("tiny")
        _ok(pre.call("setup", role="prefill", backend="nixl", model=model,
                     layers=list(range(model["num_hidden_layers"])), num_blocks=BLOCKS,
                     tokens_per_block=TPB, num_slots=SLOTS, seed=1))
        yield dec, pre, ep
    finally:
        pre.stop()
        dec.stop()


def _ok(reply: dict) -> dict:
    if not reply["ok"]:
        raise RuntimeError(reply["error"] + "\n" + reply.get("trace", ""))
    return reply


def counters(dec) -> dict:
    return _ok(dec.call("dw_counters"))["counters"]


def test_late_bytes_of_an_aborted_transfer_never_reach_another_requests_blocks(stages):
    dec, pre, ep = stages
    free0 = counters(dec)["blocks_free"]
    late = _ok(dec.call("dw_reserve", rid="late", prompt=prompt(1, 3 * TPB - 1), max_tokens=1))
    blocks, slot = late["blocks"], late["slot"]
    _ok(pre.call("delay_posts", seconds=2.0))
    pre.submit("send", rid="late", endpoints=[ep], src_blocks=[0, 1, 2], src_slot=0,
               dst_blocks=blocks, dst_slot=slot)
    deadline = time.monotonic() + 10
    while not _ok(dec.call("dw_granted", rid="late"))["granted"]:  # claimed and granted
        assert time.monotonic() < deadline, "the sender's claim was never granted"
        time.sleep(0.01)
    # the decode worker gives up on the request (a router abort, a lease) while the write
    # is held up: the blocks stay out of service instead of going back to the free list
    assert _ok(dec.call("dw_abort", rid="late"))["found"]
    c = counters(dec)
    assert (c["blocks_quarantined"], c["slots_quarantined"], c["quarantined_total"]) == (3, 1, 1)
    assert c["integrity_ok"] == 1.0 and c["live_requests"] == 0
    assert c["blocks_free"] == free0 - 3
    # a busy worker hands out every block and seat it can: other requests get other blocks
    # and slots (before the fix they got these, and the late bytes overwrote them)
    others = []
    for i in range(SEQS):
        r = dec.call("dw_reserve", rid=f"n{i}", prompt=prompt(10 + i, 3 * TPB - 1),
                     max_tokens=1)
        if not r["ok"]:
            assert "quarantined" in r["error"] or "KV blocks" in r["error"], r["error"]
            break
        others.append(r)
    assert others, "no other request could be reserved"
    theirs = [b for r in others for b in r["blocks"]]
    assert not set(theirs) & set(blocks) and slot not in {r["slot"] for r in others}
    for r in others:
        _ok(dec.call("dw_fill", blocks=r["blocks"], slot=r["slot"], value=-7.25))
    canaries = [_ok(dec.call("dw_bytes", blocks=r["blocks"], slot=r["slot"])) for r in others]
    _ok(pre.result(30))  # the held-up post went out: its bytes land now
    deadline = time.monotonic() + 15
    while counters(dec)["blocks_quarantined"]:  # released once the late bytes landed
        assert time.monotonic() < deadline, "the quarantine was never released"
        time.sleep(0.05)
    for r, canary in zip(others, canaries, strict=True):
        assert _ok(dec.call("dw_bytes", blocks=r["blocks"], slot=r["slot"])) == canary
    landed = _ok(dec.call("dw_bytes", blocks=blocks, slot=slot))
    assert all(set(kv) != {0} for kv in landed["kv"])  # the late write did land: there
    c = counters(dec)
    assert c["integrity_ok"] == 1.0 and c["slots_quarantined"] == 0
    assert c["blocks_free"] == free0 - len(theirs)
    for i in range(len(others)):
        _ok(dec.call("dw_abort", rid=f"n{i}"))
    c = counters(dec)
    assert c["blocks_free"] == free0 and c["integrity_ok"] == 1.0
