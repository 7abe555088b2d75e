"""EventRouter: events of requests given up (`forget`) do not stay behind.

Aborting a request at a transfer endpoint queues its failure event, which the poller brings
after the worker forgot the request: before, it was kept KEEP_SECONDS (10 minutes) for a
waiter that never comes, one per request cancelled during its handoff.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from baton.worker.events import EventRouter


@dataclass
class Ev:
    request_id: str
    ok: bool
    error: str | None = None


class Endpoint:
    """A transfer endpoint whose queued events the router's next poll takes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queued: list[Ev] = []
        self.polls = 0

    def push(self, *events: Ev) -> None:
        with self.lock:
            self.queued.extend(events)

    def poll(self) -> list[Ev]:
        with self.lock:
            self.polls += 1
            out, self.queued = self.queued, []
            return out


def router(ep: Endpoint, failures=None) -> EventRouter:
    cb = None if failures is None else (lambda rid, why: failures.append(rid))
    return EventRouter(ep.poll, lambda: 0.001, on_failure=cb)


def settle(ep: Endpoint, polls: int = 3) -> None:
    start = ep.polls
    while ep.polls < start + polls:
        time.sleep(0.001)


def test_the_event_of_a_request_given_up_is_dropped_when_it_arrives():
    ep, failures = Endpoint(), []
    events = router(ep, failures)
    try:
        ep.push(Ev("aborted", False, "aborted by the decode worker"))  # queued by the abort
        events.forget("aborted")
        ep.push(Ev("kept", True))  # nobody waits yet: kept for a late Decode
        settle(ep)
        assert events.tracked() == {"transfer_events": 1, "transfer_events_forgotten": 0,
                                    "transfer_waiters": 0}
        assert failures == ["aborted"]  # still seen as a failure (frees a reservation)
        assert events.wait("kept", 1.0) == Ev("kept", True)
        assert events.wait("aborted", 0.05) is None
        assert events.tracked()["transfer_events"] == 0
    finally:
        events.stop()


def test_a_kept_event_is_dropped_by_forget():
    ep = Endpoint()
    events = router(ep)
    try:
        ep.push(Ev("landed", True))
        settle(ep)
        assert events.tracked()["transfer_events"] == 1
        events.forget("landed")  # e.g. its lease ran out without a Decode
        settle(ep)
        assert events.tracked() == {"transfer_events": 0, "transfer_events_forgotten": 0,
                                    "transfer_waiters": 0}
    finally:
        events.stop()


def test_a_thread_already_waiting_still_gets_the_event_of_a_forgotten_request():
    ep = Endpoint()
    events = router(ep)
    got = []
    waiter = threading.Thread(target=lambda: got.append(events.wait("r", 5.0)))
    try:
        waiter.start()
        while events.tracked()["transfer_waiters"] == 0:
            time.sleep(0.001)
        ep.push(Ev("r", False, "aborted"))
        events.forget("r")
        waiter.join(5)
        assert got == [Ev("r", False, "aborted")]
        settle(ep)
        assert events.tracked() == {"transfer_events": 0, "transfer_events_forgotten": 0,
                                    "transfer_waiters": 0}
    finally:
        events.stop()


def test_a_request_forgotten_long_ago_can_have_a_new_event():
    """Marks last one poll: a later request under the same id is not starved (ids are unique
    per attempt in practice, but a mark must never outlive its purpose)."""
    ep = Endpoint()
    events = router(ep)
    try:
        events.forget("r")
        settle(ep)
        ep.push(Ev("r", True))
        assert events.wait("r", 1.0) == Ev("r", True)
    finally:
        events.stop()
