"""Text <-> token ids: the checkpoint's `tokenizer.json` when present, else raw bytes.

Byte fallback id mapping (fits any vocab >= 259):
    0 = pad, 1 = bos, 2 = eos, 3 + b = byte b (0..255)
Ids outside 3..258 decode to nothing; invalid UTF-8 decodes with U+FFFD replacement.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

log = logging.getLogger("baton.model")

BYTE_OFFSET = 3


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        raw = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return raw.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer; special tokens are neither added nor decoded."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.name = f"tokenizer.json:{path.parent.name}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        log.info("tokenizer: %s", path)
        return HFTokenizer(path)
    log.info("tokenizer: no tokenizer.json in %s, using the byte-level fallback", model_dir)
    return ByteTokenizer()
