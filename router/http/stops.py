"""Stop strings over streamed text: text is released only once it cannot be the start of a
stop string, and the answer ends before the first stop string completed (OpenAI's `stop`).

"First completed" is the one that ends first, as when the text is checked token by token: with
stops `abcdef` and `cd`, `abcdef` ends the answer at `cd`, leaving `ab`, however it is chunked.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.through_stop = ""
        """After a hit: the text fed since the last release, up to the end of the stop string
        (what the answer's tokens had to produce for the stop string to complete)."""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string ended the answer)."""
        buf = self._held + text
        if not self.stops:
            return buf, False
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            end, start = min(hits)
            self._held = ""
            self.through_stop = buf[:end]
            return buf[:start], True
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
