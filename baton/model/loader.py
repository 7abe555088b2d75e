"""Load a checkpoint directory (`config.json` + `*.safetensors`) into its family's model, or
one pipeline stage of it. The family's spec (`baton.model.family`) says which classes to
build and how the checkpoint names its tensors."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from baton.errors import ConfigError
from baton.model import family
from baton.model.config import load_config
from baton.model.family import Weights
from baton.model.layers.linear import install as install_linears
from baton.model.progress import progress
from baton.model.quant import safe_open  # the checkpoint as the float one it encodes
from baton.model.quant.checkpoint import checkpoint_files
from baton.model.stacking import ExpertStacks

log = logging.getLogger("baton.model")


MTP_PREFIX = "mtp."


_RANDOM_FILLS = frozenset(
    [getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "bernoulli_", "exponential_",
                                        "log_normal_", "cauchy_", "geometric_", "random_")]
    + [getattr(torch.nn.init, n) for n in ("normal_", "uniform_", "trunc_normal_",
                                           "kaiming_uniform_", "kaiming_normal_",
                                           "xavier_uniform_", "xavier_normal_", "orthogonal_",
                                           "sparse_")])


class _NoRandomFill(TorchFunctionMode):
    """Random fills of meta tensors (modules' `reset_parameters`) skipped: on the meta device
    they compute nothing, but their Python meta kernels import `torch._dynamo` (about 1.4 s of
    CPU in every process that builds a model: each worker, TP rank and PP stage)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


@contextmanager
def on_meta():
    """`torch.device("meta")` for building a model's skeleton (shapes only), without the random
    initialisation nothing reads (`_NoRandomFill`; this thread only)."""
    with torch.device("meta"), _NoRandomFill():
        yield


def family_loader(cfg) -> Weights:
    """How the checkpoint of `cfg`'s family names its tensors."""
    return family.of(cfg).weights


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    quantize: str | None = None,
    quantize_embeddings: str | None = None,
):
    """Build the model described by `path/config.json` and fill it from its safetensors files.

    A missing or mis-shaped tensor raises ConfigError naming it; the multi-token-prediction
    head (`mtp.*`, the family's `mtp`) is loaded as `model.mtp` when the config declares
    it; other tensors the model does not use are ignored with a warning. `quantize` (int8 /
    int4, `model.quantize`): each quantizable weight is packed as it is read (one tensor, or
    one expert stack, in float at a time; `baton.model.quant.packed`), and stays packed.
    """
    path = Path(path)
    cfg = load_config(path)
    fam = family_loader(cfg)
    with on_meta():
        model = family.of(cfg).model_class()(cfg)
        attach_mtp(model, _tensor_names(path))  # the MTP head, when declared and present
    expected = model.state_dict()
    head = (fam.embeddings, "lm_head.weight") if quantize_embeddings else ()
    state, unexpected = _read_tensors(path, expected, cfg, torch.device(device), dtype,
                                      quantize, head)
    if unexpected:
        log.warning(
            "ignoring %d checkpoint tensor(s) the model does not use, e.g. %s",
            len(unexpected),
            unexpected[:5],
        )
    model.requires_grad_(False)  # first: a packed (integer) weight cannot require grad
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.get_parameter(fam.embeddings)
    if quantize_embeddings:
        _packed_embedding(model)
    if quantize:
        log.info("model.quantize %s: %d weight tensors packed as they were read (%.1f MB)",
                 quantize, *_packed_count(model))
    return install_linears(model.eval(), "decode")


def _packed_embedding(model) -> None:
    """`model.quantize_embeddings`: the table loaded packed int8 is looked up as such (the LM
    head, a packed weight of a `FastLinear`, needs nothing more)."""
    from baton.model.quant import packed

    table = model.embedding
    if packed.kind(table.weight) in ("int8", "int8g"):
        model.set_embedding(packed.PackedEmbedding(table.weight.data))
        if model.config.tie_word_embeddings:
            model.lm_head.weight = model.embedding.weight
    log.info("model.quantize_embeddings int8: the embeddings and the LM head packed int8, "
             "a float16 scale per 32 columns")


def _packed_count(model) -> tuple[int, float]:
    from baton.model.quant import packed

    ts = [p for p in model.parameters() if packed.kind(p) is not None]
    return len(ts), sum(packed.nbytes(p) for p in ts) / 1e6


