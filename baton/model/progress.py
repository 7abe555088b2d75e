"""Progress bars for long steps: on a terminal only, and only for a step past one second."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, unit: str = "it", total: int | None = None
             ) -> Iterator[T]:
    """`items`, drawing a tqdm bar on stderr when it is a terminal and the loop runs > 1 s."""
    from tqdm import tqdm

    return iter(tqdm(items, desc=desc, unit=unit, total=total, delay=1.0, disable=None,
                     leave=False, file=sys.stderr))
