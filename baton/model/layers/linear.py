"""The linear layers of every family: a fast path for decode-sized matmuls on CPU, and weights
stored at half the bytes (`model.weight_dtype`) but computed in float32.

What this module owns:
- `install(model, entry)` (the loader calls it) turns every `nn.Linear` into a `FastLinear`
  and marks the model's decode calls (`decode`, `run_layers(..., decode=True)`). Inside them, fp32
  activations on CPU take Baton's kernel (`baton/model/layers/cpu_kernels/gemv.cpp`, compiled
  on first use) at any row count, so a speculative verify pass of K+1 rows a request rounds
  every row as plain decode does (`baton.engine.speculative.kernel_verify`); without the
  kernel, at most `MAX_PACKED_ROWS` rows take the packed MKL / oneDNN path. The kernel reads
  the weight in place, upcasts half weights in registers, prefetches the weight stream, splits
  the outputs over torch's threads, and sums each output element in one fixed order
  (`gemv.cpp`'s contract): a row's result does not depend on the batch it is in, the thread
  count or the instruction set, where MKL differs by about 1e-6 between a row alone and the
  same row in a batch.
- Prefill on the fast path (`_prefill_linear`): oneDNN on the weight in place, or, on AVX2
  machines without AVX-512, Baton's `prefill_gemm` (`step_kernels/gemm.cpp`); either way a
  row's bits do not depend on its chunk or the thread count. Everything else (prefill on the
  reference path; CUDA; low-precision models) runs plain `F.linear`.
- `fused_linears`: a layer's several input projections on one input (q/k/v, DeltaNet's in_proj
  qkv/a/b/z, SwiGLU gate/up, MoE routers with the shared expert's input) in one kernel call on
  the fast decode path, the same bits as one call each.
- Half weights take the kernel at up to `MAX_PACKED_ROWS` rows on the reference path too
  (judged by their own parity test).
- The decode path switch: `fast` (the default) or `reference` (`BATON_DECODE_PATH=reference`,
  `set_decode_path`, `reference_scope`), bit for bit the unoptimised path. The fast path rounds
  differently from MKL (about 1e-6 relative) and is exact in itself (a row's bits do not depend
  on its batch, a verify pass equals plain decode, prefill does not depend on chunking); the
  whole test suite holds on either path.

Where the kernel cannot be built (no compiler), the packed path and the chunked upcast remain,
with one line in the log. `install` loads the kernels when a model is loaded (built once per
machine on first use), so a worker is ready only once they are. The measured speeds of each
path are in docs/performance.md (`python -m bench.linears`). tests/unit/engine/
test_decode_fast_path.py compares the two paths, tests/unit/model/layers/test_cpu_linear_kernel.py
the kernel's accuracy and contract.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from baton import envs
from baton.model import hugepages
from baton.model.layers import cpu_kernels
from baton.model.quant import packed as quant_packed

MAX_PACKED_ROWS = 64
"""Matmuls with more rows (prefill) stay on MKL's sgemm, which is at its peak there."""
PACK_HINT = 32
"""Batch size the weights are reordered for: as fast as a hint of 1 or 8 at every size 1-64."""
HALF = (torch.float16, torch.bfloat16)
QUANT_TILE = 256
"""Rows of a packed (int8 / int4) weight decoded at a time for a prefill matmul: 256 x 4,096
float32 is 4 MiB, in cache beside the activations, and the whole layer is never float."""

_state = {"path": envs.DECODE_PATH.get(), "generation": 0}
"""generation: bumped whenever `install` / `cast_weights` may have replaced weights (the
direct layer calls' cached plans, `fast_decode`, are rebuilt then)."""
_local = threading.local()  # .decoding: inside a marked decode call of this thread


def _drop_weight_views(model: nn.Module) -> None:
    """Before `hugepages` moves the weights: the views cached of the old storages go, the
    direct calls' plans are rebuilt."""
    for m in model.modules():
        for cache in ("_baton_packed", "_baton_wt", "_baton_plan"):
            m.__dict__.pop(cache, None)
    _state["generation"] += 1


hugepages.BEFORE_MOVE.append(_drop_weight_views)


