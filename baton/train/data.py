"""Token streams for training and held-out evaluation.

    train     every train file's ids then </s>, one uint16 stream; the batch of step s is B
              windows of T+1 ids at offsets drawn from (seed, s) alone, so a resumed run
              sees exactly the batches an uninterrupted one would
    held-out  the committed held-out files the same way, cut into consecutive windows of
              T+1 ids overlapping by one (every id after the first is predicted once)

Bits per byte = the predicted tokens' nats / ln 2 / the UTF-8 bytes those tokens stand for.
"""

from __future__ import annotations

import math

import numpy as np
import torch

EOS = 2


def stream(tok, texts: list[str]) -> np.ndarray:
    """The ids of `texts`, each followed by </s>, as one uint16 array."""
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(EOS)
    return np.asarray(out, dtype=np.uint16)


def batch(ids: np.ndarray, seed: int, step: int, batch_size: int, seq: int) -> torch.Tensor:
    """[batch_size, seq + 1] windows of `ids` for `step` (a function of (seed, step) only)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq - 1, size=batch_size)
    return torch.from_numpy(np.stack([ids[s : s + seq + 1] for s in starts]).astype(np.int64))


def windows(ids: np.ndarray, seq: int, max_tokens: int | None = None) -> torch.Tensor:
    """Consecutive [n, seq + 1] windows covering `ids` (the last partial one dropped), at most
    `max_tokens` predicted tokens."""
    n = (len(ids) - 1) // seq
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq))
    return torch.stack([torch.from_numpy(ids[i * seq : i * seq + seq + 1].astype(np.int64))
                        for i in range(n)])


def bits_per_byte(nats: float, targets: torch.Tensor, token_bytes: torch.Tensor) -> float:
    return nats / math.log(2) / float(token_bytes[targets].sum())
