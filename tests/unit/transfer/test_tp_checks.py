"""Tensor-parallel bad input: a model / TP pair that cannot split is refused at start with
the field, the value and the sizes that would divide; a peer whose shard layout does not
match its TP size is refused at the handshake, before a byte is posted."""

from __future__ import annotations

import copy

import pytest

from baton.errors import ConfigError, TransferError
from baton.model.nemotron_h.config import ModelConfig
from baton.model.pools import Pools
from baton.model.tp_shard import check_tp, model_shards
from bench.harness.testbed import tiny_model
from tests.unit.transfer.test_transfer_leases import MODEL, Link, make
from transfer import fingerprint as fp
from transfer.receiver import Receiver
from transfer.sender import Sender
from transfer.tp_plan import plan_tp


def cfg_of(**kw) -> ModelConfig:
    return ModelConfig.from_dict(tiny_model("M*M-", **{"mamba_num_heads": 8, **kw}))


@pytest.mark.parametrize("kw, tp, msg", [
    (dict(mamba_num_heads=6, n_groups=1), 4,
     "tensor_parallel_size=4: mamba_num_heads=6 must be a multiple of 4 (sizes that divide "
     "this model: 1, 2)"),
    (dict(n_groups=2), 4, "tensor_parallel_size=4: n_groups=2 must be a multiple of 4 or 1 "
     "(replicated) (sizes that divide this model: 1, 2)"),
    (dict(num_key_value_heads=4, num_attention_heads=12, n_groups=1), 8,
     "tensor_parallel_size=8: num_attention_heads=12 must be a multiple of 8 (sizes that "
     "divide this model: 1, 2, 4)"),
    (dict(num_key_value_heads=3, num_attention_heads=12, n_groups=1), 2,
     "tensor_parallel_size=2: num_key_value_heads=3 must be a multiple of 2 or a divisor of "
     "it (sizes that divide this model: 1)"),
    (dict(vocab_size=30, n_groups=1), 4, "tensor_parallel_size=4: vocab_size=30 must be a "
     "multiple of 4 (sizes that divide this model: 1, 2)"),
    (dict(intermediate_size=6, n_groups=1), 4, "tensor_parallel_size=4: intermediate_size=6 "
     "must be a multiple of 4 (sizes that divide this model: 1, 2)"),
])
def test_undividable_model_refused_naming_field_value_and_sizes(kw, tp, msg):
    with pytest.raises(ConfigError) as e:
        check_tp(cfg_of(**kw), tp)
    assert str(e.value) == msg


@pytest.mark.parametrize("tp", [0, -2, True, 2.0])
def test_tp_size_must_be_a_positive_integer(tp):
    with pytest.raises(ConfigError, match=f"tensor_parallel_size={tp!r} must be a positive"):
        check_tp(cfg_of(n_groups=1), tp)


def test_kv_heads_fewer_than_tp_and_single_group_are_allowed():
    cfg = cfg_of(n_groups=1, num_key_value_heads=1)
    for tp in (1, 2, 4):  # 4 attention heads: 8 would not split them
        check_tp(cfg, tp)
    kv, conv, ssm = model_shards(cfg, 4, "float32", 4)
    assert kv.local_shape == (2, 4, 1, 8) and conv.local_shape == (8 + 4 + 4, 3)
    assert ssm.local_shape == (2, 4, 4)


def test_plan_refuses_shards_that_cannot_map():
    a = model_shards(cfg_of(n_groups=1), 2, "float32", 4)
    b = model_shards(cfg_of(n_groups=1), 2, "bfloat16", 4)
    with pytest.raises(TransferError, match=r"kv.itemsize differs: source 4, destination 2"):
        plan_tp(a, b)
    c = model_shards(cfg_of(n_groups=4), 2, "float32", 4)
    with pytest.raises(TransferError, match=r"conv.shape differs"):
        plan_tp(a, c)


# --- the handshake: a decode whose shard layout mismatches is refused before any post ----

def fingerprints(tp_send: int, tp_recv: int):
    link = Link()
    cfg, spec, rc, sc = make(link)
    return link, cfg, spec, rc, sc, (fp.compute_fingerprint(MODEL, spec, tp_size=tp_send),
                                     fp.compute_fingerprint(MODEL, spec, tp_size=tp_recv))


