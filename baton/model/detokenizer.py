"""Incremental detokenization: the text of each batch of new tokens, without re-decoding the
whole answer every time (which made streaming O(n^2) in the answer length).

    ids:   t0 t1 t2 | t3 t4 | t5 t6
                      ^prefix  ^read
    emitted text = decode(ids[:read]); the next push decodes only ids[prefix:] and emits
    what it adds to decode(ids[prefix:read]).

Text is emitted only up to a point where the window's text does not end in U+FFFD (so no
multi-byte character is cut in two) and has grown; there the tokenizer's decoder holds
nothing back, so decoding restarts cleanly at that token. The previous emission's tokens are
kept as context (as vLLM and Hugging Face's TextStreamer do) for tokenizers whose text
depends on the token before (leading spaces). `flush()` emits whatever is left. The deltas
concatenated equal `tokenizer.decode(ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CUT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        """Start of the decode window: the previous emission's first token (context)."""
        self._read = 0
        """Tokens before this one are already emitted as text."""

    def push(self, ids: Sequence[int]) -> str:
        """Adds tokens; returns the text they complete (possibly empty, held for more)."""
        self._ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text of every token not yet emitted, complete or not: call at the end."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        seen = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if not final and (len(text) <= len(seen) or text.endswith(_CUT)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]
