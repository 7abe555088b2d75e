"""Per-expert checkpoint tensors (the published layout, `...experts.{e}.up_proj.weight`)
stacked into one TP rank's shard of the fused expert parameters, reading only that shard:

    experts  rank r holds experts [r*E/t, (r+1)*E/t): their tensors are read whole into
             rows 0..E/t-1 of the local stack, every other expert's tensor is never opened
    within   every expert, but only its rank's I/t rows (up / gate / up halves, [I, d]) or
             columns (down, [d, I]), read through the safetensors slice

Fused checkpoints ([E, out, in] tensors) are cut by the family's `MOE_RULES` instead.
"""

from __future__ import annotations

import torch

from baton.errors import ConfigError
from baton.model.stacking import PER_EXPERT, ExpertStacks
from baton.model.tp_shard import held_units


class TPExpertStacks(ExpertStacks):
    def __init__(self, expected: dict[str, torch.Tensor], tp: int, rank: int, mode: str):
        super().__init__(expected)
        self.tp, self.rank, self.mode = tp, rank, mode

    def claim(self, ours: str, name: str, file) -> bool:
        m = PER_EXPERT.match(ours)
        if m is None or self.tp == 1 or self.mode != "experts":
            return super().claim(ours, name, file)
        target = next((t for t in (f"{m['pre']}.{m['proj']}", f"{m['pre']}.gate_up_proj")
                       if t in self.expected), None)
        if target is None:
            return False
        held, e = self.expected[target].shape[0], int(m["e"])
        first = self.rank * held
        if e >= held * self.tp:
            raise ConfigError(f"checkpoint tensor {name!r} names an expert beyond the model's "
                              f"{held * self.tp} (experts 0..{held * self.tp - 1})")
        if not first <= e < first + held:
            return True  # another rank's expert: skipped unread
        return super().claim(ours, name, file)

    def _first(self, target: str) -> int:
        if self.tp == 1 or self.mode != "experts":
            return 0
        return self.rank * self.expected[target].shape[0]

    def _read(self, piece, target: str) -> torch.Tensor:
        if self.tp == 1 or self.mode != "within":
            return piece[:]
        rows, cols = piece.get_shape()
        if target.endswith("down_proj"):  # [d, I]: the rank's columns
            lo, hi = held_units(cols, self.tp, self.rank)
            return piece[:, lo:hi]
        lo, hi = held_units(rows, self.tp, self.rank)  # [I, d] (or one gated half)
        return piece[lo:hi]
