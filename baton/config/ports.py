"""Port settings that are one port, any free port, or a range (for firewalls that open a range).

    0            any free port the OS picks
    50051        exactly this port
    "50100-50199" the first free port of the range, both ends included
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeVar

from baton.errors import ConfigError

MAX_PORT = 65535
T = TypeVar("T")


class PortRange(NamedTuple):
    first: int
    last: int
    """Both ends included; (0, 0) means any free port."""

    @property
    def any(self) -> bool:
        return self.last == 0

    def candidates(self) -> range:
        """Ports to try binding, in order (just 0 for any free port)."""
        return range(self.first, self.last + 1)

    def bind(self, bind: Callable[[int], T], key: str) -> T:
        """`bind(port)` for each candidate in order until one succeeds (an OSError or
        RuntimeError means taken); the error after the last names the range and `key`."""
        last: Exception | None = None
        for port in self.candidates():
            try:
                return bind(port)
            except (OSError, RuntimeError) as e:
                last = e
        raise ConfigError(f"{key}: no free port in {self} ({last}); widen the range or free a "
                          "port")

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


ANY_PORT = PortRange(0, 0)


def port_range(value: int | str, where: str) -> PortRange:
    """Parse `value` (0, N, "N" or "A-B"); a ConfigError names `where` and the accepted forms."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _bad(value, where)
    text = str(value).strip()
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last if sep else first)
    except ValueError:
        raise _bad(value, where) from None
    if lo == hi == 0:
        return ANY_PORT
    if not 1 <= lo <= hi <= MAX_PORT:
        raise _bad(value, where)
    return PortRange(lo, hi)


def _bad(value, where: str) -> ConfigError:
    return ConfigError(f"{where}: {value!r} is not a port; use 0 (any free port), a port "
                       f"1-{MAX_PORT}, or a range \"FIRST-LAST\" with FIRST <= LAST "
                       "(e.g. \"50100-50199\")")