def set_decode_path(path: str) -> str:
    """`fast` (default) or `reference`; returns the previous one."""
    if path not in ("fast", "reference"):
        raise ValueError(f"decode path must be 'fast' or 'reference', got {path!r}")
    old, _state["path"] = _state["path"], path
    return old


def decode_path() -> str:
    """This thread's decode path: `reference` inside `reference_scope`, else the process's."""
    return getattr(_local, "path", None) or _state["path"]


@contextlib.contextmanager
def reference_scope():
    """The calls inside run on the reference path whatever the process's: an engine that
    speculates where its verify pass cannot run on the fast path's kernels (a kernel not
    built, pools not in float32: `kernel_verify.applies`), so that it equals plain decode
    bit for bit there."""
    before = getattr(_local, "path", None)
    _local.path = "reference"
    try:
        yield
    finally:
        _local.path = before


def decoding() -> bool:
    """True inside a marked decode call (`decode_scope`) of this thread."""
    return getattr(_local, "decoding", False)


def _packed_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class FastLinear(nn.Linear):
    """`nn.Linear` with the same parameters and state dict; see the module docstring."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // max(x.shape[-1], 1)
        if quant_packed.is_packed(w):
            return _quant_linear(x, rows, w, self.bias)
        fast = (rows > 0 and decode_path() == "fast" and getattr(_local, "decoding", False)
                and x.dtype == torch.float32 and x.device.type == "cpu")
        kernel = cpu_kernels.gemv() if fast else None
        if kernel is not None and w.dtype in (torch.float32, *HALF):
            # Baton's kernel, at any row count: each output element summed in one fixed order
            # (a row alone equals the same row in any batch, at any thread count, so a verify
            # pass of K+1 rows a request equals plain decode), faster than both below.
            x2 = x.reshape(rows, x.shape[-1])
            bias = None if self.bias is None else self.bias.float()
            return kernel.linear(x2, self._packed(), bias).view(*x.shape[:-1], w.shape[0])
        if w.dtype in HALF and x.dtype == torch.float32:
            return _half_linear(x, rows, w, self.bias)
        if (rows > 0 and not getattr(_local, "decoding", False) and decode_path() == "fast"
                and x.dtype == w.dtype == torch.float32 and x.device.type == "cpu"
                and _packed_ok()):
            return _prefill_linear(x, rows, w, self.bias)
        if (not fast or rows > MAX_PACKED_ROWS or w.dtype != torch.float32
                or not _packed_ok()):
            return F.linear(x, w, self.bias)
        x2 = x.reshape(rows, x.shape[-1])
        if rows == 1 and w.shape[0] >= w.shape[1]:
            # One row: MKL's sgemm on the weight stored [in, out] streams it at close to the
            # memory bandwidth, 1.2-1.45x faster than oneDNN for the wide layers (in_proj,
            # up_proj, lm_head); at 2+ rows, or narrow layers, it is no faster or slower.
            y = torch.mm(x2, self._transposed())
            y = y if self.bias is None else y + self.bias
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self._packed(), self.bias, "none", [], "")
        return y.view(*x.shape[:-1], w.shape[0])

    def _transposed(self) -> torch.Tensor:
        """The weight as a contiguous [in, out] copy, made once (again if it is replaced)."""
        w = self.weight
        key = (w.data_ptr(), tuple(w.shape))
        cached = getattr(self, "_baton_wt", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                object.__setattr__(self, "_baton_wt", (key, w.detach().t().contiguous()))
            cached = self._baton_wt
        return cached[1]

    def _packed(self) -> torch.Tensor:
        """The weight in the fast path's layout, made once (again if the weight is replaced):
        for Baton's kernel the weight itself ([out, in], rows contiguous; a copy only if they
        are not), for oneDNN reordered into its blocks."""
        w = self.weight
        ours = cpu_kernels.gemv() is not None
        key = (w.data_ptr(), tuple(w.shape), ours)
        cached = getattr(self, "_baton_packed", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                if ours:
                    packed = w.detach() if w.stride(-1) == 1 else w.detach().contiguous()
                else:
                    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT)
            object.__setattr__(self, "_baton_packed", (key, packed))  # not a buffer: no state
            cached = self._baton_packed
        return cached[1]


def _quant_linear(x: torch.Tensor, rows: int, w: torch.Tensor, bias) -> torch.Tensor:
    """x through a packed int8 / int4 weight (`baton.model.quant.packed`). Decode on the fast
    path: Baton's kernel reads it as stored (each weight dequantized in registers: the float
    kernel's bits on the dequantized weight). A prefill on the fast path: QUANT_TILE rows of
    the weight decoded at a time into float32 and multiplied as a float prefill is
    (`_prefill_linear`); the tiles do not depend on the rows, so a row's bits do not depend on
    its chunk. With `model.quantize_activations` the fast path's prefill takes the kernel's
    integer path too. Elsewhere (reference path, other devices): the decoded weight, one layer
    at a time."""
    n_out = w.shape[0]
    bias = None if bias is None else bias.float()
    cpu = x.device.type == "cpu" and x.dtype == torch.float32 and rows > 0
    kernel = cpu_kernels.gemv() if cpu and decode_path() == "fast" else None
    if kernel is not None and (getattr(_local, "decoding", False) or packed_decoding()
                               or quant_packed.int_path(w)):
        # (the integer path, `model.quantize_activations`: prefill too, in integers)
        return kernel.linear(x.reshape(rows, x.shape[-1]), w, bias).view(*x.shape[:-1], n_out)
    if cpu and decode_path() == "fast" and _packed_ok():
        x2 = x.reshape(rows, x.shape[-1])
        y = x2.new_empty(rows, n_out)
        for i in range(0, n_out, QUANT_TILE):
            j = min(n_out, i + QUANT_TILE)
            y[:, i:j] = _prefill_linear(x2, rows, quant_packed.dense(w[i:j]).contiguous(),
                                        None if bias is None else bias[i:j])
        return y.view(*x.shape[:-1], n_out)
    return F.linear(x, quant_packed.dense(w, x.dtype).to(x.device),
                    None if bias is None else bias.to(x.dtype))


def any_linear(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    """`F.linear`, or `_quant_linear` where `w` is packed (a tensor-parallel rank's
    row-parallel and expert projections call it on their weight)."""
    if quant_packed.is_packed(w):
        return _quant_linear(x, x.numel() // max(x.shape[-1], 1), w, bias)
    return F.linear(x, w, bias)


def packed_decoding() -> bool:
    """True inside a decode call of a model `install_packed` marked (this thread)."""
    return getattr(_local, "packed_decoding", False)


def install_packed(model: nn.Module, entry: str) -> nn.Module:
    """A tensor-parallel rank's model (whose float linears stay plain `nn.Linear`): each
    linear holding a packed weight becomes a `FastLinear`, and the decode calls of `entry`
    (`DECODE_ENTRIES`) are marked for packed weights only, so those take Baton's kernel (read
    as stored, the float kernel's bits on the dequantized weight) and a prefill decodes
    QUANT_TILE rows at a time; nothing else changes path. A model without packed weights is
    returned as it is."""
    if not any(quant_packed.kind(p) is not None for p in model.parameters()):
        return model
    _state["generation"] += 1
    for m in model.modules():
        if type(m) is nn.Linear and quant_packed.kind(m.weight) is not None:
            m.__class__ = FastLinear
    when, position = DECODE_ENTRIES[entry]
    fn = getattr(model, entry)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if when is not None and not kwargs.get(when, len(args) > position and args[position]):
            return fn(*args, **kwargs)
        before = packed_decoding()
        _local.packed_decoding = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.packed_decoding = before

    setattr(model, entry, call)
    if decode_path() == "fast":
        cpu_kernels.gemv()  # built or loaded now, not in a request
    return model


def _prefill_linear(x: torch.Tensor, rows: int, w: torch.Tensor, bias) -> torch.Tensor:
    """A prefill matmul on the fast path: on AVX2 machines without AVX-512 the step kernels'
    `prefill_gemm` (each output in one fixed order: a row's bits are its own at any row count,
    chunking and thread count). Elsewhere oneDNN on the weight as it lies (no reordered copy
    is kept; oneDNN blocks it per call, which is noise beside a prefill's matmul): on the
    AVX-512 Zen 4 1.2-1.4x faster than MKL's sgemm at 256-2048 rows (about 100 against 80
    GFLOP/s on one thread), and a row's result does not depend on the rows beside it from two
    rows up, nor on the thread count; one row takes another path, so it is computed as two
    (itself twice): a prompt's logits then do not depend on how it was chunked or batched."""
    k = x.shape[-1]
    x2 = x.reshape(rows, k)
    gemm = _prefill_gemm()
    if gemm is not None and w.is_contiguous() and not (
            torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        # AVX2 machines: Baton's kernel, at MKL's rate, each output one fixed chain over k
        # (`step_kernels/gemm.cpp`): a row's bits are its own at any row count.
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        return gemm(x2, w, bias).view(*x.shape[:-1], w.shape[0])
    if rows == 1:
        x2 = x2.expand(2, k)
    y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), w, bias, "none", [], "")
    return y[:rows].view(*x.shape[:-1], w.shape[0])


