"""A worker's Prometheus metrics, served on `worker.metrics_port` at `/metrics`.

Engine and cache figures (running / waiting requests, KV blocks and state slots used and free,
prefix hits, snapshots) are read from the engine loop at scrape time, so the hot path pays
nothing for them; handoffs and requests are counted by the role's service as they happen.
Every series carries `role` ("prefill" / "decode"). One `CollectorRegistry` per worker.
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from baton.contract import Role
from baton.engine.loop import EngineLoop
from baton.errors import BatonError
from baton.worker.load import expert_load, has_moe
from baton.worker.threads import thread_census

disable_created_metrics()  # `_created` series only double every counter's size
log = logging.getLogger("baton.worker")

BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(13))
"""1 KiB .. 16 GiB, x4 apart."""
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)


class WorkerMetrics:
    def __init__(self, role: Role, loop: EngineLoop):
        self.role = role.value
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["role"]
        self.requests = Counter("baton_worker_requests", "Requests this worker ended, by outcome "
                                "(a finish reason, or aborted / failed)", ["role", "outcome"],
                                registry=r)
        self.handoffs = Counter("baton_handoffs", "KV/state handoffs completed (sent by prefill, "
                                "received by decode)", lab, registry=r)
        self.handoff_bytes = Histogram("baton_handoff_bytes", "Bytes moved per handoff", lab,
                                       buckets=BYTES_BUCKETS, registry=r)
        self.handoff_seconds = Histogram("baton_handoff_seconds", "Transfer start to delivery "
                                         "per handoff", lab, buckets=SECONDS_BUCKETS, registry=r)
        self.transfer_failures = Counter("baton_transfer_failures", "Handoffs that failed, "
                                         "expired or were refused", lab, registry=r)
        self.prefill_seconds = Histogram("baton_prefill_seconds", "Prompt compute per request, "
                                         "queueing included", lab, buckets=SECONDS_BUCKETS,
                                         registry=r)
        self.generation_tokens = Counter("baton_worker_generation_tokens", "Tokens this worker "
                                         "sampled", lab, registry=r)
        r.register(_EngineCollector(self.role, loop))
        engine = loop.engine
        weights = engine.weights  # None: a stand-in engine (tests)
        if weights is not None:
            Gauge("baton_model_weight_bytes", "Bytes the served weights take in this process, "
                  "by weight format", ["role", "format"], registry=r
                  ).labels(self.role, weights.format).set(weights.bytes)
        pools = engine.pools
        if pools is not None and pools.has_kv:  # issue 50: the KV format's real bytes
            spec = pools.spec
            Gauge("baton_kv_block_bytes", "Bytes of one KV block over this stage's attention "
                  "layers (K, V and fp8 scales), by stored KV dtype", ["role", "dtype"],
                  registry=r).labels(self.role, str(spec.kv_store_dtype).removeprefix("torch.")
                                     ).set(spec.kv_bytes_per_block())
        r.register(_ThreadCollector(self.role))
        if has_moe(engine):
            r.register(_ExpertCollector(self.role, loop))
        self._server = None

    def request_ended(self, outcome: str) -> None:
        self.requests.labels(self.role, outcome).inc()

    def handoff(self, nbytes: int | None, seconds: float | None) -> None:
        """One handoff done; bytes and seconds where this side measured them."""
        self.handoffs.labels(self.role).inc()
        if nbytes is not None:
            self.handoff_bytes.labels(self.role).observe(nbytes)
        if seconds is not None:
            self.handoff_seconds.labels(self.role).observe(seconds)

    def transfer_failed(self) -> None:
        self.transfer_failures.labels(self.role).inc()

    def serve(self, host: str, port: int) -> int:
        """Starts `/metrics` on `host:port` (0 = a free port); returns the port."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise BatonError(f"worker metrics could not bind {host}:{port} ({e}); set "
                             "worker.metrics_port or --metrics-port to a free port (0 picks "
                             "one)") from e
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _ThreadCollector:
    """The process's threads: `idle_pool` (waiting in a thread pool, which keeps them) or
    `busy` (every other: back at its resting value once the worker holds no request)."""

    def __init__(self, role: str):
        self.role = role

    def collect(self):
        census = thread_census()
        fam = GaugeMetricFamily("baton_worker_threads", "Threads of the worker process: "
                                "idle_pool (waiting in a thread pool) or busy (all others)",
                                labels=["role", "kind"])
        fam.add_metric([self.role, "busy"], census.busy)
        fam.add_metric([self.role, "idle_pool"], census.idle_pool)
        yield fam


