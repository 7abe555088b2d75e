"""The last target hidden state of recent decode-end snapshots, by their tokens: a request
resuming from such a snapshot writes the MTP head's entry that lags there (decoder.py)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch


class HiddenCache:
    """At most `size` hidden states by token sequence (a digest of it), oldest dropped first."""

    def __init__(self, size: int = 1024):
        self.size = size
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    @staticmethod
    def _key(tokens: list[int]) -> bytes:
        return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()

    def put(self, tokens: list[int], hidden: torch.Tensor) -> None:
        key = self._key(tokens)
        self._items[key] = hidden
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, tokens: list[int]) -> torch.Tensor | None:
        return self._items.get(self._key(tokens))

    def __len__(self) -> int:
        return len(self._items)