def _prefill_gemm():
    """The step kernels' `prefill_gemm` where it is built (AVX2 + FMA without AVX-512: where
    it was measured faster than oneDNN), else None."""
    from baton.model.layers import step_kernels

    k = step_kernels.kernels()
    return k.prefill_gemm if k is not None and k.prefill_gemm_built() else None


def fused_linears(x: torch.Tensor, *layers) -> list[torch.Tensor] | None:
    """x through each of `layers` (bias-free `nn.Linear`s, or bare [out, in] weights) in one
    call of Baton's kernel (`linear_cat`), on the fast decode path; None where that path is
    not taken (the caller then runs them one by one). Each output is the same bits as its own
    `FastLinear` call; one call saves a layer's small projections (DeltaNet's in_proj_a / b
    are 8 x 768) their fixed cost and cold start. Outputs are column views of one [rows, sum
    out] result (not contiguous when rows > 1)."""
    kernel = cpu_kernels.gemv()
    rows = x.numel() // max(x.shape[-1], 1)
    if (kernel is None or rows == 0 or decode_path() != "fast"
            or not getattr(_local, "decoding", False) or x.dtype != torch.float32
            or x.device.type != "cpu"):
        return None
    ws = []
    for layer in layers:
        w = layer if isinstance(layer, torch.Tensor) else layer.weight
        if (getattr(layer, "bias", None) is not None or w.stride(-1) != 1
                or (w.dtype not in (torch.float32, *HALF) and quant_packed.kind(w) is None)
                or w.device.type != "cpu"):
            return None
        ws.append(w)
    y = kernel.linear_cat(x.reshape(rows, x.shape[-1]), ws)
    outs, lo = [], 0
    for w in ws:
        outs.append(y[:, lo:lo + w.shape[0]].unflatten(0, x.shape[:-1]))
        lo += w.shape[0]
    return outs