def load_stage(
    path: str | Path, layers: range, first: bool, last: bool,
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, mtp: bool = False,
    quantize: str | None = None,
):
    """Only one pipeline stage's tensors: global `layers`, the embeddings if `first`, the final
    norm and LM head if `last`. Other stages' tensors are skipped silently. `mtp` (the last
    stage of a speculating worker): also the MTP head, when the checkpoint has it, and the
    embeddings it reads (`model.mtp`). `quantize`: the stage's weights packed as `load_model`
    packs them."""
    path = Path(path)
    cfg = load_config(path)
    fam = family_loader(cfg)
    with on_meta():
        model = family.of(cfg).stage_class()(cfg, layers, first, last)
        if mtp and last and attach_mtp(model, _tensor_names(path)) and not first:
            parent, _, name = fam.embeddings.rpartition(".")[0].rpartition(".")
            model.get_submodule(parent).add_module(
                name, torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size))
    expected = model.state_dict()
    state, _ = _read_tensors(path, expected, cfg, torch.device(device), dtype, quantize)
    state = {k: v for k, v in state.items() if k in expected}  # a tied head on a non-last stage
    model.requires_grad_(False)  # first: a packed (integer) weight cannot require grad
    model.load_state_dict(state, strict=True, assign=True)
    if quantize:
        n, mb = _packed_count(model)
        log.info("model.quantize %s: %d weight tensors of layers %d-%d packed as they were "
                 "read (%.1f MB)", quantize, n, layers.start, layers.stop - 1, mb)
    return install_linears(model.eval(), "run_layers")


def mtp_head_meta(path: str | Path):
    """The MTP head the checkpoint at `path` declares and holds, on the meta device (its
    layer ids and spec; no weights), or None."""
    from types import SimpleNamespace

    holder = SimpleNamespace(config=load_config(Path(path)), mtp=None)
    with on_meta():
        attach_mtp(holder, _tensor_names(Path(path)))
    return holder.mtp


def attach_mtp(model, checkpoint_names: set[str]) -> bool:
    """Give `model` (built on the meta device) its family's MTP head when the config declares
    one and the checkpoint holds its tensors; True if attached. A head declared but absent
    from the checkpoint is left off (speculation then refuses to start); half present is an
    error."""
    head = family.of(model.config).mtp_head(model.config)
    if head is None:
        return False
    want = {MTP_PREFIX + k for k in head.state_dict()}
    have = {n for n in checkpoint_names if n.startswith(MTP_PREFIX)}
    if not have:
        return False
    # a MoE block's stacked experts may come as one tensor per expert (the loader stacks them)
    missing = sorted(w for w in want - have
                     if not any(h.startswith(w.rsplit(".", 1)[0] + ".") for h in have - want))
    if missing:
        raise ConfigError(f"checkpoint declares an MTP head ({head.declared}) but "
                          f"lacks tensor(s) {missing[:6]}")
    model.mtp = head
    return True


def _tensor_names(path: Path) -> set[str]:
    names: set[str] = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def packed_weights() -> bool:
    """Whether quantized checkpoints' weights stay packed in memory: where Baton's CPU kernels
    are on (`BATON_PACKED_WEIGHTS=0`: decoded into float32 at load)."""
    from baton import envs

    return envs.PACKED_WEIGHTS.get() and envs.CPU_KERNELS.get()


def _packer(quantize: str | None, head: tuple[str, ...] = ()):
    """name, tensor -> the tensor as the model holds it: packed where `quantize` quantizes
    it (`quant.quantize.quantizable`), the embeddings and LM head (`head`, their names) packed
    int8 per 32 columns (`model.quantize_embeddings`, `packed` int8g), else unchanged.
    `quantize` "int8g": int8 per 32 columns (`model.quantize: int8` with the integer path)."""
    if not quantize and not head:
        return lambda name, t: t
    from baton.model.quant import packed
    from baton.model.quant.quantize import quantizable

    def keep(name: str, t: torch.Tensor) -> torch.Tensor:
        if name in head and t.dim() == 2 and t.is_floating_point():
            return packed.pack(t, "int8g")
        return packed.pack(t, quantize) if quantize and quantizable(name, t, quantize) else t

    return keep