class _ExpertCollector:
    """`baton_moe_top_expert_share{role, layer}`: the most loaded expert's share of the tokens
    routed in that MoE layer since start (1/E when balanced, 1.0 when one expert gets all)."""

    def __init__(self, role: str, loop: EngineLoop):
        self.role, self.loop = role, loop

    def collect(self):
        try:
            load = self.loop.call(lambda: expert_load(self.loop.engine))
        except RuntimeError:  # the loop stopped (shutdown): nothing to report
            return
        fam = GaugeMetricFamily("baton_moe_top_expert_share", "Share of a MoE layer's routed "
                                "tokens that went to its most loaded expert, since start",
                                labels=["role", "layer"])
        for layer, counts in load.items():
            fam.add_metric([self.role, str(layer)], max(counts) / max(1, sum(counts)))
        yield fam


class _EngineCollector:
    """Cache and scheduler figures, read between two engine steps."""

    def __init__(self, role: str, loop: EngineLoop):
        self.role, self.loop = role, loop

    def collect(self):
        try:
            figures = self.loop.call(self._read)
        except RuntimeError:  # the loop stopped (shutdown): nothing to report
            return
        for name, kind, doc, value in figures:
            if kind == "tiers":  # value: {tier: {counter: number}} (cache/tiers/stats.py)
                yield from _tier_families(self.role, value)
                continue
            if kind == "histogram":  # value: (buckets [(le, cumulative count)], sum)
                family = HistogramMetricFamily(name, doc, labels=["role"])
                family.add_metric([self.role], value[0], sum_value=value[1])
                yield family
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, doc, labels=["role"])
            family.add_metric([self.role], value)
            yield family

    def _read(self) -> list[tuple[str, str, str, float]]:
        eng = self.loop.engine
        s = eng.cache.stats()
        return [
            ("baton_requests_running", "gauge", "Requests prefilling or decoding",
             len(eng.scheduler.running)),
            ("baton_requests_waiting", "gauge", "Requests queued for their first step",
             len(eng.scheduler.waiting)),
            ("baton_kv_blocks_used", "gauge", "KV blocks off the free list (requests and prefix "
             "tree)", s.blocks_total - s.blocks_free),
            ("baton_kv_blocks_free", "gauge", "KV blocks on the free list", s.blocks_free),
            ("baton_kv_blocks_quarantined", "gauge", "KV blocks of failed transfers kept out of "
             "service until no late byte can land there", s.blocks_quarantined),
            ("baton_kv_blocks_cached", "gauge", "KV blocks the prefix tree holds", s.blocks_cached),
            ("baton_state_slots_used", "gauge", "Mamba state slots held by requests or snapshots",
             s.slots_live + s.slots_snapshot),
            ("baton_state_slots_free", "gauge", "Mamba state slots unused",
             s.slots_total - s.slots_live - s.slots_snapshot),
            ("baton_state_bytes", "gauge", "Bytes of every state slot, live and snapshot (in "
             "their stored dtype)", s.state_bytes),
            ("baton_snapshots_held", "gauge", "Prefix snapshots held (slot snapshots)",
             s.slots_snapshot),
            ("baton_prefix_queried_tokens", "counter", "Prompt tokens looked up in the prefix "
             "cache", s.queried_tokens + s.remote_queried_tokens),
            ("baton_prefix_hit_tokens", "counter", "Prompt tokens served from the prefix cache",
             s.hit_tokens + s.remote_hit_tokens),
            ("baton_prefix_snapshot_hit_tokens", "counter", "Prompt tokens restored from a "
             "Mamba snapshot and its KV (skipped by this worker's own prefill; KV blocks a "
             "decode worker shares for a transfer are not counted)", s.hit_tokens),
            ("baton_prefill_computed_tokens", "counter", "Prompt tokens this worker computed "
             "(on a decode worker: increments it prefilled itself)", eng.prefilled_tokens),
            ("baton_snapshots_taken", "counter", "Mamba state snapshots committed",
             s.snapshots_taken),
            ("baton_snapshots_evicted", "counter", "Snapshots evicted for room", s.snapshots_evicted),
            ("baton_snapshots_retired", "counter", "Snapshots dropped past a session's "
             "max_num_turns", s.snapshots_retired),
            ("baton_kv_blocks_evicted", "counter", "KV blocks evicted from the prefix tree",
             s.blocks_evicted),
            *_spec_figures(eng.spec),
            *_grammar_figures(eng.grammars),
            ("baton_tier", "tiers", "", s.tiers),
        ]


