"""Quantized weights under tensor and pipeline parallelism: a TP rank keeps its rows / columns
of every weight the single-process loader keeps packed, packed, with their scales, decoding to
the same shard of the whole model's weights bit for bit; `model.quantize` on a rank gives
exactly the rank's shard of the whole tensor quantized (values and scales bit-equal to loading
the `baton quantize` output under TP); a PP stage quantizes its layers as the whole model
does, MTP head included; a TP cut inside a quantization group is refused in one line."""

from __future__ import annotations

import pytest
import torch

from baton.errors import ConfigError
from baton.model.config import load_config
from baton.model.layers.parallel import TPGroup
from baton.model.loader import load_model, load_stage
from baton.model.make_model import write_checkpoint
from baton.model.quant import packed
from baton.model.quant.quantize import write_quantized
from baton.model.tp_loader import load_tp_model, shard_tensor
from bench import quant_layouts

# every TP 2 shard of every quantized projection is whole 128 x 128 tiles (Qwen's FP8)
QWEN128 = dict(family="qwen3_5", pattern="G*", vocab_size=256, hidden_size=128,
               intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
               head_dim=128, linear_num_key_heads=2, linear_num_value_heads=2,
               linear_key_head_dim=128, linear_value_head_dim=128)
NH_MOE = dict(pattern="M*E", vocab_size=256, hidden_size=128, intermediate_size=256,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_num_heads=8,
              mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=32,
              moe_intermediate_size=64, moe_shared_expert_intermediate_size=128)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpq")
    return {"qwen128": write_checkpoint(root / "qwen128", seed=1, **QWEN128),
            "nh_moe": write_checkpoint(root / "nh_moe", seed=2, **NH_MOE)}


def _shard(cfg, k, whole: torch.Tensor, rank: int, split: str) -> torch.Tensor:
    return shard_tensor(cfg, k, packed.dense(whole), 2, rank, split)


def _assert_shards(path, split: str, quantize=None) -> dict[str, str]:
    """Each rank's weights: packed where (and as) the single-process model's are, decoding
    to their shard bit for bit. Returns the packed kinds seen."""
    cfg = load_config(path)
    whole = load_model(path, quantize=quantize).state_dict()
    kinds = {}
    for rank in range(2):
        ours = load_tp_model(path, TPGroup(rank, 2), moe_split=split,
                             quantize=quantize).state_dict()
        assert ours.keys() == whole.keys()
        for k, v in ours.items():
            if k == "lm_head.weight" or packed.kind(whole[k]) is None:
                assert packed.kind(v) is None, k
            else:
                assert packed.kind(v) == packed.kind(whole[k]), k
                kinds[k] = packed.kind(v)
            assert torch.equal(packed.dense(v), _shard(cfg, k, whole[k], rank, split)), k
    return kinds


STORED = [("qwen128", "qwen_fp8", "experts", {"fp8"}),
          ("nh_moe", "modelopt_fp8", "experts", {"fp8"}),
          ("nh_moe", "modelopt_mixed", "experts", {"fp8", "nvfp4"}),
          ("nh_moe", "modelopt_mixed", "within", {"fp8", "nvfp4"}),
          ("qwen128", "int8", "experts", {"int8"}),
          ("nh_moe", "int4", "within", {"int4"})]


@pytest.mark.parametrize("model,layout,split,kinds", STORED,
                         ids=[f"{m}-{la}-{s}" for m, la, s, _ in STORED])
def test_stored_weights_stay_packed_on_each_rank(src, tmp_path, model, layout, split, kinds):
    if layout in ("int8", "int4"):  # compressed-tensors, written by `baton quantize`
        q = write_quantized(src[model], tmp_path / "q", layout)
    else:
        q = quant_layouts.write(src[model], tmp_path / "q", layout)
    got = _assert_shards(q, split)
    assert set(got.values()) == kinds
    if model == "nh_moe":  # the per-expert tensors: each rank's stack packed as stored
        assert any(k.endswith("experts.up_proj") for k in got), sorted(got)


QUANTIZE = [("qwen128", "int8", "experts"), ("qwen128", "int4", "experts"),
            ("nh_moe", "int8", "experts"), ("nh_moe", "int8", "within"),
            ("nh_moe", "int4", "within")]


@pytest.mark.parametrize("model,mode,split", QUANTIZE, ids=["-".join(c) for c in QUANTIZE])
def test_quantize_on_a_rank_is_the_shard_of_the_quantized_model(src, tmp_path, model, mode,
                                                                 split):
    path = src[model]
    kinds = _assert_shards(path, split, quantize=mode)
    assert set(kinds.values()) == {mode}
    # row-parallel weights (int8: a row's scale spans every rank's columns) among them
    assert any(k.endswith(("out_proj.weight", "down_proj.weight")) for k in kinds)
    # values and scales: the written checkpoint's, read under TP as stored
    written = write_quantized(path, tmp_path / "w", mode)
    for rank in range(2):
        ours = load_tp_model(path, TPGroup(rank, 2), moe_split=split,
                             quantize=mode).state_dict()
        theirs = load_tp_model(written, TPGroup(rank, 2), moe_split=split).state_dict()
        for k in kinds:
            assert torch.equal(packed.values(ours[k]), packed.values(theirs[k])), k
            assert torch.equal(packed.scales(ours[k]), packed.scales(theirs[k])), k


