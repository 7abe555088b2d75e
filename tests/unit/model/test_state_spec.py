"""The declared state spec drives pools, slot copies, canaries, layout and planner.

Two families' worth of declarations: NemotronH's (conv [x | B | C] + ssm, both in the model
dtype) and a DeltaNet-shaped one (conv [q | k | v] + a float32 recurrent state in bfloat16
pools), so nothing below the model may assume either's names, count or dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from baton.cache import canary
from baton.errors import ConfigError
from baton.model.config import config_from_dict
from baton.model.nemotron_h.config import ModelConfig
from baton.model.pools import Pools, PoolSpec
from baton.model.state_spec import StateTensorSpec
from bench.harness.testbed import tiny_model, tiny_qwen
from transfer.layout import StageLayout
from transfer.planner import plan

NEMOTRON = ModelConfig.from_dict(tiny_model("MM*-M*"))


@dataclass(frozen=True)
class DeltaNetLike:
    """A config with DeltaNet-shaped state: 2 key heads x 4, 4 value heads x 2, kernel 3."""

    pattern: str = "GG*G"
    num_key_value_heads: int = 1
    head_dim: int = 8
    family: str = "deltanet_like"

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return (2,)

    @property
    def state_layers(self) -> tuple[int, ...]:
        return (0, 1, 3)

    @property
    def state_tensors(self) -> tuple[StateTensorSpec, ...]:
        return (StateTensorSpec("conv", (8 + 8 + 8, 2), sections=(8, 8, 8),
                                section_names=("q", "k", "v")),
                StateTensorSpec("recurrent", (4, 4, 2), dtype="float32", sections=(4,)))


DELTA = DeltaNetLike()
QWEN = config_from_dict(tiny_qwen("GG*G"))
CONFIGS, CONFIG_IDS = [NEMOTRON, DELTA, QWEN], ["nemotron_h", "deltanet_like", "qwen3_5"]


def pools_of(cfg, dtype=torch.float32, layers=None, slots=3):
    return Pools(PoolSpec.for_model(cfg, num_blocks=4, tokens_per_block=4, num_slots=slots,
                                    layers=layers, dtype=dtype))


def test_declared_shapes_and_sections():
    conv, ssm = NEMOTRON.state_tensors
    assert (conv.name, conv.shape, conv.widths) == ("conv", (32, 3), (16, 8, 8))
    assert conv.section_elements() == ((0, 48), (48, 24), (72, 24))
    assert (ssm.name, ssm.shape, ssm.widths) == ("ssm", (4, 4, 4), (4,))
    p = pools_of(DELTA, dtype=torch.bfloat16)
    assert list(p.state) == ["conv", "recurrent"]
    assert p.state["conv"].shape == (3, 3, 24, 2) and p.state["conv"].dtype == torch.bfloat16
    assert p.state["recurrent"].shape == (3, 3, 4, 4, 2)
    assert p.state["recurrent"].dtype == torch.float32  # the declared dtype, not the pools'
    assert p.spec.state_bytes_per_slot() == 3 * (24 * 2 * 2 + 4 * 4 * 2 * 4)
    # the real Qwen3.5 declaration: conv [q | k | v] (2*2*4 + 4*6 channels, K-1 = 2), the
    # recurrent [HV, dk, dv] in float32 whatever the pools' dtype
    conv, rec = QWEN.state_tensors
    assert (conv.shape, conv.widths, conv.section_names) == ((40, 2), (8, 8, 24), ("q", "k", "v"))
    assert (rec.shape, rec.dtype, rec.widths) == ((4, 4, 6), "float32", (4,))
    q = pools_of(QWEN, dtype=torch.bfloat16)
    assert q.spec.state_layers == (0, 1, 3) and q.spec.attn_layers == (2,)
    assert q.spec.state_bytes_per_slot() == 3 * (40 * 2 * 2 + 4 * 4 * 6 * 4)


@pytest.mark.parametrize("kw,needle", [
    (dict(shape=(4, 0)), "positive sizes"),
    (dict(shape=(4, 2), sections=(3,)), r"sections \[3\] sum to 3, not shape\[0\] = 4"),
    (dict(shape=(4, 2), shard_axis=2), "shard_axis 2 outside its 2 axes"),
    (dict(shape=(4, 2), sections=(2, 2), section_names=("a",)), "1 section names for 2"),
])
def test_bad_declarations_are_refused(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        StateTensorSpec("t", **kw)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_slot_copy_zero_fill_cover_every_declared_tensor(cfg):
    p = pools_of(cfg)
    for i, t in enumerate(p.state.values()):
        t[:, 1].fill_(7.0 + i)
    p.copy_slot(1, 2)
    for i, t in enumerate(p.state.values()):
        assert torch.all(t[:, 2] == 7.0 + i) and torch.all(t[:, 0] == 0)
    p.zero_slot(1)
    assert all(torch.all(t[:, 1] == 0) for t in p.state.values())
    p.fill_slot(0, canary.CANARY)
    assert canary.bad_slots(p, [0, 1]) == [1]
    last = list(p.state.values())[-1]
    last[len(cfg.state_layers) - 1, 0].view(-1)[-1] = 0.0  # one element of the last tensor
    assert canary.bad_slots(p, [0]) == [0]


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_every_descriptor_address_computed_from_the_spec(cfg):
    """Unit table rows and section ranges, recomputed from the spec's shapes and dtypes and
    each pool tensor's base address alone, equal the pool tensors' own addresses."""
    p = pools_of(cfg, dtype=torch.bfloat16)
    lay = StageLayout.from_pools(p)
    table = lay.unit_table()
    row = lay.num_kv_units
    nl, ns = len(cfg.state_layers), p.spec.num_slots
    for spec, tl in zip(cfg.state_tensors, lay.state.tensors, strict=True):
        tensor = p.state[spec.name]
        item = torch.empty((), dtype=p.spec.state_dtype(spec)).element_size()
        slot_bytes = spec.numel * item
        assert (tl.name, tl.bytes, tl.slot_stride) == (spec.name, slot_bytes, slot_bytes)
        inner = int(np.prod(spec.shape[1:]))
        for layer in range(nl):
            for slot in range(ns):
                want = tensor.data_ptr() + (layer * ns + slot) * slot_bytes
                assert want == tensor[layer, slot].data_ptr()
                assert tuple(int(x) for x in table[row]) == (want, slot_bytes, 0)
                row += 1
                start = 0
                for width, nbytes in zip(spec.widths, tl.section_bytes, strict=True):
                    part = tensor[layer, slot, start:start + width]
                    assert part.is_contiguous() and nbytes == width * inner * item
                    assert part.data_ptr() == want + start * inner * item
                    start += width
    assert row == len(table)


def test_planner_moves_each_declared_tensor_of_the_shared_layers():
    src = StageLayout.from_pools(pools_of(DELTA, layers=range(0, 2)))  # state layers 0, 1
    dst_pools = pools_of(DELTA, slots=2)
    dst = StageLayout.from_pools(dst_pools)
    p = plan(src, dst, [], 2, [], 1)
    assert p.layers == (0, 1) and p.unit_layer.tolist() == [0, 1, 0, 1]
    conv, rec = dst_pools.state["conv"], dst_pools.state["recurrent"]
    assert p.dst_addr.tolist() == [conv[0, 1].data_ptr(), conv[1, 1].data_ptr(),
                                   rec[0, 1].data_ptr(), rec[1, 1].data_ptr()]
    assert p.length.tolist() == [24 * 2 * 4] * 2 + [4 * 4 * 2 * 4] * 2
    # unit indices: after the KV units, tensor i's units start at i * (layers * slots)
    assert p.dst_units.tolist() == [dst.num_kv_units + 0 * 2 + 1, dst.num_kv_units + 1 * 2 + 1,
                                    dst.num_kv_units + 6 + 0 * 2 + 1,
                                    dst.num_kv_units + 6 + 1 * 2 + 1]
