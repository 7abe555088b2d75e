"""The stored state/KV format settings: one-line refusals naming key, value and what is
allowed; resolution against the model and device; the handshake refusing workers whose
formats differ."""

from __future__ import annotations

import pytest
import torch

from baton.cache.state_format import check_built, resolve
from baton.config.base import from_dict, to_dict
from baton.config.cache import CacheConfig
from baton.errors import ConfigError, TransferError
from baton.model.nemotron_h.config import ModelConfig
from baton.model.pools import PoolSpec
from transfer.fingerprint import check, compute_fingerprint

MODEL = ModelConfig.from_dict(
    dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M*M-", num_attention_heads=2,
         num_key_value_heads=1, head_dim=8, mamba_num_heads=4, mamba_head_dim=4,
         ssm_state_size=4, n_groups=1)
)


def cache(**kw) -> CacheConfig:
    return from_dict(CacheConfig, kw, "cache")


@pytest.mark.parametrize("kw, message", [
    ({"state_dtype": "int8"},
     r"cache\.state_dtype must be one of \['model', 'float32', 'bfloat16', 'float16'\], "
     r"got 'int8'"),
    ({"state_rounding": "truncate"}, r"cache\.state_rounding must be one of .*'truncate'"),
    ({"kv_dtype": "float8"},
     r"cache\.kv_dtype must be one of \['model', 'bfloat16', 'float8_e4m3'\], got 'float8'"),
    ({"state_dtypes": {"ssm": "fp8"}},
     r"cache\.state_dtypes\.ssm='fp8' is not supported; allowed: model, float32, bfloat16, "
     r"float16"),
    ({"state_dtypes": [1, 2]}, r"cache\.state_dtypes=\[1, 2\] must map state tensor names"),
    ({"state_rounding_seed": -1}, r"cache\.state_rounding_seed=-1 must be an integer in"),
    ({"state_rounding": "stochastic", "state_dtype": "float32"},
     r"cache\.state_rounding=stochastic with cache\.state_dtype=float32: .* set state_dtype: "
     r"bfloat16 or float16, or state_rounding: nearest"),
])
def test_bad_settings_are_refused_in_one_line(kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        cache(**kw)
    assert "\n" not in str(e.value)


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigError, match=r"cache\.state_dtype='int8' is not supported; "
                                          r"allowed: model, float32, bfloat16, float16"):
        CacheConfig(state_dtype="int8")


def test_settings_round_trip_and_name_the_format():
    c = cache(state_dtype="bfloat16", state_dtypes={"conv": "float32"},
              state_rounding="stochastic", state_rounding_seed=5)
    assert c.state_dtypes == (("conv", "float32"),)
    assert c.state_dtype_of("conv") == "float32" and c.state_dtype_of("ssm") == "bfloat16"
    assert c.cache_format == ("state=bfloat16;state.conv=float32;rounding=stochastic;seed=5;"
                              "kv=model")
    assert from_dict(CacheConfig, to_dict(c), "cache") == c
    assert hash(c) == hash(from_dict(CacheConfig, to_dict(c), "cache"))
    assert CacheConfig().cache_format == "state=model;rounding=nearest;kv=model"


def test_resolve_against_the_model():
    fmt = resolve(cache(state_dtype="bfloat16", state_dtypes={"conv": "float32"},
                        state_rounding="stochastic"), MODEL.state_tensors, torch.float32, "cpu")
    assert fmt.dtypes == {"conv": torch.float32, "ssm": torch.bfloat16}
    assert fmt.rounds("ssm") and not fmt.rounds("conv") and fmt.kv_dtype == torch.float32
    with pytest.raises(ConfigError, match=r"cache\.state_dtypes\.recurrent: this model declares "
                                          r"no state tensor 'recurrent'; its state tensors: "
                                          r"conv, ssm"):
        resolve(cache(state_dtypes={"recurrent": "float16"}), MODEL.state_tensors,
                torch.float32, "cpu")
    with pytest.raises(ConfigError, match=r"cache\.state_rounding=stochastic: every state "
                                          r"tensor is stored in float32 .*model dtype float32"):
        resolve(cache(state_rounding="stochastic"), MODEL.state_tensors, torch.float32, "cpu")
    fmt = resolve(cache(state_rounding="stochastic"), MODEL.state_tensors, torch.bfloat16, "cpu")
    assert set(fmt.dtypes.values()) == {torch.bfloat16}


