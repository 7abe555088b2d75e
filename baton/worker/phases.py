"""A request's phases: where its time to first token goes, process by process.

Each process times its own part of one request with its own clock and hands the durations
(milliseconds, by phase name) on with the request: the prefill worker to the router in the
Prefill call's trailing metadata, the router to its client in the Generate stream's trailing
metadata (and the `--json` output's `phases_ms`). The names, in the order they happen:

prefill worker (`p_`)
  p_dest_wait   the request's arrival to its destination's (the router's Reserve; overlaps
                the compute)
  p_claim       destination checked, decode peer connected, write right asked (overlaps)
  p_queue       arrival to the first forward of its prompt (waiting behind other requests)
  p_forward     the prompt's forwards, every chunk (prefill compute)
  p_sample      the first token's draw (sampling, logprobs)
  p_output      the drawn token reaching the request's thread
  p_post        the transfer planned and posted (layer-wise: 0, posted during the forward)
  p_landed      posted to the sender's DONE, as seen by its poller
  p_wake        the poller's event reaching the request's thread
  p_release     the prefill copy freed (engine call) and the reply built
  p_total       arrival to the reply
router (`r_`)
  r_route       Generate's arrival to the Prefill call (admission, routing, decisions)
  r_reserve     the decode worker's Reserve
  r_prefill     the Prefill call, opened to its reply
  r_rpc         r_prefill minus p_total: gRPC both ways, stream set-up
  r_open        of r_rpc: the call opened to the request's arrival at the prefill worker
  r_reply       of r_rpc: the reply built to the router holding it (r_open and r_reply only
                when both processes share a host: they compare its monotonic clock)
client (`bench handoff`, same host)
  c_to_client   its time to first token minus r_ttft, of which
  c_in          its call to Generate's arrival at the router, and
  c_out         the router's first chunk to its own receipt of it
  r_first_chunk the Prefill reply to the first chunk leaving the router
  r_ttft        Generate's arrival to the first chunk leaving the router
  r_decode_first the first chunk to the decode worker's first Decode chunk (decode admit)
A client adds its own: its time to first token minus r_ttft is the stream to it.
"""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("baton.phases")

AT_ARRIVAL, AT_REPLY = "at_p_arrival", "at_p_reply"
"""Not phases but instants (the host's time.monotonic(), ms): the prefill worker's request
arrival and reply built, which the router turns into `r_open` and `r_reply` and drops."""
AT_FIRST_CHUNK = "at_r_first_chunk"
"""The instant the router's first chunk left (ms), for a client on the same host to split its
own share (`bench handoff`: `c_in`, `c_out`); `durations` drops it."""
METADATA_KEY = "baton-phases-ms"
"""gRPC trailing metadata key carrying a JSON object {phase: milliseconds}."""
MAX_METADATA_BYTES = 2048
"""Longer values are not read (a peer's debug field must not cost memory)."""


class Clock:
    """Named instants of one request (time.perf_counter), turned into durations."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.at: dict[str, float] = {}

    def mark(self, name: str) -> float:
        now = self.at[name] = time.perf_counter()
        return now

    def ms(self, start: str | None, end: str) -> float | None:
        """Milliseconds from mark `start` (None: the clock's start) to mark `end`, or None
        when either was never marked."""
        a = self.t0 if start is None else self.at.get(start)
        b = self.at.get(end)
        return None if a is None or b is None else (b - a) * 1000


def mono_ms(a: float | None, b: float | None) -> float | None:
    """Milliseconds between two time.monotonic() instants (None if either is unknown)."""
    return None if a is None or b is None else (b - a) * 1000


def split_rpc(arrival: float | None, reply: float | None, opened: float | None,
              replied: float | None) -> tuple[float | None, float | None]:
    """(r_open, r_reply) ms: the worker's arrival and reply instants (ms) against the router's
    call opened and reply held (time.monotonic(), s); (None, None) when one is unknown or the
    two clocks are not one host's (a negative or longer-than-the-call share)."""
    if None in (arrival, reply, opened, replied):
        return None, None
    a, b = arrival - opened * 1000, replied * 1000 - reply
    call = (replied - opened) * 1000
    return (a, b) if 0 <= a <= call and 0 <= b <= call else (None, None)


def durations(phases: dict[str, float]) -> dict[str, float]:
    """The phases without the instants (`at_` keys) that travel with them."""
    return {k: v for k, v in phases.items() if not k.startswith("at_")}


def clean(phases: dict[str, float | None]) -> dict[str, float]:
    """The phases that were measured, rounded to microseconds (negative clock noise: 0)."""
    return {k: round(max(0.0, v), 3) for k, v in phases.items() if v is not None}


def to_metadata(phases: dict[str, float]) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, json.dumps(phases, separators=(",", ":"))),) if phases else ()


def from_metadata(metadata) -> dict[str, float]:
    """The phases in gRPC metadata (a sequence of (key, value)), {} when none or malformed."""
    for key, value in metadata or ():
        if key != METADATA_KEY:
            continue
        if len(value) > MAX_METADATA_BYTES:
            log.debug("phases metadata of %d bytes ignored (limit %d)", len(value),
                      MAX_METADATA_BYTES)
            return {}
        try:
            raw = json.loads(value)
            return {str(k): float(v) for k, v in raw.items()}
        except (ValueError, TypeError, AttributeError) as e:
            log.debug("malformed phases metadata ignored: %s", e)
            return {}
    return {}


def line(request_id: str, phases: dict[str, float]) -> str:
    """One debug log line: `phases REQUEST name=ms ...`."""
    return f"phases {request_id} " + " ".join(f"{k}={v:.3f}" for k, v in phases.items())
