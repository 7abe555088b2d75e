"""Stop strings over streamed text: text is released only once it cannot be the start of a
stop string, and the answer ends before the first stop string found (OpenAI's `stop`)."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string ended the answer)."""
        buf = self._held + text
        if not self.stops:
            return buf, False
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """What is still held back, once the answer ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest end of `buf` that begins some stop string."""
        longest = max(len(s) for s in self.stops) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                return k
        return 0
