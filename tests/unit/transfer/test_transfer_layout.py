"""Layout from real Pools, its wire form, and the compatibility fingerprint."""

from __future__ import annotations

import msgpack
import pytest
import torch

from baton.errors import TransferError
from baton.model.nemotron_h.config import ModelConfig
from baton.model.pools import Pools, PoolSpec
from bench.harness.testbed import tiny_model
from transfer import fingerprint as fp
from transfer.layout import StageLayout

MODEL = ModelConfig.from_dict(tiny_model("MMMM--**"))


def pools(layers, **kw):
    return Pools(PoolSpec.for_model(MODEL, num_blocks=5, tokens_per_block=4, num_slots=3,
                                    layers=layers, **kw))


def test_full_stage_addresses_match_the_tensors():
    p = pools(range(8))
    lay = StageLayout.from_pools(p)
    kv, st = lay.kv, lay.state
    assert kv.layers == (6, 7) and st.layers == (0, 1, 2, 3)
    assert kv.base == p.kv.data_ptr()
    assert kv.base + 1 * kv.layer_stride + 3 * kv.block_stride == p.kv[1, 3].data_ptr()
    assert kv.block_bytes == 2 * 4 * 2 * 8 * 4 and kv.k_bytes == kv.block_bytes // 2
    conv, ssm = st.tensor("conv"), st.tensor("ssm")
    assert [t.name for t in st.tensors] == ["conv", "ssm"]
    assert conv.base + 2 * conv.layer_stride + conv.slot_stride == p.conv[2, 1].data_ptr()
    assert ssm.base + 3 * ssm.layer_stride + 2 * ssm.slot_stride == p.ssm[3, 2].data_ptr()
    assert conv.section_bytes == (16 * 3 * 4, 8 * 3 * 4, 8 * 3 * 4)  # [x | B | C] x (k-1)
    assert sum(conv.section_bytes) == conv.bytes
    assert ssm.bytes == 4 * 4 * 4 * 4 and ssm.section_bytes == (ssm.bytes,)
    assert (lay.dtype, lay.device, lay.device_id) == ("float32", "cpu", 0)


def test_attention_free_and_mamba_free_stages():
    attn_free = StageLayout.from_pools(pools(range(0, 4)))
    mamba_free = StageLayout.from_pools(pools(range(4, 8)))
    assert attn_free.kv is None and attn_free.state.layers == (0, 1, 2, 3)
    assert mamba_free.state is None and mamba_free.kv.layers == (6, 7)
    assert len(attn_free.unit_table()) == 2 * 4 * 3 and len(mamba_free.unit_table()) == 2 * 5
    nothing = StageLayout.from_pools(pools([4, 5]))
    assert nothing.kv is None and nothing.state is None and nothing.unit_table().shape == (0, 3)


def test_unit_table_rows_are_the_block_and_slot_addresses():
    p = pools(range(8))
    t = StageLayout.from_pools(p).unit_table()
    assert int(t[1 * 5 + 3, 0]) == p.kv[1, 3].data_ptr()
    assert int(t[10 + 2 * 3 + 1, 0]) == p.conv[2, 1].data_ptr()
    assert int(t[10 + 12 + 3 * 3 + 2, 0]) == p.ssm[3, 2].data_ptr()


def test_wire_round_trip_through_msgpack():
    lay = StageLayout.from_pools(pools(range(8), dtype=torch.bfloat16))
    back = StageLayout.from_wire(msgpack.unpackb(msgpack.packb(lay.to_wire())))
    assert back == lay and back.dtype == "bfloat16"


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(kv="nope"),
    lambda d: d["kv"].update(base=-1),
    lambda d: d["kv"].update(layers=["a"]),
    lambda d: d["state"].update(num_slots=True),
    lambda d: d["state"].update(extra=1),
    lambda d: d.update(dtype=3),
])
def test_malformed_wire_layout_refused(mutate):
    d = msgpack.unpackb(msgpack.packb(StageLayout.from_pools(pools(range(8))).to_wire()))
    mutate(d)
    with pytest.raises(TransferError, match="peer layout"):
        StageLayout.from_wire(d)


def spec_of(model: ModelConfig, **kw) -> PoolSpec:
    args = dict(num_blocks=5, tokens_per_block=4, num_slots=3)
    return PoolSpec.for_model(model, **{**args, **kw})


def test_fingerprint_is_stage_independent():
    a = fp.compute_fingerprint(MODEL, spec_of(MODEL, layers=range(0, 4)))
    b = fp.compute_fingerprint(MODEL, spec_of(MODEL, layers=range(4, 8)))
    assert a == b and fp.mismatch(a, b) is None
    assert a["kv_block_bytes"] == 2 * 4 * 2 * 8 * 4 and a["conv_sections"] == [16, 8, 8]


@pytest.mark.parametrize("field,model_kw,spec_kw", [
    ("dtype", {}, {"dtype": torch.float16}),
    ("tokens_per_block", {}, {"tokens_per_block": 16}),
    ("num_layers", {"hybrid_override_pattern": "MMMM--***"}, {}),
    ("pattern", {"hybrid_override_pattern": "MMMM-*-*"}, {}),
    ("kv_block_bytes", {"num_key_value_heads": 4}, {}),
    ("conv_sections", {"mamba_num_heads": 6, "n_groups": 1}, {}),
    ("conv_shape", {"conv_kernel": 3}, {}),
    ("ssm_shape", {"mamba_num_heads": 2, "mamba_head_dim": 8}, {}),
    ("model", {"hidden_size": 64}, {}),
])
def test_fingerprint_mismatch_names_the_field(field, model_kw, spec_kw):
    other = ModelConfig.from_dict(tiny_model("MMMM--**", **model_kw))
    local = fp.compute_fingerprint(MODEL, spec_of(MODEL))
    peer = fp.compute_fingerprint(other, spec_of(other, **spec_kw))
    assert fp.mismatch(local, peer)[0] == field
    with pytest.raises(TransferError, match=f"'{field}' differs"):
        fp.check(local, peer)


def test_fingerprint_garbage_is_a_mismatch_not_a_crash():
    local = fp.compute_fingerprint(MODEL, spec_of(MODEL))
    assert fp.mismatch(local, "x")[0] == "fingerprint"
    assert fp.mismatch(local, {})[0] == "dtype"
