"""Per-conversation retention: keep the snapshots of a session's last `max_num_turns` turns.

A turn is one request of the session; its snapshots are those its commits and its
decode end took. When a new turn is admitted, turns beyond the limit lose their
snapshots (their KV stays in the tree under normal LRU).
"""

from __future__ import annotations

from collections import deque

from baton.cache.tree import PrefixTree, Snapshot


class SessionTurns:
    def __init__(self, max_num_turns: int):
        self.max_num_turns = max_num_turns  # 0 = no limit
        self._turns: dict[str, deque[list[Snapshot]]] = {}
        self.retired = 0

    def start_turn(self, session: str, tree: PrefixTree) -> list[Snapshot]:
        """Open a turn for `session`, drop snapshots of turns beyond the limit; the new turn."""
        turns = self._turns.setdefault(session, deque())
        turn: list[Snapshot] = []
        turns.append(turn)
        while self.max_num_turns and len(turns) > self.max_num_turns:
            for snap in turns.popleft():
                if snap.alive:
                    tree.drop(snap)
                    self.retired += 1
        self._forget_dead(tree)
        return turn

    def _forget_dead(self, tree: PrefixTree) -> None:
        """Keep the session map bounded by what the tree can hold."""
        if len(self._turns) <= 4 * max(tree.slots.num_slots, 1):
            return
        for ts in self._turns.values():
            for t in ts:
                t[:] = [x for x in t if x.alive]
        for s in [s for s, ts in self._turns.items() if not any(ts)]:
            del self._turns[s]

    def num_sessions(self) -> int:
        return len(self._turns)