def test_fingerprint_carries_tp_size_and_each_ranks_units():
    *_, (a, _) = fingerprints(2, 2)
    assert a["tp_size"] == 2 and a["tp_units"] == {"kv": [2], "conv": [4, 2, 2], "ssm": [4]}
    assert a["tp_layout"]["kv"] == [[[0, 1]], [[1, 2]]]
    assert a["tp_layout"]["conv"] == [[[0, 2], [0, 1], [0, 1]], [[2, 4], [1, 2], [1, 2]]]
    *_, (four, _) = fingerprints(4, 4)  # 2 KV heads on 4 ranks: division
    assert four["tp_layout"]["kv"] == [[[0, 1]], [[0, 1]], [[1, 2]], [[1, 2]]]


def test_mismatching_tp_layout_refused_at_handshake_before_a_byte():
    link, cfg, spec, rc, sc, (mine, theirs) = fingerprints(4, 4)
    theirs = copy.deepcopy(theirs)
    theirs["tp_layout"]["kv"] = [[[r % 2, r % 2 + 1]] for r in range(4)]  # modulo heads
    r = Receiver(cfg, Pools(spec), theirs, "127.0.0.1", rc)
    s = Sender(cfg, Pools(spec), mine, sc)
    try:
        with pytest.raises(TransferError, match=r"field 'tp_layout.kv' differs"):
            s.connect(r.endpoint)
        r.expect("q", [1], 0, lease_s=5)
        s.send("q", r.endpoint, [1], 0, [1], 0)
        (ev,) = s.poll()
        assert not ev.ok and "'tp_layout.kv'" in ev.error
        assert link.posts == [] and sc.peers_added == 0
    finally:
        s.close()
        r.close()


def test_tp_size_difference_needs_the_tp_plan():
    *_, (one, two) = fingerprints(1, 2)
    assert fp.mismatch(one, two) == ("tp_size", 1, 2)  # the per-stage planner: equal only
    assert fp.mismatch(one, two, hetero_tp=True) is None
    bad = {**two, "tp_size": 3}
    assert fp.mismatch(one, bad, hetero_tp=True) == ("tp_size", 1, 3)


@pytest.mark.parametrize("kw, tp, split, msg", [
    (dict(n_routed_experts=6), 4, "experts",
     "tensor_parallel_size=4: n_routed_experts=6 must be a multiple of 4 to split whole "
     "experts per rank (worker.moe_tp_split='experts'; sizes that divide this model: 1, 2)"),
    (dict(moe_intermediate_size=6), 4, "within",
     "tensor_parallel_size=4: moe_intermediate_size=6 must be a multiple of 4 to split each "
     "expert within (worker.moe_tp_split='within'; sizes that divide this model: 1, 2)"),
    (dict(moe_shared_expert_intermediate_size=6), 4, "experts",
     "tensor_parallel_size=4: moe_shared_expert_intermediate_size=6 must be a multiple of 4 "
     "to split the shared expert within (worker.moe_tp_split='experts'; sizes that divide "
     "this model: 1, 2)"),
])
def test_moe_split_that_cannot_divide_refused_before_any_rank(kw, tp, split, msg):
    from baton.model.tp_loader import family_tp

    moe = ModelConfig.from_dict(tiny_model("M*E-", mamba_num_heads=8, n_groups=1, **kw))
    with pytest.raises(ConfigError) as e:
        family_tp(moe).local_config(moe, tp, split)
    assert str(e.value) == msg
    assert family_tp(moe).local_config(moe, 1, split) is moe
    local = family_tp(moe).local_config(moe, 2, split)  # MoE fields stay the model's
    assert (local.n_routed_experts, local.moe_intermediate_size) == (
        moe.n_routed_experts, moe.moe_intermediate_size)


def test_unknown_moe_split_and_families_without_a_tp_build_refused():
    from baton.config import BatonConfig
    from baton.model.tp_loader import family_tp

    with pytest.raises(ConfigError, match=r"moe_tp_split"):
        BatonConfig.from_dict({"worker": {"moe_tp_split": "rows"}})

    class Other:
        family = "qwen3_next"

    with pytest.raises(ConfigError, match=r"family 'qwen3_next' has no tensor-parallel build "
                                          r"yet \(families with one: \['nemotron_h', "
                                          r"'qwen3_5', 'qwen3_5_moe'\]\)"):
        family_tp(Other())
