"""Per-expert checkpoint tensors stacked into the model's fused expert parameters.

Published MoE checkpoints keep one tensor per expert (`...mixer.experts.{e}.up_proj.weight`);
the model holds one [E, out, in] parameter per projection (transformers 5's layout):

    checkpoint  experts.0.up_proj.weight [I, d]   experts.1.up_proj.weight [I, d]  ...
    model       experts.up_proj [E, I, d]          row e <- expert e
    (gated)     experts.gate_up_proj [E, 2I, d]    rows [0, I) <- gate_proj, [I, 2I) <- up_proj

Each stack is allocated once in the model's dtype and filled expert by expert through a
safetensors handle opened for that stack only: closing it unmaps the pages just read, so
loading never holds a second copy of the experts (peak RSS stays near the checkpoint size).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch

from baton.errors import ConfigError
from baton.model.quant import safe_open  # the checkpoint as the float one it encodes

PER_EXPERT = re.compile(r"^(?P<pre>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
# per-expert projection -> (fused parameter, which half of its rows; None: all of them)
GATED_HALVES = {"gate_proj": 0, "up_proj": 1}


class Piece(NamedTuple):
    file: Path
    name: str
    """The tensor's name in the checkpoint, for errors."""
    expert: int
    half: int | None


class ExpertStacks:
    """Collects the per-expert tensors of a checkpoint while its files are listed, then
    fills the stacked parameters they belong to (`load`)."""

    def __init__(self, expected: dict[str, torch.Tensor]):
        self.expected = expected
        self.pieces: dict[str, list[Piece]] = defaultdict(list)

    def claim(self, ours: str, name: str, file: Path) -> bool:
        """Take `ours` (canonical name) if it is one expert's slice of an expected stack."""
        m = PER_EXPERT.match(ours)
        if m is None:
            return False
        pre, proj, e = m["pre"], m["proj"], int(m["e"])
        if f"{pre}.{proj}" in self.expected:
            self.pieces[f"{pre}.{proj}"].append(Piece(file, name, e, None))
            return True
        if proj in GATED_HALVES and f"{pre}.gate_up_proj" in self.expected:
            self.pieces[f"{pre}.gate_up_proj"].append(Piece(file, name, e, GATED_HALVES[proj]))
            return True
        return False

    def load(self, state: dict, device: torch.device, dtype: torch.dtype,
             keep=lambda name, t: t, stored: bool = False) -> None:
        """Stack every claimed tensor into `state[target]`; a missing expert is an error.
        `keep(target, stack)`: the stack as the model holds it (packed under
        `model.quantize`: one stack in float at a time). `stored`: quantized experts the CPU
        kernels read as stored are stacked packed (`packed.stack`), not decoded."""
        for target, pieces in self.pieces.items():
            if target in state:
                raise ConfigError(
                    f"checkpoint holds both {target!r} and per-expert tensors such as "
                    f"{pieces[0].name!r}: keep one layout"
                )
            got = self._stack_packed(target, pieces) if stored else None
            state[target] = got if got is not None else \
                keep(target, self._stack(target, pieces, device, dtype))

    def _stack_packed(self, target: str, pieces: list[Piece]) -> torch.Tensor | None:
        """The stack from each expert's weight packed as stored (a TP rank's part of each,
        `_read_packed`), or None where one has no packed form (then it is decoded)."""
        from baton.model.quant import packed

        want = self.expected[target]
        first = self._first(target)
        _check_complete(target, pieces, want, first)
        rows = want.shape[1] // (1 if pieces[0].half is None else 2)
        order = sorted((p for p in pieces if first <= p.expert < first + want.shape[0]),
                       key=lambda p: (p.expert, p.half or 0))
        parts = []
        by_file: dict[Path, list[Piece]] = defaultdict(list)
        for p in order:
            by_file[p.file].append(p)
        got: dict[str, torch.Tensor] = {}
        for file, group in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for p in group:
                    t = self._read_packed(f, p.name, target) if hasattr(f, "packed") \
                        else None
                    if t is None or tuple(t.shape) != (rows, want.shape[2]):
                        return None
                    got[p.name] = t
        parts = [got[p.name] for p in order]
        return packed.stack(parts, tuple(want.shape))

    def _stack(self, target: str, pieces: list[Piece], device, dtype) -> torch.Tensor:
        want = self.expected[target]
        first = self._first(target)
        _check_complete(target, pieces, want, first)
        out = torch.empty(want.shape, dtype=dtype, device=device)
        rows = want.shape[1] // 2
        by_file: dict[Path, list[Piece]] = defaultdict(list)
        for p in pieces:
            by_file[p.file].append(p)
        for file, group in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for p in group:
                    e = p.expert - first
                    dst = out[e] if p.half is None else out[e, p.half * rows:(p.half + 1) * rows]
                    got = self._read(f.get_slice(p.name), target)
                    if tuple(got.shape) != tuple(dst.shape):
                        raise ConfigError(
                            f"tensor {p.name!r} in {file.name} has shape {list(got.shape)} "
                            f"but config.json implies {list(dst.shape)}"
                        )
                    dst.copy_(got)
        return out

    def _first(self, target: str) -> int:
        """The checkpoint expert id of the stack's row 0 (a TP rank's first expert)."""
        return 0

    def _read(self, piece, target: str) -> torch.Tensor:
        """The part of one expert's tensor (a safetensors slice) this model holds."""
        return piece[:]

    def _read_packed(self, f, name: str, target: str) -> torch.Tensor | None:
        """`_read`'s part of one expert's quantized weight packed as stored (None: it has no
        packed form)."""
        return f.packed(name)


def _check_complete(target: str, pieces: list[Piece], want: torch.Tensor,
                    first: int = 0) -> None:
    """Every expert of the stack, [first, first + rows), (and both halves of a gated one)
    once; errors name the missing tensor."""
    num = want.shape[0]
    halves = (None,) if pieces[0].half is None else (0, 1)
    have = {(p.expert, p.half) for p in pieces}
    extra = [p.name for p in pieces if p.expert >= first + num]
    if extra:
        raise ConfigError(
            f"checkpoint tensor {extra[0]!r} names an expert beyond n_routed_experts={num} "
            f"(experts 0..{num - 1})"
        )
    for e in range(first, first + num):
        for h in halves:
            if (e, h) not in have:
                proj = target.rsplit(".", 1)[1] if h is None else ("gate_proj", "up_proj")[h]
                raise ConfigError(
                    f"checkpoint is missing tensor {_expert_name(pieces[0].name, e, proj)!r} "
                    + (f"(expert {e} of {num} for {target!r})" if not first else
                       f"(expert {e} for {target!r}, experts {first}..{first + num - 1} on "
                       "this rank)")
                )


def _expert_name(example: str, expert: int, proj: str) -> str:
    m = PER_EXPERT.match(example)
    assert m is not None
    return f"{m['pre']}.{expert}.{proj}.weight"
