"""Every `BATON_*` environment switch, typed and documented in one place.

A switch is read where it takes effect, through its `Env` here (never `os.environ` directly),
so `python -m baton.envs` lists them all. A setting a deployment chooses belongs in the
config file instead; these are process-level switches: tests, debugging, tuning.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Env(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        """The value in this process's environment now (the default when unset or empty)."""
        raw = os.environ.get(self.name, "")
        return self.default if raw == "" else self.parse(raw)

    def is_set(self) -> bool:
        return os.environ.get(self.name, "") != ""


def _modules(raw: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in raw.split(",") if m.strip())


ALL: list[Env] = []


def _env(name: str, default: T, parse: Callable[[str], T], doc: str) -> Env[T]:
    e = Env(name, default, parse, doc)
    ALL.append(e)
    return e


FAMILY_MODULES = _env(
    "BATON_FAMILY_MODULES", (), _modules,
    "Comma-separated modules imported with the built-in families, each registering more "
    "(`baton.model.family.register`): a family kept outside baton/, e.g. a test's. Child "
    "processes (workers, stages, ranks) inherit it.")


NUM_THREADS = _env(
    "BATON_NUM_THREADS", 0, int,
    "torch threads of an engine process (0 / unset: torch's default); a tensor-parallel "
    "worker divides it (or the cores) between its ranks.")


def describe() -> str:
    return "\n".join(f"{e.name} (default {e.default!r}): {e.doc}" for e in ALL)


if __name__ == "__main__":
    print(describe())
