"""When a decode worker dies: cancel the prefills that work for it, move its streams.

`PeerWatch`: which attempts wait on which decode worker (their prefill computes or transfers
for it); `lost(worker_id)` tells each at once, so the prefill is cancelled within the second
the router learns of the death (worker_client's liveness probe), not at lease expiry.

`resumed(...)`: the input that continues a request whose decode worker died after `sent`
tokens were streamed: prompt + those tokens, max_tokens less them. With greedy or seeded
sampling (a seeded draw depends only on seed and sequence position) the new pair produces
exactly the tokens the dead worker would have.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from baton.contract import GenerateInput

log = logging.getLogger(__name__)


class PeerWatch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers: dict[str, dict[int, Callable[[], None]]] = {}
        self._ids = itertools.count()

    @contextmanager
    def watching(self, worker_id: str, on_lost: Callable[[], None]) -> Iterator[None]:
        """While inside, `on_lost()` runs (on the reporting thread) if `worker_id` is lost."""
        n = next(self._ids)
        with self._lock:
            self._watchers.setdefault(worker_id, {})[n] = on_lost
        try:
            yield
        finally:
            with self._lock:
                watchers = self._watchers.get(worker_id)
                if watchers is not None:
                    watchers.pop(n, None)
                    if not watchers:
                        del self._watchers[worker_id]

    def watched(self, worker_id: str) -> int:
        with self._lock:
            return len(self._watchers.get(worker_id, ()))

    def total(self) -> int:
        """Attempts watching any worker."""
        with self._lock:
            return sum(len(w) for w in self._watchers.values())

    def lost(self, worker_id: str) -> int:
        """`worker_id` died: runs every watcher's callback; returns how many there were."""
        with self._lock:
            callbacks = list(self._watchers.pop(worker_id, {}).values())
        for cb in callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001 - one watcher's failure must not skip the rest
                log.exception("a watcher of lost worker %s failed", worker_id)
        if callbacks:
            log.warning("decode worker %s lost: cancelled %d prefill(s) working for it",
                        worker_id, len(callbacks))
        return len(callbacks)


def resumed(inp: GenerateInput, prompt: Sequence[int], sent: Sequence[int]) -> tuple[
        tuple[int, ...], GenerateInput]:
    """(prompt, input) that continue `inp` after `sent` tokens; ValueError when none remain."""
    left = inp.sampling.max_tokens - len(sent)
    if left < 1:
        raise ValueError(f"all {inp.sampling.max_tokens} tokens were sent already")
    # the prompt's logprobs went out with the first token; min_tokens counts what was sent
    s = inp.sampling
    # a grammar's matcher replays the tokens sent (they now end the prompt)
    replay = s.grammar_replay + len(sent) if s.grammar else 0
    return tuple(prompt) + tuple(sent), replace(inp, sampling=replace(
        s, max_tokens=left, prompt_logprobs=None, min_tokens=max(0, s.min_tokens - len(sent)),
        grammar_replay=replay))
