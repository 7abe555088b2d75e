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

    def _span(self, shape, target: str) -> tuple[int, tuple[int, int]] | None:
        """(axis, (lo, hi)) of one expert's tensor this rank holds, None: all of it."""
        if self.tp == 1 or self.mode != "within":
            return None
        axis = 1 if target.endswith("down_proj") else 0  # down [d, I]: columns; up [I, d]
        return axis, held_units(shape[axis], self.tp, self.rank)

    def _read(self, piece, target: str) -> torch.Tensor:
        span = self._span(piece.get_shape(), target)
        if span is None:
            return piece[:]
        axis, (lo, hi) = span
        try:
            return piece[:, lo:hi] if axis else piece[lo:hi]
        except ConfigError as e:  # a quantized expert: a cut inside a scale group
            raise ConfigError(f"tensor_parallel_size={self.tp}: {e}") from None

    def _read_packed(self, f, name: str, target: str) -> torch.Tensor | None:
        span = self._span(f.get_slice(name).get_shape(), target)
        if span is None:
            return f.packed(name)
        axis, part = span
        try:
            return f.packed(name, cols=part) if axis else f.packed(name, rows=part)
        except ConfigError as e:  # a cut inside a scale group
            raise ConfigError(f"tensor_parallel_size={self.tp}: {e}") from None

    def load(self, state: dict, device, dtype, keep=lambda name, t: t,
             stored: bool = False, quantize: str | None = None) -> None:
        """As `ExpertStacks.load`; `quantize` with experts split `within`: each down stack
        is read whole and quantized (int8's per-channel scales span every rank's columns),
        then cut to the rank's columns, so it equals the rank's part of the whole model's
        quantized stack (a cut inside an int4 group is refused)."""
        wide = {t for t in self.pieces if quantize and self.tp > 1
                and self.mode == "within" and t.endswith("down_proj")}
        if wide:
            from baton.model.quant import packed

            whole = ExpertStacks({t: self._whole(t) for t in wide})
            whole.pieces = {t: self.pieces.pop(t) for t in wide}
            held = {}
            whole.load(held, device, dtype, keep)
            for t, w in held.items():
                lo, hi = held_units(w.shape[-1], self.tp, self.rank)
                if packed.kind(w) is None:
                    state[t] = w[..., lo:hi].contiguous()
                    continue
                try:
                    state[t] = packed.cut(w, (slice(None), slice(None), slice(lo, hi)))
                except ValueError:
                    raise ConfigError(
                        f"tensor_parallel_size={self.tp}: {t} {list(w.shape)} split within "
                        f"(columns [{lo}:{hi}]) cuts model.quantize {quantize}'s groups of "
                        f"{packed.UNITS[packed.kind(w)]} columns: use "
                        "worker.moe_tp_split=experts or a tensor-parallel size whose shares "
                        "are whole groups") from None
        super().load(state, device, dtype, keep, stored)

    def _whole(self, target: str) -> torch.Tensor:
        e, d, i = self.expected[target].shape
        return torch.empty(e, d, i * self.tp, device="meta")
