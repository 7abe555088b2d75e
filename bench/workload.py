"""The multi-turn agentic workload shared by `bench reuse` and `bench e2e`.

Sessions in groups share a system prompt; each turn appends a user message to the
previous prompt + answer, growing the prompt toward `max_len` tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    sessions: int = 32
    turns: int = 6
    system_len: int = 1024
    group_size: int = 4
    message_len: int = 400
    answer_len: int = 64
    vocab: int = 256
    seed: int = 0

    def system_prompt(self, session: int) -> list[int]:
        rng = random.Random(self.seed * 7919 + session // self.group_size)
        return [rng.randrange(3, self.vocab) for _ in range(self.system_len)]

    def message(self, session: int, turn: int) -> list[int]:
        rng = random.Random((self.seed + 1) * 104729 + session * 1000 + turn)
        return [rng.randrange(3, self.vocab) for _ in range(self.message_len)]


def oracle_tokens(prompt: list[int], seen: list[list[int]]) -> int:
    """Prompt tokens that must be computed at minimum: past the longest prefix seen before."""
    best = 0
    for s in seen:
        n = 0
        for a, b in zip(prompt, s, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return len(prompt) - min(best, len(prompt) - 1)
