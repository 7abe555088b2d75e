"""The declared recurrent state of a layer kind: what one slot holds, tensor by tensor.

A model config lists, for the layers that carry recurrent state, the tensors of one slot.
Everything below the model (pools, slot copies and snapshots, canaries, the transfer
layout and planner, the handshake fingerprint, pool sizing) is driven by this list and
never names a tensor of one family. Importable without torch (the router reads configs).

    StateTensorSpec("conv", shape=(conv_dim, K-1), sections=(I, G*N, G*N), names x, B, C)

    one slot of one layer, conv (channels, K-1), row-major:
    ┌──────────── x: I rows ────────────┬── B: G*N rows ──┬── C: G*N rows ──┐
    │ I*(K-1) elements                  │ G*N*(K-1)       │ G*N*(K-1)       │
    └───────────────────────────────────┴─────────────────┴─────────────────┘
    section i is one contiguous byte range (shard_axis 0 is the outermost axis), which is
    what a head-sliced (tensor-parallel) transfer reads on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from baton.errors import ConfigError


@dataclass(frozen=True)
class StateTensorSpec:
    name: str
    """Key in `Pools.state` and `StepContext.state(layer, name)`."""
    shape: tuple[int, ...]
    """Per slot, at tensor-parallel size 1."""
    dtype: str | None = None
    """torch dtype name ("float32"); None: the pools' (model) dtype."""
    shard_axis: int = 0
    """The axis tensor parallelism shards along (sections lie along it)."""
    sections: tuple[int, ...] = ()
    """Widths along `shard_axis`, in order; they sum to shape[shard_axis]. Empty: one."""
    section_names: tuple[str, ...] = ()
    section_units: tuple[int, ...] = ()
    """Shardable units (heads, groups) of each section; a unit's indices stay on one
    tensor-parallel rank. Empty: every index is a unit. A section with fewer units than
    the TP size is replicated (see `baton.model.tp_shard`)."""

    def __post_init__(self) -> None:
        if not self.shape or any(int(n) <= 0 for n in self.shape):
            raise ConfigError(f"state tensor {self.name!r}: shape {list(self.shape)} must be "
                              "positive sizes")
        if not 0 <= self.shard_axis < len(self.shape):
            raise ConfigError(f"state tensor {self.name!r}: shard_axis {self.shard_axis} "
                              f"outside its {len(self.shape)} axes")
        if self.sections and sum(self.sections) != self.shape[self.shard_axis]:
            raise ConfigError(
                f"state tensor {self.name!r}: sections {list(self.sections)} sum to "
                f"{sum(self.sections)}, not shape[{self.shard_axis}] = "
                f"{self.shape[self.shard_axis]}")
        if self.section_names and len(self.section_names) != len(self.widths):
            raise ConfigError(f"state tensor {self.name!r}: {len(self.section_names)} section "
                              f"names for {len(self.widths)} sections")

        su = self.section_units
        if su and (len(su) != len(self.widths) or any(
                u <= 0 or w % u for u, w in zip(su, self.widths, strict=False))):
            raise ConfigError(f"state tensor {self.name!r}: section_units "
                              f"{list(self.section_units)} must each divide the widths "
                              f"{list(self.widths)}")

    @property
    def units(self) -> tuple[int, ...]:
        """Shardable units per section (the widths when none are declared)."""
        return self.section_units or self.widths

    @property
    def widths(self) -> tuple[int, ...]:
        """Section widths along the shard axis (the whole axis when none are declared)."""
        return self.sections or (self.shape[self.shard_axis],)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def section_elements(self) -> tuple[tuple[int, int], ...]:
        """(offset, count) in elements of each section inside one slot. Contiguous only
        when shard_axis is 0; a later axis has one range per outer index (not used yet)."""
        if self.shard_axis != 0:
            raise ConfigError(f"state tensor {self.name!r}: sections along axis "
                              f"{self.shard_axis} are not contiguous ranges")
        inner = prod(self.shape[1:])
        out, start = [], 0
        for w in self.widths:
            out.append((start * inner, w * inner))
            start += w
        return tuple(out)

    def fingerprint(self) -> dict:
        return {"shape": list(self.shape), "sections": list(self.widths),
                "dtype": self.dtype or "model"}
