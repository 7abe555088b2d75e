"""Stage 0's pools as the cache manager sees them: the whole model's spec (so block and slot
accounting covers every stage, even when stage 0 itself is attention-free or Mamba-free),
stage 0's own tensors, and every copy/zero the manager makes recorded for the other stages.

The other stages apply the recorded operations in order before their next forward (they
travel ahead of it on the same channel), or at once when `PipelineModel.sync` is called
(before a reservation is given out, so no mirrored copy lands after a transfer's bytes).
"""

from __future__ import annotations

from baton.model.pools import Pools, PoolSpec

Op = tuple[str, int, int]
"""("slot", src, dst) | ("block", src, dst) | ("token", src, dst) | ("zero", slot, 0) |
("fill_block", block, value) | ("fill_slot", slot, value) | ("round", slot, [prefix hash,
position, layers]) (the stage's `pools.rounding`, baton/engine/state_rounding.py)."""


class MirroredPools:
    def __init__(self, spec: PoolSpec, local: Pools):
        self.spec = spec
        """Every layer of the model (counts, block size); the tensors are `local`'s."""
        self.local = local
        self.ops: list[Op] = []

    @property
    def has_kv(self) -> bool:
        return bool(self.spec.attn_layers)

    @property
    def has_state(self) -> bool:
        return bool(self.spec.state_layers)

    @property
    def kv(self):
        return self.local.kv

    @property
    def state(self):
        return self.local.state

    @property
    def tensors(self):
        return self.local.tensors

    @property
    def snapshots(self):
        return self.local.snapshots

    def slot(self, name: str, slot: int):
        """This stage's layers of state tensor `name` of slot `slot` (`Pools.slot`)."""
        return self.local.slot(name, slot)

    def __getattr__(self, name: str):
        # the declared state tensors by name (`pools.conv`), as on `Pools`
        local = self.__dict__.get("local")
        if local is not None and name in local.state:
            return local.state[name]
        raise AttributeError(name)

    def copy_slot(self, src: int, dst: int) -> None:
        self.local.copy_slot(src, dst)
        self.ops.append(("slot", src, dst))

    def copy_block(self, src: int, dst: int) -> None:
        self.local.copy_block(src, dst)
        self.ops.append(("block", src, dst))

    def copy_token(self, src: int, dst: int) -> None:
        self.local.copy_token(src, dst)
        self.ops.append(("token", src, dst))

    def zero_slot(self, slot: int) -> None:
        self.local.zero_slot(slot)
        self.ops.append(("zero", slot, 0))

    def fill_block(self, block: int, value: int) -> None:
        self.local.fill_block(block, value)
        self.ops.append(("fill_block", block, value))

    def fill_slot(self, slot: int, value: int) -> None:
        self.local.fill_slot(slot, value)
        self.ops.append(("fill_slot", slot, value))

    def take_ops(self) -> list[Op]:
        ops, self.ops = self.ops, []
        return ops


def apply_ops(pools: Pools, ops: list) -> None:
    """A stage's copy of stage 0's operations, on the layers it holds."""
    for kind, a, b in ops:
        if kind == "slot":
            pools.copy_slot(a, b)
        elif kind == "block":
            pools.copy_block(a, b)
        elif kind == "token":
            pools.copy_token(a, b)
        elif kind == "fill_block":
            pools.fill_block(a, b)
        elif kind == "fill_slot":
            pools.fill_slot(a, b)
        elif kind == "round":  # b: [prefix hash, position, layers] (engine/state_rounding.py)
            rounding = getattr(pools, "rounding", None)
            if rounding is not None:  # None: this stage holds no state layer
                rounding.apply(a, b)
        else:
            pools.zero_slot(a)
