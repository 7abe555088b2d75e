"""The stored format of recurrent state and KV, resolved against the model and the device.

`cache.state_dtype`, `cache.state_dtypes`, `cache.state_rounding` and `cache.kv_dtype` are
checked for form in `baton.config.cache`; what depends on the model (its declared state
tensors, its dtype) and on the device is checked here, when the engine builds its pools,
with one line naming the key, the value and what is allowed.

What is built so far (docs/state-precision.md): the rounding primitive
(`baton.cache.rounding`), the settings, the handshake's `cache_format` field and, in
single-process engines, the live state rounded at the policy's points
(`baton.engine.state_rounding`) and KV stored in bfloat16 or fp8 (`baton.model.paged`). Slots
still store the model dtype, so whatever would need them to store another dtype is refused
here instead of being ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.errors import ConfigError

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3": getattr(torch, "float8_e4m3fn", None)}

_STATE_ALLOWED = "model, float32, bfloat16, float16"
_KV_ALLOWED = "model, bfloat16, float8_e4m3"


@dataclass(frozen=True)
class StateFormat:
    dtypes: dict[str, torch.dtype]
    """Stored dtype of each declared state tensor, by name."""
    rounding: str
    seed: int
    kv_dtype: torch.dtype

    def rounds(self, tensor: str) -> bool:
        """Whether storing float32 `tensor` loses bits (a 16-bit stored dtype)."""
        return self.dtypes[tensor] != torch.float32


def resolve(cache, state_tensors, model_dtype: torch.dtype, device: str) -> StateFormat:
    """The stored dtypes of `cache` for a model declaring `state_tensors`, whose pools'
    dtype is `model_dtype`, on `device`. Raises ConfigError (one line) on a tensor name the
    model does not declare, a dtype the device cannot store, or stochastic rounding where
    every tensor is float32."""
    names = [t.name for t in state_tensors]
    for name, _ in cache.state_dtypes:
        if name not in names:
            raise ConfigError(f"cache.state_dtypes.{name}: this model declares no state tensor "
                              f"{name!r}; its state tensors: {', '.join(names) or 'none'}")
    dtypes = {n: _dtype(f"cache.state_dtypes.{n}" if n in dict(cache.state_dtypes)
                        else "cache.state_dtype", cache.state_dtype_of(n), model_dtype, device)
              for n in names}
    if cache.state_rounding == "stochastic" and names and all(
            d == torch.float32 for d in dtypes.values()):
        raise ConfigError(
            f"cache.state_rounding=stochastic: every state tensor is stored in float32 "
            f"(cache.state_dtype={cache.state_dtype}, model dtype "
            f"{str(model_dtype).removeprefix('torch.')}), nothing rounds; set state_dtype: "
            "bfloat16 or float16, or state_rounding: nearest")
    kv = _dtype("cache.kv_dtype", cache.kv_dtype, model_dtype, device, _KV_ALLOWED)
    return StateFormat(dtypes, cache.state_rounding, cache.state_rounding_seed, kv)


def check_built(cache, state_tensors, model_dtype: torch.dtype, device: str) -> StateFormat:
    """`resolve`, then refuse what the engine cannot store yet. KV: nothing more (bfloat16
    and fp8 KV are stored as such, `baton.model.paged`; `resolve` refuses a dtype the device
    cannot store). State: a 16-bit dtype is built only as the live-rounding schedule over
    float32 pools (`baton.engine.state_rounding`: live slots float32, snapshots 16-bit; every
    split, TP x PP included); any other dtype than the model's is refused."""
    fmt = resolve(cache, state_tensors, model_dtype, device)
    model = str(model_dtype).removeprefix("torch.")
    for name, dt in fmt.dtypes.items():
        if dt == model_dtype:
            continue
        key = (f"cache.state_dtypes.{name}" if name in dict(cache.state_dtypes)
               else "cache.state_dtype")
        if model_dtype != torch.float32:
            raise ConfigError(
                f"{key}={cache.state_dtype_of(name)}: the pools hold the model dtype ({model}) "
                f"and cannot store another; allowed with model.dtype {model}: model or {model}")
    return fmt


def kv_dtype(cache, model_dtype: torch.dtype, device: str) -> torch.dtype:
    """The stored KV dtype of `cache` (`cache.kv_dtype`) with pools of `model_dtype`."""
    return _dtype("cache.kv_dtype", cache.kv_dtype, model_dtype, device, _KV_ALLOWED)


def _dtype(key: str, name: str, model_dtype: torch.dtype, device: str,
           allowed: str = _STATE_ALLOWED) -> torch.dtype:
    if name == "model":
        return model_dtype
    dt = _TORCH.get(name)
    if dt is None or not _storable(dt, device):
        raise ConfigError(f"{key}={name}: device {device!r} cannot store {name} with torch "
                          f"{torch.__version__}; allowed: {allowed}")
    return dt


def _storable(dtype: torch.dtype, device: str) -> bool:
    try:
        torch.zeros(1, dtype=dtype, device=device).view(torch.uint8)
    except (RuntimeError, TypeError, AssertionError):
        return False
    return True