HALF_CHUNK = 256
"""Weight rows upcast at a time on the few-row path: 256 x hidden float32 stays in L2."""


def _half_linear(x: torch.Tensor, rows: int, w: torch.Tensor, bias) -> torch.Tensor:
    """x @ w.T in float32 with `w` stored in float16 / bfloat16 (each weight upcast exactly).

    Few rows: the weight is read once at half the bytes and upcast a chunk at a time into a
    buffer that stays in cache (a whole-matrix upcast would write and re-read 4 bytes per
    weight, slower than float32 weights). Many rows: one upcast, amortised over the rows."""
    bias = None if bias is None else bias.float()
    if rows > MAX_PACKED_ROWS or x.device.type != "cpu":
        return F.linear(x, w.float(), bias)
    n_out, k = w.shape
    x2 = x.reshape(rows, k)
    kernel = cpu_kernels.gemv()
    if kernel is not None and w.stride(-1) == 1:
        # Baton's kernel upcasts each weight in registers: the half-size weight is read once.
        return kernel.linear(x2, w, bias).view(*x.shape[:-1], n_out)
    out_t = x2.new_empty(n_out, rows)
    buf = x2.new_empty(min(HALF_CHUNK, n_out), k)
    for i in range(0, n_out, HALF_CHUNK):
        n = min(HALF_CHUNK, n_out - i)
        chunk = buf[:n]
        chunk.copy_(w[i:i + n])
        torch.mm(chunk, x2.t(), out=out_t[i:i + n])
    y = out_t.t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], n_out)