def _read_tensors(path, expected, cfg, device, dtype, quantize: str | None = None,
                  head: tuple[str, ...] = ()):
    fam = family_loader(cfg)
    keep = _packer(quantize, head)
    # quantized checkpoints' weights stay as stored where the CPU kernels read them (float32
    # compute on the CPU; `QuantSlice.packed` says which formats); elsewhere decoded
    pack_stored = device.type == "cpu" and dtype == torch.float32 and packed_weights()
    # a part the model does hold (an MTP head it attached) is read, not skipped
    state, unexpected = {}, []
    skipped = {p: 0 for p in fam.skipped if not any(k.startswith(p) for k in expected)}
    stacks = ExpertStacks(expected)
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for i, name in enumerate(progress(list(f.keys()), f"loading {file.name}", "tensor")):
                if i % DROP_EVERY == 0:
                    _drop_file_pages(file)  # the tensors read before this one: copied or packed
                part = next((p for p in skipped if name.startswith(p)), None)
                if part is not None:
                    skipped[part] += 1
                    continue
                ours = _canonical(name, fam.prefix_aliases)
                if ours == fam.embeddings and cfg.tie_word_embeddings \
                        and ours not in expected and "lm_head.weight" in expected:
                    ours = "lm_head.weight"  # a last stage without embeddings, tied head
                if stacks.claim(ours, name, file):
                    continue
                split = next((fn for suffix, fn in fam.splits.items() if ours.endswith(suffix)),
                             None)
                if split is not None:
                    parts = family.load(split)(cfg, ours, f.get_tensor(name))
                    kept = {k: v for k, v in parts.items() if k in expected}
                    for k, v in kept.items():
                        _check_shape(k, tuple(v.shape), expected[k], file)
                        state[k] = keep(k, v.to(device=device, dtype=dtype, copy=True))
                    unexpected += [] if kept else [name]
                    continue
                if ours not in expected:
                    unexpected.append(name)
                    continue
                _check_shape(ours, tuple(f.get_slice(name).get_shape()), expected[ours], file)
                want = torch.float32 if ours.endswith(fam.fp32_suffixes) else dtype
                # copied into memory torch allocates (huge pages, see baton/startup.py):
                # safetensors' own buffers have 4 KB pages, and decode streams every weight
                if pack_stored and expected[ours].dim() == 2 and ours != "lm_head.weight":
                    # (the LM head stays float: families read the activation dtype off it)
                    stored = f.packed(name)  # a quantized weight kept as stored, if it can be
                    if stored is not None:
                        state[ours] = stored
                        continue
                t = f.get_tensor(name)
                packed = keep(ours, t)  # a packed weight needs no float copy of its own
                state[ours] = packed if packed is not t else t.to(device=device, dtype=want,
                                                                   copy=True)
                del t, packed
    stacks.load(state, device, dtype, keep, stored=pack_stored and not quantize)
    for part, count in skipped.items():
        if count:
            log.info("skipping %s: %d tensor(s) under %r", fam.skipped[part], count, part)
    if cfg.tie_word_embeddings and fam.embeddings in state:
        state.setdefault("lm_head.weight", state[fam.embeddings])
    missing = [k for k in expected if k not in state]
    if missing:
        latent = [k for k in missing if "_latent_proj." in k]
        why = f"moe_latent_size={getattr(cfg, 'moe_latent_size', None)}" if latent \
            else f"pattern {cfg.pattern!r}"
        raise ConfigError(
            f"checkpoint {str(path)!r} is missing tensor(s) {(latent or missing)[:8]}"
            f"{' ...' if len(missing) > 8 else ''} required by its config.json ({why})"
        )
    return state, unexpected


DROP_EVERY = 8
"""Tensors read between two `_drop_file_pages` (each reads /proc/self/maps: a checkpoint of
thousands of expert tensors would pay it thousands of times)."""


def _drop_file_pages(file: Path) -> None:
    """Drop the pages of `file`'s mappings from this process (madvise DONTNEED; they stay in
    the page cache and fault in again, the file's bytes, if read: safetensors maps it private
    and nothing writes into it, every tensor read from it is copied or packed). safetensors maps the checkpoint and
    every page read stays resident until the file is closed: a float32 checkpoint loaded
    with `model.quantize` held all of its 400 MB mapped at the load's peak beside the packed
    weights (Baton's peak RSS in `bench engine --peer llamacpp`). Linux; elsewhere nothing."""
    import ctypes
    import os

    libc = _libc()
    if libc is None:
        return
    target = os.fsencode(os.path.realpath(file))
    try:
        with open("/proc/self/maps", "rb") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].rstrip(b"\n") == target:
                    lo, hi = (int(x, 16) for x in parts[0].split(b"-"))
                    libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)
    except OSError:
        return


def _libc():
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    if "libc" not in _LIBC:
        try:
            _LIBC["libc"] = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                                        use_errno=True)
        except OSError:
            _LIBC["libc"] = None
    return _LIBC["libc"]


_LIBC: dict = {}


def _canonical(name: str, aliases: dict[str, str]) -> str:
    for old, new in aliases.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _check_shape(name: str, got: tuple[int, ...], want: torch.Tensor, file: Path) -> None:
    if got != tuple(want.shape):
        raise ConfigError(
            f"tensor {name!r} in {file.name} has shape {list(got)} but config.json implies "
            f"{list(want.shape)}: the checkpoint and its config.json disagree"
        )
