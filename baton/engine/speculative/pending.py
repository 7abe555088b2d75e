"""The target hiddens whose MTP-head entries are still to write, per speculating request.

The head's entry at position i reads the target hidden h_i and the token t_{i+1}, so every
step leaves its kept positions' hiddens pending until the next token is known (drafter.py).
A step that drafts writes them in its first pass. A step without drafts (more requests
decode than `speculative.max_batch`) appends its one hidden a request and, on the kernels
(`kernel_verify.applies`: an entry's bits do not depend on the batch it is written in),
leaves them pending until something reads them: the request's next draft, its decode-end
snapshot (decoder `_settle`), or LAG_BYTES of rows gathered. Rows grow in a buffer per
request (doubling up to the bound), so an append copies one row.
"""

from __future__ import annotations

import torch

from baton.engine.request import Request
from baton.engine.speculative.drafter import Pending

LAG_BYTES = 1 << 20
"""Target hiddens a request may keep pending while steps do not draft (float32 rows):
1 MiB, 341 rows of the bench 100m, 64 of a 4096-wide model."""


class PendingRows(dict):
    """request id -> `Pending`, with the buffers steps without drafts append to."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.lag_rows = max(8, LAG_BYTES // (4 * hidden_size))
        """Pending rows a request may gather before they are written (memory bound)."""
        self._bufs: dict[str, torch.Tensor] = {}

    def forget(self, rid: str) -> None:
        self.pop(rid, None)
        self._bufs.pop(rid, None)

    def full(self, rid: str) -> bool:
        """Whether `rid`'s pending rows reached the bound (write them before appending)."""
        p = self.get(rid)
        return p is not None and p.hidden.shape[0] >= self.lag_rows

    def append(self, rid: str, pos: int, h: torch.Tensor) -> None:
        """`rid`'s pending rows with the hidden h [1, H] of position `pos` after them."""
        p = self.get(rid)
        if p is None:
            self[rid] = Pending(pos, h)
            return
        n = p.hidden.shape[0]
        buf = self._bufs.get(rid)
        if buf is None or n >= buf.shape[0] or buf.shape[1:] != h.shape[1:] \
                or buf.dtype != h.dtype:
            size = min(self.lag_rows + 1, max(16, 2 * (n + 1)))
            buf = self._bufs[rid] = h.new_empty(size, h.shape[1])
        if p.hidden.data_ptr() != buf.data_ptr():  # rows a verify pass, a prefill or a
            buf[:n] = p.hidden                     # smaller buffer left
        buf[n] = h[0]
        self[rid] = Pending(p.start, buf[: n + 1])


def tokens(req: Request, lo: int, hi: int) -> list[int]:
    """req.all_ids[lo:hi] without building the whole list."""
    n = req.prompt_len
    if hi <= n:
        return req.prompt_ids[lo:hi]
    if lo >= n:
        return req.output_ids[lo - n : hi - n]
    return req.prompt_ids[lo:] + req.output_ids[: hi - n]
