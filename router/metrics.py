"""The router's Prometheus metrics: what clients see (requests by outcome, TTFT, inter-token
latency, end-to-end time, tokens, retries) and what the registry knows (workers, ejections).

One `RouterMetrics` per router, on its own `CollectorRegistry` (several routers may share a
test process); served on the HTTP port's `/metrics`. Every API (gRPC, HTTP) feeds the same
metrics through a `RequestTimer`, labelled by `api`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from baton.contract import GenerateChunk, Role
from baton.contract.status import status_of
from baton.worker.threads import thread_census
from router.registry import Registry

disable_created_metrics()  # `_created` series only double every counter's size
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                       2.5)
OUTCOME_OF_STATUS = {
    "INVALID_ARGUMENT": "invalid", "RESOURCE_EXHAUSTED": "capacity",
    "UNAVAILABLE": "unavailable", "CANCELLED": "cancelled",
}
"""Outcome label of a request that ended in an error, by its status code's name."""


class RouterMetrics:
    def __init__(self, workers: Registry, paths=None,
                 tracked: Callable[[], dict[str, int]] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "baton_router_requests", "Requests ended, by API and outcome (a finish reason, "
            "or cancelled / invalid / capacity / unavailable / error)", ["api", "outcome"],
            registry=r)
        self.running = Gauge("baton_router_requests_running", "Requests in flight", registry=r)
        self.ttft = Histogram("baton_router_time_to_first_token_seconds",
                              "Arrival to the first token", buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("baton_router_inter_token_latency_seconds",
                             "Gap between consecutive tokens of a request",
                             buckets=TOKEN_GAP_BUCKETS_S, registry=r)
        self.e2e = Histogram("baton_router_e2e_request_latency_seconds",
                             "Arrival to the last token of a finished request",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("baton_router_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.cached_tokens = Counter("baton_router_cached_prompt_tokens", "Prompt tokens of "
                                     "finished requests served from a prefix cache", registry=r)
        self.constrained = Counter(
            "baton_router_chat_requests", "Chat requests by tool_choice (none / auto / required "
            "/ named) and response_format (text / json_object / json_schema / "
            "structured_outputs)", ["tool_choice", "response_format"], registry=r)
        self.generation_tokens = Counter("baton_router_generation_tokens",
                                         "Tokens streamed to clients", registry=r)
        self.retries = Counter("baton_router_retries", "Requests moved to another worker pair "
                               "after a failure before their first token", registry=r)
        r.register(_RegistryCollector(workers))
        if paths is not None:
            r.register(_PathCollector(paths))
        if tracked is not None:
            r.register(_TrackedCollector(tracked))

    def count_constraint(self, tool_choice: str, response_format: str) -> None:
        """A chat request, by its tool_choice and response_format (docs/agents.md)."""
        self.constrained.labels(tool_choice, response_format).inc()

    def timer(self, api: str) -> RequestTimer:
        return RequestTimer(self, api)

    def track(self, chunks: Iterator[GenerateChunk], api: str) -> Iterator[GenerateChunk]:
        """Passes `chunks` through, timing them; the outcome is counted when the stream ends."""
        timer = self.timer(api)
        try:
            for chunk in chunks:
                timer.chunk(chunk)
                yield chunk
        except BaseException as e:
            timer.fail(e)
            raise
        finally:
            timer.end()
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # a generator's own finally aborts the workers of an unfinished request


class RequestTimer:
    """One request's metrics: `chunk()` for each chunk, then `end()` (or `fail()` first)."""

    def __init__(self, metrics: RouterMetrics, api: str):
        self.m, self.api = metrics, api
        self.start = self.last = time.perf_counter()
        self.outcome = "cancelled"
        """Until a chunk with a summary (or an error) says otherwise: the client left first."""
        self.first_seen = False
        self._ended = False
        metrics.running.inc()

    def chunk(self, chunk: GenerateChunk) -> None:
        now, n = time.perf_counter(), len(chunk.token_ids)
        if n:
            if not self.first_seen:
                self.m.ttft.observe(now - self.start)
                self.first_seen = True
            else:  # a chunk of k tokens covers k gaps since the previous chunk
                gap = (now - self.last) / n
                for _ in range(n):
                    self.m.itl.observe(gap)
            self.last = now
            self.m.generation_tokens.inc(n)
        s = chunk.summary
        if s is not None:
            self.outcome = s.finish_reason.value
            self.m.e2e.observe(now - self.start)
            self.m.prompt_tokens.inc(s.prompt_tokens)
            self.m.cached_tokens.inc(s.cached_tokens)
            self.m.retries.inc(s.retries)
            self.end()  # counted before the client sees the last chunk

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, GeneratorExit):
            return
        code = status_of(exc)
        self.outcome = OUTCOME_OF_STATUS.get(code.name if code else "", "error")

    def end(self, outcome: str | None = None) -> None:
        """Counts the request once; `outcome` overrides (a stop string ends it as `stop`)."""
        if self._ended:
            return
        self._ended = True
        self.m.running.dec()
        self.m.requests.labels(self.api, outcome or self.outcome).inc()


class _RegistryCollector:
    """Read at scrape time: live workers by role and workers ejected for silence."""

    def __init__(self, workers: Registry):
        self.workers = workers

    def collect(self):
        live = GaugeMetricFamily("baton_router_workers", "Live registered workers", labels=["role"])
        views = self.workers.workers()
        for role in Role:
            live.add_metric([role.value], sum(1 for v in views if v.role is role))
        yield live
        ej = CounterMetricFamily("baton_router_worker_ejections", "Workers ejected after "
                                 "missing heartbeats")
        ej.add_metric([], self.workers.ejected)
        yield ej


class _PathCollector:
    """Requests by path: `decode_only` (conditional disaggregation) or `prefill_decode`, with
    the reason of the choice (router/conditional.py)."""

    def __init__(self, paths):
        self.paths = paths

    def collect(self):
        fam = CounterMetricFamily("baton_router_request_paths", "Requests by the path they took "
                                  "(decode_only: the decode worker alone; prefill_decode) and "
                                  "why", labels=["path", "reason"])
        for (path, reason), n in sorted(self.paths.snapshot().items()):
            fam.add_metric([path, reason], n)
        yield fam


class _TrackedCollector:
    """Debug gauges, read at scrape time: the router's per-request bookkeeping and its threads.
    At rest (no request running, no shipment on its way) every `baton_router_tracked` is 0 and
    `baton_router_threads{kind="busy"}` is back at its resting value, however many requests
    were cancelled (the pools keep their idle threads: `kind="idle_pool"`)."""

    def __init__(self, tracked: Callable[[], dict[str, int]]):
        self.tracked = tracked

    def collect(self):
        fam = GaugeMetricFamily("baton_router_tracked", "Per-request state the router holds "
                                "now, by kind (worker_streams, prefill_calls, registry_inflight, "
                                "peer_watches, queued, shipments); 0 at rest", labels=["what"])
        for what, n in sorted(self.tracked().items()):
            fam.add_metric([what], n)
        yield fam
        census = thread_census()
        threads = GaugeMetricFamily("baton_router_threads", "Threads of the router process: "
                                    "idle_pool (waiting in a thread pool) or busy (all others)",
                                    labels=["kind"])
        threads.add_metric(["busy"], census.busy)
        threads.add_metric(["idle_pool"], census.idle_pool)
        yield threads