def test_engine_refuses_formats_it_cannot_store_yet():
    check_built(CacheConfig(), MODEL.state_tensors, torch.float32, "cpu")
    check_built(cache(state_dtype="float32"), MODEL.state_tensors, torch.float32, "cpu")
    fmt = check_built(cache(state_dtype="bfloat16"), MODEL.state_tensors, torch.float32, "cpu")
    assert fmt.dtypes == {"conv": torch.bfloat16, "ssm": torch.bfloat16}
    with pytest.raises(ConfigError, match=r"cache\.state_dtypes\.ssm=float16: the pools hold "
                                          r"the model dtype \(bfloat16\) and cannot store "
                                          r"another"):
        check_built(cache(state_dtypes={"ssm": "float16"}), MODEL.state_tensors,
                    torch.bfloat16, "cpu")
    # KV in bfloat16 / fp8 is stored as such (issue 50, tests/unit/model/layers/test_kv_formats)
    for kv, dt in (("bfloat16", torch.bfloat16), ("float8_e4m3", torch.float8_e4m3fn)):
        assert check_built(cache(kv_dtype=kv), MODEL.state_tensors, torch.float32,
                           "cpu").kv_dtype == dt


def test_engine_builder_checks_the_format():
    from baton.config import BatonConfig
    from baton.engine.builder import _pool_spec

    def cfg(**sections):
        return from_dict(BatonConfig, {**to_dict(BatonConfig()), **sections}, "")

    _pool_spec(cfg(cache={"state_dtype": "float16"}), MODEL, torch.float32)  # one process
    _pool_spec(cfg(cache={"state_dtype": "float16"}, worker={"pipeline_parallel_size": 2}),
               MODEL, torch.float32)
    _pool_spec(cfg(cache={"state_dtype": "float16"},  # TP x PP rounds too (issue 50)
                   worker={"pipeline_parallel_size": 2, "tensor_parallel_size": 2}),
               MODEL, torch.float32)
    with pytest.raises(ConfigError, match=r"cache\.state_dtypes\.ssm=float16: the pools hold "
                                          r"the model dtype \(bfloat16\)"):
        _pool_spec(cfg(cache={"state_dtypes": {"ssm": "float16"}}, model={"dtype": "bfloat16"},
                       worker={"pipeline_parallel_size": 2, "tensor_parallel_size": 2}),
                   MODEL, torch.bfloat16)
    spec = _pool_spec(cfg(cache={"kv_dtype": "float8_e4m3"}, worker={"pipeline_parallel_size": 2}),
                      MODEL, torch.float32)
    assert spec.kv_store_dtype == torch.float8_e4m3fn and spec.kv_row == MODEL.head_dim + 4


def test_handshake_refuses_another_cache_format():
    spec = PoolSpec.for_model(MODEL, num_blocks=4, tokens_per_block=16, num_slots=2)
    plain = compute_fingerprint(MODEL, spec, cache_format=CacheConfig().cache_format)
    sr = compute_fingerprint(MODEL, spec, cache_format=cache(
        state_dtype="bfloat16", state_rounding="stochastic").cache_format)
    with pytest.raises(TransferError, match=r"field 'cache_format' differs \(local "
                                            r"'state=model;rounding=nearest;kv=model', peer "
                                            r"'state=bfloat16;rounding=stochastic;seed=0"):
        check(plain, sr)
    other_seed = cache(state_dtype="bfloat16", state_rounding="stochastic",
                       state_rounding_seed=1).cache_format
    with pytest.raises(TransferError, match="'cache_format' differs"):
        check(sr, compute_fingerprint(MODEL, spec, cache_format=other_seed))
    check(sr, dict(sr))
    check(sr, compute_fingerprint(MODEL, spec))  # a PP / TP rank that does not declare it
    # fp8 KV: the format differs, and so do the block's real bytes (a rank that declares none)
    fp8 = PoolSpec.for_model(MODEL, num_blocks=4, tokens_per_block=16, num_slots=2,
                             kv_dtype=torch.float8_e4m3fn)
    fp8_fmt = cache(kv_dtype="float8_e4m3").cache_format
    assert fp8_fmt == "state=model;rounding=nearest;kv=float8_e4m3"
    with pytest.raises(TransferError, match=r"field 'kv_block_bytes' differs \(local 1024, "
                                            r"peer 384\)"):
        check(plain, compute_fingerprint(MODEL, fp8, cache_format=fp8_fmt))
    with pytest.raises(TransferError, match=r"field 'cache_format' differs"):
        check(compute_fingerprint(MODEL, fp8, cache_format=fp8_fmt),
              compute_fingerprint(MODEL, fp8, cache_format=CacheConfig().cache_format))
    assert compute_fingerprint(MODEL, fp8)["kv_block_bytes"] == \
        2 * 16 * MODEL.num_key_value_heads * (MODEL.head_dim + 4)