DECODE_ENTRIES = {"decode": (None, 0), "run_layers": ("decode", 2)}
"""The model protocol's decode entry points `install` marks: a `CausalLM`'s `decode` (every
call), a `Stage`'s `run_layers` (when its argument `decode`, third, is true)."""


def install(model: nn.Module, entry: str | None = None) -> nn.Module:
    """Every `nn.Linear` of `model` becomes a `FastLinear` in place (no copy of weights), and
    the model's decode entry point `entry` (`DECODE_ENTRIES`: "decode" for a `CausalLM`,
    "run_layers" for a `Stage`; None: a bare module) runs marked as decode."""
    _state["generation"] += 1
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = FastLinear
    if entry is not None:
        if entry not in DECODE_ENTRIES:
            raise ValueError(f"install: entry {entry!r} is not a decode entry point "
                             f"({sorted(DECODE_ENTRIES)})")
        when, position = DECODE_ENTRIES[entry]
        setattr(model, entry, _decoding(getattr(model, entry), when=when, position=position))
    if decode_path() == "fast" and any(p.device.type == "cpu" for p in model.parameters()):
        from baton.model.layers import step_kernels

        cpu_kernels.gemv()  # built (first use on this machine) or loaded now, not in a request
        step_kernels.kernels()
    return model


@contextlib.contextmanager
def decode_scope():
    """Mark the calls inside as decode (what `install` does around `model.decode`)."""
    before = getattr(_local, "decoding", False)
    _local.decoding = True
    try:
        yield
    finally:
        _local.decoding = before


def _decoding(fn, when: str | None = None, position: int = 0):
    """`fn` with the decode mark set while it runs (only when its argument `when`, at
    `position`, is true, if given)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if when is not None and not kwargs.get(when, len(args) > position and args[position]):
            return fn(*args, **kwargs)
        with decode_scope():
            return fn(*args, **kwargs)
    return call


def cast_weights(model: nn.Module, dtype: torch.dtype,
                 activation_dtype: Callable[[], torch.dtype] | None = None) -> int:
    """Store the weights of every linear layer and MoE expert stack in `dtype` (the compute
    stays in the inputs' dtype); returns the bytes saved. A weight shared with another module
    (a tied lm_head) is left alone, so the embedding lookup stays exact, and so is one whose
    cast would change `activation_dtype()` (a model's `dtype`, which a family may read off a
    linear's weight; None: a bare module, nothing to keep)."""
    shared = {id(p) for name, m in model.named_modules() if not isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    before = activation_dtype() if activation_dtype is not None else None
    saved = 0
    _state["generation"] += 1
    for m in model.modules():  # packed int8 / int4 weights (model.quantize) stay as they are
        if (isinstance(m, nn.Linear) and id(m.weight) not in shared and m.weight.dtype != dtype
                and quant_packed.kind(m.weight) is None):
            old = m.weight
            m.weight = nn.Parameter(old.detach().to(dtype), requires_grad=False)
            if activation_dtype is not None and activation_dtype() != before:
                m.weight = old  # the family reads its activation dtype off this weight
                continue
            saved += old.numel() * (old.element_size() - m.weight.element_size())
            for cached in ("_baton_packed", "_baton_wt"):
                if hasattr(m, cached):
                    object.__delattr__(m, cached)
    for m in model.modules():  # MoE expert stacks [E, out, in] (`moe.run_experts` reads them)
        for name in getattr(m, "stacked", ()):
            old = getattr(m, name)
            if (old.dtype != dtype and old.dtype.is_floating_point
                    and quant_packed.kind(old) is None):
                setattr(m, name, nn.Parameter(old.detach().to(dtype), requires_grad=False))
                saved += old.numel() * (old.element_size() - dtype.itemsize)
    return saved


def half_weights(model: nn.Module) -> bool:
    """Whether a linear layer of `model` stores its weight in float16 / bfloat16
    (`cast_weights`): on the reference path such a layer takes Baton's kernel for at most
    `MAX_PACKED_ROWS` rows and an upcast copy on MKL above, which rounds differently."""
    return any(isinstance(m, nn.Linear) and m.weight.dtype in HALF for m in model.modules())