def test_tp_cut_inside_a_group_is_refused(tmp_path):
    # down_proj [128, 96]: int4 packs it (96 = 3 groups of 32), but TP 2 gives each rank 48
    # columns, which cuts a group
    path = write_checkpoint(tmp_path / "f", seed=1, **{**QWEN128, "intermediate_size": 96})
    with pytest.raises(ConfigError) as e:
        load_tp_model(path, TPGroup(0, 2), quantize="int4")
    msg = str(e.value)
    assert "\n" not in msg
    for word in ("tensor_parallel_size=2", "model.layers.0.mlp.down_proj.weight [128, 96]",
                 "columns [0:48]", "int4's groups of 32"):
        assert word in msg, msg
    load_tp_model(path, TPGroup(0, 2), quantize="int8")  # per channel: any column cut


def test_within_split_cut_inside_a_group_is_refused(tmp_path):
    path = write_checkpoint(tmp_path / "f", seed=2, **{**NH_MOE, "moe_intermediate_size": 32})
    q = write_quantized(path, tmp_path / "q", "int4")  # per-expert tensors
    for p in (path, q):
        with pytest.raises(ConfigError) as e:
            load_tp_model(p, TPGroup(0, 2), moe_split="within",
                          quantize="int4" if p == path else None)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("tensor_parallel_size=2: "), msg
        assert "groups of 32" in msg and "[0:16]" in msg, msg


@pytest.mark.parametrize("layout", ["modelopt_fp8", "int8"])
def test_a_stage_holds_its_layers_and_mtp_head_as_the_whole_model(tmp_path, layout):
    src = write_checkpoint(tmp_path / "f", seed=3, mtp_layers=1,
                           **{**NH_MOE, "pattern": "M*-E"})
    if layout == "int8":  # model.quantize at load
        path, quantize = src, "int8"
    else:
        path, quantize = quant_layouts.write(src, tmp_path / "q", layout), None
    whole = load_model(path, quantize=quantize)
    stage = load_stage(path, range(2, 4), False, True, mtp=True, quantize=quantize)
    want = whole.state_dict()
    got = stage.state_dict()
    kinds = set()
    for k, v in got.items():
        assert packed.kind(v) == packed.kind(want[k]), k
        kinds.add(packed.kind(v))
        if packed.kind(v) is None:
            assert torch.equal(v, want[k]), k
        else:  # the same bytes
            assert torch.equal(packed.dense(v), packed.dense(want[k])), k
            assert torch.equal(packed.scales(v), packed.scales(want[k])), k
    assert kinds - {None} == {"fp8" if layout == "modelopt_fp8" else "int8"}
    mtp = [k for k in got if k.startswith("mtp.")]
    assert mtp and stage.mtp is not None
    # the MTP head in the checkpoint's format (ModelOpt quantizes it here); model.quantize
    # keeps it in the model dtype, as the single-process loader does
    assert any(packed.kind(got[k]) for k in mtp) == (layout == "modelopt_fp8")


def test_install_packed_takes_the_kernel_in_decode_calls_only():
    from torch import nn

    from baton.model.layers import cpu_kernels, linear

    kernel = cpu_kernels.gemv()
    if kernel is None or linear.decode_path() != "fast":
        pytest.skip("Baton's CPU kernel is not built here")

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.float_proj = nn.Linear(64, 64, bias=False)
            self.packed_proj = nn.Linear(64, 96, bias=False)

        def decode(self, x):
            assert linear.packed_decoding()
            return self.packed_proj(self.float_proj(x))

        def prefill(self, x):
            assert not linear.packed_decoding()
            return self.packed_proj(self.float_proj(x))

    torch.manual_seed(0)
    toy = Toy().requires_grad_(False)
    toy.packed_proj.weight = nn.Parameter(packed.pack(torch.randn(96, 64), "int8"),
                                          requires_grad=False)
    linear.install_packed(toy, "decode")
    assert type(toy.float_proj) is nn.Linear  # a float linear keeps its path
    x = torch.randn(3, 64)
    h = torch.nn.functional.linear(x, toy.float_proj.weight)
    w = toy.packed_proj.weight
    assert torch.equal(toy.decode(x), kernel.linear(h, w, None))  # read as stored
    assert torch.equal(toy.prefill(x), linear._quant_linear(h, 3, w, None))
    assert not linear.packed_decoding()
