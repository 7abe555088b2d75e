"""Point-to-point messages between pipeline stages over torch.distributed (gloo).

Control messages are msgpack bytes (never pickle: `send_object_list` pickles), sent as an
int64 length and a uint8 payload; hidden states and logits are plain tensors whose shapes
the control message already told the receiver. Each kind of traffic has its own tag, so a
pair of stages keeps each stream in order without mixing them.
"""

from __future__ import annotations

import msgpack
import torch
import torch.distributed as dist

TAG_CTRL, TAG_HIDDEN, TAG_OUT, TAG_REPLY = 1, 2, 3, 4


def pack(msg: dict) -> torch.Tensor:
    data = msgpack.packb(msg, use_bin_type=True)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)


def unpack(t: torch.Tensor) -> dict:
    return msgpack.unpackb(t.numpy().tobytes(), raw=False, strict_map_key=False)


class Channel:
    """This process's end of the group: sends keep their tensors alive until they complete."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.detach().cpu().contiguous()  # gloo moves host memory (CUDA stages stage it)
        self._pending.append((dist.isend(t, dst, tag=tag), t))
        if len(self._pending) > 64:
            # drop the completed ones, never wait here: a send may complete only once its
            # stage has got this far, which can need what this process has yet to send
            self._pending = [(w, x) for w, x in self._pending if not w.is_completed()]

    def flush(self, keep: int = 0) -> None:
        """Wait for all but the last `keep` sends."""
        done, self._pending = self._pending[: len(self._pending) - keep], \
            self._pending[len(self._pending) - keep:]
        for work, _ in done:
            work.wait()

    def send_msg(self, msg: dict, dst: int, tag: int = TAG_CTRL) -> None:
        payload = pack(msg)
        self.isend(torch.tensor([payload.numel()], dtype=torch.long), dst, tag)
        self.isend(payload, dst, tag)

    def recv_msg(self, src: int, tag: int = TAG_CTRL) -> dict:
        n = torch.empty(1, dtype=torch.long)
        dist.recv(n, src, tag=tag)
        payload = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.recv(payload, src, tag=tag)
        return unpack(payload)

    def recv(self, shape, dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        dist.recv(t, src, tag=tag)
        return t
