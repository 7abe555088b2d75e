"""Router section of the config: routing policy, worker liveness, timeouts and bounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from baton.errors import ConfigError


@dataclass(frozen=True)
class RouterConfig:
    policy: Literal["round_robin", "least_loaded", "prefix_aware", "session"] = "round_robin"
    """Routing policy, looked up by name in router/policies/__init__.py."""
    heartbeat_seconds: float = 1.0
    """Workers heartbeat this often."""
    eject_after_seconds: float = 5.0
    """A worker silent this long is ejected."""
    max_retries: int = 2
    """Retries on another worker pair when one fails before the first token."""
    prefix_tree_max_nodes: int = 100_000
    """Bound on the prefix_aware policy's index: distinct snapshot prefixes tracked (LRU)."""
    prefix_load_slack: int = 8
    """prefix_aware prefers a cached prefix only on workers within this many requests of the
    least busy candidate; past that, load wins over the cache."""
    session_max_entries: int = 100_000
    """Bound on the session policy's session -> workers table (LRU)."""
    host: str = "0.0.0.0"
    """Interface the router's gRPC server listens on (`baton serve` uses 127.0.0.1); on any
    other than loopback without API keys the router logs a warning."""
    api_keys_file: str = ""
    """File of public API keys, one a line: Generate and ListWorkers then need
    `authorization: Bearer <key>` (`BATON_API_KEY` adds one key). Unset: the public API is open."""
    tls_cert_file: str = ""
    """Certificate (PEM) the router's gRPC port and HTTP API serve over TLS; clients need no
    certificate of their own. Set it with tls_key_file. Unset, with `cluster.tls_*` set: the
    router's port is mutual TLS under the cluster CA; both unset: plaintext."""
    tls_key_file: str = ""
    """Private key of tls_cert_file (PEM)."""
    http_port: int = 8000
    """Port of the OpenAI-compatible HTTP API and `/metrics` (0 = pick a free one)."""
    http_max_body_bytes: int = 4 * 2**20
    """Largest HTTP request body accepted; bigger ones get 413 before they are read."""
    server_threads: int = 256
    """gRPC server threads; each in-flight Generate stream holds one."""
    reserve_timeout_seconds: float = 10.0
    """Deadline of a decode worker's Reserve call."""
    prefill_timeout_seconds: float = 300.0
    """Deadline of a Prefill call (prompt compute plus the KV/state transfer)."""
    abort_timeout_seconds: float = 2.0
    """Deadline of each Abort the router sends after a failure or a cancellation."""
    max_queued_requests: int = 128
    """Requests that wait, in arrival order, while every decode worker is full; one more is
    refused at once with RESOURCE_EXHAUSTED (0 = no queue). Each holds a server thread."""
    queue_timeout_s: float = 30.0
    """Longest a request waits in that queue before RESOURCE_EXHAUSTED."""
    max_prompt_bytes: int = 1 << 20
    """Text prompts longer than this (UTF-8 bytes) are refused with INVALID_ARGUMENT before
    they are tokenized."""
    local_prefill_max_tokens: int = 512
    """Conditional disaggregation: when the decode worker holding the deepest snapshot of a
    prompt (a decode-end snapshot of the previous turn, say) has at most this many prompt
    tokens left to compute, the request runs on that decode worker alone, which prefills the
    increment between its decode steps; otherwise through a prefill worker (0 = never)."""

    ship_decode_end_state: bool = True
    """After a turn leaves a decode-end snapshot on its decode worker that no prefill worker
    holds, the router has it shipped (KV + Mamba state, over the transfer layer, in the
    background) to the prefill worker holding the deepest part of it, so a later turn routed
    through a prefill worker restores the whole previous turn instead of recomputing it."""

    def __post_init__(self) -> None:
        if not (isinstance(self.local_prefill_max_tokens, int)
                and self.local_prefill_max_tokens >= 0):
            raise ConfigError(
                f"router.local_prefill_max_tokens must be an integer >= 0 (0 = always through a "
                f"prefill worker), got {self.local_prefill_max_tokens!r}"
            )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = (("tls_cert_file", "tls_key_file") if self.tls_cert_file else
                              ("tls_key_file", "tls_cert_file"))
            raise ConfigError(f"router.{given} is set but router.{missing} is not: TLS needs "
                              "the certificate and its private key; set both or neither")
