"""session: a session's requests stay on the workers its first request got, while they live.

New sessions and requests without a session id go to the least loaded workers. When a
session's worker is gone (ejected, or it failed this request) the session moves to the
least loaded live one. The table is LRU-bounded by `session_max_entries`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from baton.config.router import RouterConfig
from baton.contract import WorkerView
from router.policies.base import RouteChoice, RouteRequest, RoutingPolicy, least_loaded


class SessionPolicy(RoutingPolicy):
    def __init__(self, config: RouterConfig):
        super().__init__(config)
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[str]:
        """Session ids held, least recently used first."""
        with self._lock:
            return list(self._sessions)

    def choose(
        self, request: RouteRequest, prefill: Sequence[WorkerView], decode: Sequence[WorkerView]
    ) -> RouteChoice:
        if not request.session_id:
            return RouteChoice(least_loaded(prefill), least_loaded(decode))
        with self._lock:
            pid, did = self._sessions.get(request.session_id, ("", ""))
            choice = RouteChoice(_sticky(pid, prefill), _sticky(did, decode))
            self._sessions[request.session_id] = (choice.prefill.worker_id, choice.decode.worker_id)
            self._sessions.move_to_end(request.session_id)
            while len(self._sessions) > self.config.session_max_entries:
                self._sessions.popitem(last=False)
        return choice


def _sticky(worker_id: str, candidates: Sequence[WorkerView]) -> WorkerView:
    for w in candidates:
        if w.worker_id == worker_id:
            return w
    return least_loaded(candidates)
