"""Side-channel messages: msgpack only, malformed input becomes TransferError."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from baton.errors import TransferError
from transfer import wire


def test_round_trip_and_landed_blocks():
    data = wire.landed("r1", [3, 5], 2, [7, 8, 9])
    msg = wire.decode(data, 1 << 20, ops=("landed",))
    assert (msg["rid"], msg["layers"], msg["slot"]) == ("r1", [3, 5], 2)
    assert wire.landed_blocks(msg).tolist() == [7, 8, 9]
    assert wire.landed_blocks(wire.decode(wire.landed("r", [], None, []), 99))\
        .dtype == np.dtype("<i4")


GARBAGE = [
    b"", b"\x93\x01", bytes(range(256)), msgpack.packb([1, 2]), msgpack.packb({"op": "hello"}),
    msgpack.packb({"v": 1, "op": "hello", "fingerprint": [], "backend": "nixl"}),
    msgpack.packb({"v": 1, "op": "abort", "rid": "r", "error": True}),
    msgpack.packb({"v": 1, "op": "exec", "code": "rm -rf /"}),
    msgpack.packb({"v": 1, "op": "landed", "rid": "r", "layers": [], "slot": False,
                   "blocks": b""}),
    msgpack.packb({1: 2}),
    "not bytes",
    # found by tests/integration/test_fuzz.py: an unhashable op was an internal error
    msgpack.packb({"v": 1, "op": []}), msgpack.packb({"v": 1, "op": {"a": 1}}),
    msgpack.packb({"v": 1, "op": b"hello"}),
]


@pytest.mark.parametrize("data", GARBAGE)
def test_garbage_is_refused(data):
    with pytest.raises(TransferError):
        wire.decode(data, 1 << 20)


def test_oversized_and_unexpected_ops_refused():
    with pytest.raises(TransferError, match="exceeds the limit"):
        wire.decode(b"\0" * 101, 100)
    with pytest.raises(TransferError, match="unexpected message op 'bye'"):
        wire.decode(wire.encode("bye"), 100, ops=("hello",))
    with pytest.raises(TransferError, match="whole number"):
        wire.landed_blocks({"blocks": b"abc", "layers": []})


def test_no_pickle_in_the_transfer_package():
    import pathlib
    import re

    import transfer
    for path in pathlib.Path(transfer.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"import pickle|pickle\.|get_serialized_descs|send_pyobj", text), path
