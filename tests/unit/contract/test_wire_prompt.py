"""Prompts between the router and the workers travel packed (`prompt_le32`); the repeated
field is still read, and a malformed or doubled prompt is refused in one line."""

from __future__ import annotations

import pytest

from baton.contract import PrefillInput, ReserveInput, wire
from baton.errors import InvalidRequestError
from baton.proto_gen import worker_pb2 as wpb
from baton.sampling import SamplingParams

PROMPT = (0, 1, 7, 151_935, 2**31 - 1, 42)
SAMPLING = SamplingParams(max_tokens=3)


def test_reserve_and_prefill_send_the_prompt_packed_and_read_it_back():
    m = wire.reserve_to_pb(ReserveInput("r", PROMPT, SAMPLING, "s"))
    assert len(m.prompt_ids) == 0 and m.prompt_le32 == b"".join(
        t.to_bytes(4, "little") for t in PROMPT)
    assert wire.reserve_from_pb(wpb.ReserveRequest.FromString(m.SerializeToString())) == \
        ReserveInput("r", PROMPT, SAMPLING, "s")
    p = wire.prefill_to_pb(PrefillInput("r", PROMPT, SAMPLING, "s"))
    back = wire.prefill_from_pb(wpb.PrefillRequest.FromString(p.SerializeToString()))
    assert back.prompt_ids == PROMPT and type(back.prompt_ids[0]) is int


def test_the_repeated_field_is_still_read():
    m = wpb.PrefillRequest(request_id="r", prompt_ids=PROMPT)
    assert wire.prefill_from_pb(m).prompt_ids == PROMPT
    assert wire.reserve_from_pb(wpb.ReserveRequest(request_id="r")).prompt_ids == ()


def test_a_doubled_or_torn_prompt_is_refused():
    both = wpb.PrefillRequest(request_id="r", prompt_ids=[1, 2], prompt_le32=b"\0" * 8)
    with pytest.raises(InvalidRequestError, match="sets both prompt_ids .2 tokens. and "
                                                  "prompt_le32"):
        wire.prefill_from_pb(both)
    torn = wpb.ReserveRequest(request_id="r", prompt_le32=b"\1\0\0\0\2")
    with pytest.raises(InvalidRequestError, match="ReserveRequest.prompt_le32 holds 5 bytes, "
                                                  "not a multiple of 4"):
        wire.reserve_from_pb(torn)


def test_a_token_id_beyond_int32_is_refused_as_protobuf_does():
    with pytest.raises(ValueError, match="does not fit int32"):
        wire.reserve_to_pb(ReserveInput("r", (1, 2**31), SAMPLING, ""))
