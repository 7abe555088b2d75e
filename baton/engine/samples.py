"""A request's n samples inside one engine (SamplingParams.n > 1): one prompt, n sequences.

    prompt computed (colocated) or landed (decode side, `start_remote`)
      fork(engine, req)          req stays sample 0; samples 1.. are new requests
                                 `<id>#<i>`, each on `HybridCacheManager.fork` of its cache
                                 (full blocks shared, tail block and state slot copied) and
                                 drawing with `sampling.for_sample(i)` (seed + i)
      each sample decodes, finishes, fails or is aborted on its own; its outputs carry the
      request's id, its `sample` and the samples still open (`SampleFamilies.close`)
    a prefill-only request (the prefill worker) forks without caches: its samples draw their
    first tokens from the same logits and end there; the request's one cache is handed over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.engine.request import Phase, Request, sample_id

if TYPE_CHECKING:
    from baton.engine.engine import Engine


class SampleFamilies:
    """Requests forked into samples: request id -> its samples still open."""

    def __init__(self) -> None:
        self._open: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def start(self, request_id: str, n: int) -> None:
        self._open[request_id] = set(range(n))

    def is_open(self, request_id: str, sample: int) -> bool:
        return sample in self._open.get(request_id, ())

    def pop(self, request_id: str) -> list[int]:
        """Forget the request; its samples that were still open, in order."""
        return sorted(self._open.pop(request_id, ()))

    def close(self, request_id: str, sample: int) -> int:
        """A sample ended: how many of its request's stay open (0 for a request of one)."""
        open_ = self._open.get(request_id)
        if open_ is None:
            return 0
        open_.discard(sample)
        if not open_:
            del self._open[request_id]
        return len(open_)


def fork(engine: Engine, req: Request) -> list[Request]:
    """The request's samples once its prompt is computed: itself as sample 0 and n - 1 new
    requests, each on a fork of its cache unless it is prefill-only (the prefill worker
    draws n first tokens and hands one cache over). All or nothing."""
    n, samples = req.sampling.n, [req]
    try:
        for i in range(1, n):
            s = _sample(req, i)
            if not req.prefill_only:
                engine.cache.fork(req.id, s.id, req.num_computed)
                s.holds_cache = True
                engine.scheduler.running.append(s)
            engine.requests[s.id] = s
            samples.append(s)
    except BaseException:
        for s in samples[1:]:
            engine.abort(s.id)
        raise
    req.sampling = req.sampling.for_sample(0)
    if n > 1:
        engine.samples.start(req.id, n)
    return samples


def _sample(req: Request, i: int) -> Request:
    return Request(sample_id(req.id, i), req.prompt_ids, req.sampling.for_sample(i),
                   req.session, req.prefill_only, phase=Phase.DECODE,
                   num_computed=req.num_computed, cached_tokens=req.cached_tokens,
                   prompt_logprobs=list(req.prompt_logprobs), arrival=req.arrival,
                   family=req.id, sample=i)