def _grammar_figures(g) -> list[tuple[str, str, str, object]]:
    """Constrained decoding (baton/agents/grammar.py): compiles and masks, with their time."""
    return [
        ("baton_grammar_compiles", "counter", "Grammars compiled (a cached one is not "
         "compiled again)", g.compiles),
        ("baton_grammar_compile_seconds", "counter", "Time compiling grammars", g.compile_seconds),
        ("baton_grammar_masks", "counter", "Logit rows masked by a grammar (a token drawn, "
         "or a speculative verify row)", g.masks),
        ("baton_grammar_mask_seconds", "counter", "Engine-thread time computing and applying "
         "masks (per row: over baton_grammar_masks; masks computed during the forward count "
         "only their wait)", g.mask_seconds),
    ]


TIER_SERIES = {
    "hits": ("counter", "Admissions whose prefix came back from this tier"),
    "hit_tokens": ("counter", "Prompt tokens restored from this tier"),
    "bytes_read": ("counter", "Entry bytes read from this tier"),
    "bytes_written": ("counter", "Entry bytes written to this tier"),
    "load_seconds": ("counter", "Time reading and checking hits (latency = this / hits)"),
    "admitted": ("counter", "Entries written (snapshots evicted from the pool)"),
    "evicted": ("counter", "Entries removed for room by the tier's eviction policy"),
    "rejected": ("counter", "Entries not admitted: larger than the tier"),
    "corrupt": ("counter", "Entries that failed a check (checksum, truncation, missing "
                           "state): removed, counted a miss"),
    "errors": ("counter", "Reads or writes that failed (I/O, store unreachable): a miss each"),
}


def _tier_families(role: str, tiers: dict):
    """baton_tier_<counter>{role, tier}: one series per tier (disk, shared)."""
    for key, (kind, doc) in TIER_SERIES.items():
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = cls(f"baton_tier_{key}", doc, labels=["role", "tier"])
        for tier, counters in tiers.items():
            family.add_metric([role, tier], counters.get(key, 0))
        yield family  # without tiers: a family with no series (the dashboard still finds it)


def _spec_figures(spec) -> list[tuple[str, str, str, object]]:
    """Speculative decoding's counters and accepted-length histogram (none when it is off)."""
    if spec is None:
        return []
    hist = spec.accepted_hist
    buckets, total = [], 0
    for a, n in enumerate(hist):
        total += n
        buckets.append((str(float(a)), total))
    buckets.append(("+Inf", total))
    return [
        ("baton_spec_draft_tokens", "counter", "MTP draft tokens the target verified",
         spec.draft_tokens),
        ("baton_spec_accepted_tokens", "counter", "MTP draft tokens the target accepted",
         spec.accepted_tokens),
        ("baton_spec_accepted_length", "histogram", "Drafts accepted per request per "
         "speculative step (0..K)", (buckets, float(sum(a * n for a, n in enumerate(hist))))),
    ]