def test_a_sender_of_another_cache_format_is_refused_at_connect():
    from baton.model.pools import Pools
    from tests.unit.transfer.test_transfer_leases import MODEL as TMODEL
    from tests.unit.transfer.test_transfer_leases import Link, make
    from transfer.receiver import Receiver
    from transfer.sender import Sender

    cfg, spec, rc, sc = make(Link())
    r = Receiver(cfg, Pools(spec), compute_fingerprint(TMODEL, spec, cache_format="state=model;"
                                                       "rounding=nearest;kv=model"),
                 "127.0.0.1", rc)
    s = Sender(cfg, Pools(spec), compute_fingerprint(
        TMODEL, spec, cache_format="state=bfloat16;rounding=stochastic;seed=0;kv=model"), sc)
    try:
        with pytest.raises(TransferError) as e:
            s.connect(r.endpoint)
        assert "field 'cache_format'" in str(e.value) and "stochastic" in str(e.value), e.value
    finally:
        s.close()
        r.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a device this machine lacks")
def test_a_dtype_the_device_cannot_store_is_refused():
    with pytest.raises(ConfigError, match=r"cache\.state_dtype=bfloat16: device 'cuda' cannot "
                                          r"store bfloat16 with torch .*; allowed: model, "
                                          r"float32, bfloat16, float16"):
        resolve(cache(state_dtype="bfloat16"), MODEL.state_tensors, torch.float32, "cuda")


def test_a_split_engine_is_refused_before_any_stage_starts(tmp_path):
    """A state format the engine cannot build (here a tensor the model does not declare) is
    refused under TP x PP before the process group or a stage process exists (a refusal
    after them left the group joined and the stages running)."""
    import torch.distributed as dist

    from baton.config import BatonConfig
    from baton.engine.builder import build_engine
    from tests.support.engine_helpers import make_checkpoint

    path = make_checkpoint(tmp_path, "m", seed=1)
    cfg = BatonConfig.from_dict({"cache": {"state_dtypes": {"nope": "float16"}},
                                 "worker": {"pipeline_parallel_size": 2,
                                            "tensor_parallel_size": 2}})
    with pytest.raises(ConfigError, match=r"cache\.state_dtypes\.nope: this model declares no "
                                          r"state tensor 'nope'"):
        build_engine(cfg, str(path))
    assert not dist.is_initialized()


def test_a_kv_dtype_the_device_cannot_store_is_refused(monkeypatch):
    from baton.cache import state_format

    monkeypatch.setattr(state_format, "_storable", lambda dtype, device: dtype != torch.float8_e4m3fn)
    with pytest.raises(ConfigError, match=r"^cache\.kv_dtype=float8_e4m3: device 'cuda' cannot "
                                          r"store float8_e4m3 with torch .*; allowed: model, "
                                          r"bfloat16, float8_e4m3$"):
        check_built(cache(kv_dtype="float8_e4m3"), MODEL.state_tensors, torch.float32, "cuda")
    assert check_built(cache(kv_dtype="bfloat16"), MODEL.state_tensors, torch.float32,
                       "cuda").kv_dtype == torch.bfloat16
