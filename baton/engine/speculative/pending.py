"""The target hiddens whose MTP-head entries are still to write, per speculating request.

The head's entry at position i reads the target hidden h_i and the token t_{i+1}, so every
step leaves its kept positions' hiddens pending until the next token is known (drafter.py).
A step that drafts writes them in its first pass. A step without drafts (more requests
decode than `speculative.max_batch`) appends its one hidden a request and, on the kernels
(`kernel_verify.applies`: an entry's bits do not depend on the batch it is written in),
leaves them pending until something reads them: the request's next draft, its decode-end
snapshot (decoder `_settle`), or LAG_BYTES of rows gathered. An append keeps a reference
to the step's hiddens (no copy); the rows are gathered when the request's entry is read.
"""

from __future__ import annotations

import torch

from baton.engine.request import Request
from baton.engine.speculative.drafter import Pending

LAG_BYTES = 1 << 20
"""Target hiddens a request may keep pending while steps do not draft (float32 rows):
1 MiB, 341 rows of the bench 100m, 64 of a 4096-wide model."""


class PendingRows(dict):
    """request id -> `Pending`. A step without drafts appends its rows by reference
    (`append_rows`: the step's hidden tensor and the row, no copy), and they are gathered into
    the request's `Pending` when it is read (`self[rid]`): a batch over `max_batch` pays one
    list append a request a step for the head, not a row copy."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.lag_rows = max(8, LAG_BYTES // (4 * hidden_size))
        """Pending rows a request may gather before they are written (memory bound)."""
        self._lag: dict[str, list[tuple[torch.Tensor, int]]] = {}
        """Rows appended after the request's `Pending`: (a step's hiddens [B, H], row)."""
        self._count: dict[str, int] = {}
        """Rows of a request with lagging rows: its `Pending`'s and the lagging ones."""
        self.over: set[str] = set()
        """Requests whose rows reached `lag_rows` (`full`)."""

    def __getitem__(self, rid: str) -> Pending:
        p = dict.__getitem__(self, rid)
        lag = self._lag.pop(rid, None)
        if lag is None:
            return p
        self._count.pop(rid, None)
        self.over.discard(rid)
        rows = torch.stack([h[i] for h, i in lag])
        p = Pending(p.start, torch.cat([p.hidden, rows]) if p.hidden.shape[0] else rows)
        dict.__setitem__(self, rid, p)
        return p

    def __setitem__(self, rid: str, p: Pending) -> None:
        self._drop_lag(rid)
        dict.__setitem__(self, rid, p)

    def __delitem__(self, rid: str) -> None:
        self._drop_lag(rid)
        dict.__delitem__(self, rid)

    def _drop_lag(self, rid: str) -> None:
        if self._lag.pop(rid, None) is not None:
            self._count.pop(rid, None)
            self.over.discard(rid)

    def forget(self, rid: str) -> None:
        self._drop_lag(rid)
        self.pop(rid, None)

    def full(self, rid: str) -> bool:
        """Whether `rid`'s pending rows reached the bound (write them before appending)."""
        if rid in self._lag:
            return rid in self.over
        p = self.get(rid)
        return p is not None and p.hidden.shape[0] >= self.lag_rows

    def append(self, rid: str, pos: int, h: torch.Tensor) -> None:
        """`rid`'s pending rows with the hidden h [1, H] of position `pos` after them."""
        self.append_rows([(rid, pos, 0)], h)

    def append_rows(self, rows: list[tuple[str, int, int]], h: torch.Tensor) -> None:
        """(request id, position, row of h) each: the request's pending rows with h[row]
        after them, by reference (h [B, H] must not change afterwards)."""
        lag, count = self._lag, self._count
        for rid, pos, i in rows:
            rows_of = lag.get(rid)
            if rows_of is None:
                p = self.get(rid)
                if p is None:
                    dict.__setitem__(self, rid, Pending(pos, h[i : i + 1]))
                    continue
                rows_of = lag[rid] = []
                count[rid] = p.hidden.shape[0]
            rows_of.append((h, i))
            count[rid] += 1
            if count[rid] >= self.lag_rows:
                self.over.add(rid)


def tokens(req: Request, lo: int, hi: int) -> list[int]:
    """req.all_ids[lo:hi] without building the whole list."""
    n = req.prompt_len
    if hi <= n:
        return req.prompt_ids[lo:hi]
    if lo >= n:
        return req.output_ids[lo - n : hi - n]
    return req.prompt_ids[lo:] + req.output_ids[: hi - n]
