"""Any family's model at tensor-parallel size t, rank r: `build_rank` builds the rank's module
tree with the family's TP module (its spec's `tp`: `local_config`, `sections`, `RULES`,
`MOE_RULES`, `parallelize`); its weights are cut from the TP-1 checkpoint section by section, each
rank reading only its rows (`shard_tensor`). Quantized weights stay packed with their scales
(`shard_packed`), `model.quantize` packs each rank's shard (`shard_quantized`)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from baton.errors import ConfigError
from baton.model import family
from baton.model.config import load_config
from baton.model.layers.linear import install_packed
from baton.model.layers.moe_tp import MODES
from baton.model.layers.parallel import TPGroup, VocabParallelEmbedding, VocabParallelHead
from baton.model.loader import (
    _canonical,
    _packer,
    checkpoint_files,
    family_loader,
    on_meta,
    packed_weights,
)
from baton.model.quant import packed, safe_open  # safe_open: the checkpoint as the float one
from baton.model.quant.quantize import quantizable
from baton.model.tp_shard import held_units
from baton.model.tp_stacks import TPExpertStacks

log = logging.getLogger("baton.model")


def shard_spans(cfg, name: str, shape, tp: int, rank: int, moe_split: str = MODES[0]
                ) -> tuple[int, list[tuple[int, int]]] | None:
    """(axis, [(start, end) of each section's part]) of checkpoint tensor `name` (TP-1
    `shape`) that rank `rank` holds, by its family's rules; None: the whole tensor."""
    fam = family.of(cfg).tp_module()
    rules = fam.MOE_RULES[moe_split] + fam.RULES
    rule = next(((s, a) for suf, s, a in rules if name.endswith(suf)), None)
    if rule is None or tp == 1:
        return None
    what, axis = rule
    spans, start = [], 0
    for units, width in fam.sections(cfg, what):
        lo, hi = held_units(units, tp, rank)
        spans.append((start + lo * width, start + hi * width))
        start += units * width
    if start != shape[axis]:
        raise ConfigError(f"checkpoint tensor {name}: {shape[axis]} rows along axis {axis}, "
                          f"expected {start}")
    return axis, spans


def shard_tensor(cfg, name: str, t, tp: int, rank: int,
                 moe_split: str = MODES[0]) -> torch.Tensor:
    """Rank `rank`'s part of checkpoint tensor `name` (TP-1 shape), by its family's rules.
    `t` is a tensor or a safetensors slice: then only the rank's rows are read, so a rank
    never holds a whole tensor it shards."""
    shape = t.shape if isinstance(t, torch.Tensor) else t.get_shape()
    cut = shard_spans(cfg, name, shape, tp, rank, moe_split)
    if cut is None:
        return t[:] if not isinstance(t, torch.Tensor) else t
    axis, spans = cut
    parts = [t[(slice(None),) * axis + (slice(a, b),)] for a, b in spans]
    return torch.cat(parts, dim=axis).contiguous()


def shard_packed(cut, f, name: str) -> torch.Tensor | None:
    """A quantized checkpoint weight's shard (`shard_spans`' `cut`) packed as stored, each
    section's part read on its own (`QuantSlice.packed`); None where it has no packed form."""
    if cut is None:
        return f.packed(name)
    axis, spans = cut
    parts = []
    for span in spans:
        p = f.packed(name, cols=span) if axis == 1 else \
            f.packed(name, rows=span) if axis == 0 else None
        if p is None:
            return None
        parts.append(p)
    return packed.cat(parts, axis)


def shard_quantized(cut, t, name: str, mode: str, tp: int) -> torch.Tensor:
    """`model.quantize` on a rank: its shard equals the same shard of the whole tensor
    quantized (`packed.pack`) bit for bit. Rows (and experts) quantize on their own, so a cut
    along them packs only the rank's rows; a cut along the columns (row-parallel weights:
    int8's per-channel scale spans the whole row) quantizes the whole tensor and keeps the
    rank's columns, refused in one line where it would cut an int4 group."""
    shape = t.get_shape() if not isinstance(t, torch.Tensor) else t.shape
    if cut is None or cut[0] != len(shape) - 1:
        axis = None if cut is None else cut[0]
        w = t[:] if cut is None else torch.cat(
            [t[(slice(None),) * axis + (slice(a, b),)] for a, b in cut[1]], dim=axis)
        return packed.pack(w, mode)
    whole = packed.pack(t[:], mode)
    lead = (slice(None),) * (len(shape) - 1)
    try:
        return packed.cat([packed.cut(whole, lead + (slice(a, b),)) for a, b in cut[1]],
                          len(shape) - 1)
    except ValueError:
        raise ConfigError(
            f"tensor_parallel_size={tp}: checkpoint tensor {name} {list(shape)}: the rank's "
            f"columns {', '.join(f'[{a}:{b}]' for a, b in cut[1])} cut model.quantize "
            f"{mode}'s groups of {packed.GROUP} columns: "
            "use a tensor-parallel size whose shards are whole groups, or 1") from None


def build_rank(cfg, tp: TPGroup, moe_split: str = MODES[0],
               stage: tuple[range, bool, bool] | None = None):
    """The rank's module tree (on the current device, meta when loading): the family's
    model (or stage) built from the rank's local config, with the modules that talk over
    the group swapped in: the family's layers (its `parallelize`), the vocab-parallel
    embedding and LM head."""
    spec = family.of(cfg)
    ftp = spec.tp_module()
    local = ftp.local_config(cfg, tp.size, moe_split)
    model = spec.model_class()(local) if stage is None else spec.stage_class()(local, *stage)
    if tp.size == 1:
        return model
    ftp.parallelize(cfg, tp, model.blocks(), moe_split)
    if model.first:
        model.set_embedding(VocabParallelEmbedding(local.vocab_size, cfg.hidden_size,
                                                   tp.rank * local.vocab_size, tp))
    if model.last:
        model.lm_head = VocabParallelHead(cfg.hidden_size, local.vocab_size, tp)
    return model


def load_tp_model(path: str | Path, tp: TPGroup, device="cpu", dtype=torch.float32,
                  stage: tuple[range, bool, bool] | None = None, moe_split: str = MODES[0],
                  quantize: str | None = None):
    """Rank `tp.rank`'s model (or, with `stage` = (layers, first, last), its share of one
    pipeline stage) with its shard of the checkpoint's weights; `.config` is the shard's
    (its pools'), `.full_config` the whole model's. `moe_split`: how routed experts are
    split (`layers.moe_tp.MODES`). A quantized checkpoint's weights stay packed as stored
    where the single-process loader keeps them so (`shard_packed`), each rank holding its
    rows / columns with their scales; `quantize` (int8 / int4, `model.quantize`) packs the
    rank's shard of each quantizable weight as the whole model's would be (`shard_quantized`).
    Linears with packed weights compute through `layers.linear.install_packed`."""
    path = Path(path)
    cfg = load_config(path)
    with on_meta():
        model = build_rank(cfg, tp, moe_split, stage)
    expected = model.state_dict()
    fam = family_loader(cfg)
    state = {}
    stacks = TPExpertStacks(expected, tp.size, tp.rank, moe_split)
    pack_stored = torch.device(device).type == "cpu" and dtype == torch.float32 \
        and packed_weights() and not quantize
    linears = _linear_weights(model)
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                ours = _canonical(name, fam.prefix_aliases)
                if stacks.claim(ours, name, file):  # one expert's tensor (published layout)
                    continue
                # a tied head (possibly on a last stage without the embeddings) reads them
                targets = [ours, "lm_head.weight"] if cfg.tie_word_embeddings \
                    and ours == fam.embeddings else [ours]
                for tgt in (x for x in targets if x in expected and x not in state):
                    try:
                        t = _shard(cfg, tgt, f, name, tp, moe_split, quantize,
                                   pack_stored and tgt in linears)
                    except ConfigError as e:
                        raise ConfigError(f"tensor_parallel_size={tp.size}: {e}"
                                          if "tensor_parallel_size" not in str(e) else str(e)
                                          ) from None
                    if tuple(t.shape) != tuple(expected[tgt].shape):
                        raise ConfigError(
                            f"checkpoint tensor {name}: rank {tp.rank} shard {list(t.shape)}, "
                            f"expected {list(expected[tgt].shape)}")
                    want = torch.float32 if tgt.endswith(fam.fp32_suffixes) else dtype
                    state[tgt] = t if packed.kind(t) is not None else \
                        t.to(device=device, dtype=want)
    stacks.load(state, device, dtype, _packer(quantize), stored=pack_stored, quantize=quantize)
    missing = [k for k in expected if k not in state]
    if missing:
        raise ConfigError(f"checkpoint {str(path)!r} is missing tensor(s) {missing[:8]}")
    model.requires_grad_(False)  # first: a packed (integer) weight cannot require grad
    model.load_state_dict(state, strict=True, assign=True)
    model.full_config = cfg
    if quantize:
        n = sum(1 for p in model.parameters() if packed.kind(p) is not None)
        log.info("model.quantize %s: %d weight tensors of rank %d packed as they were read",
                 quantize, n, tp.rank)
    return install_packed(model.eval(), "decode" if stage is None else "run_layers")


def _linear_weights(model) -> set[str]:
    """The names of the weights the model's linears hold, those a quantized checkpoint's
    weights may stay packed in (expert stacks: `TPExpertStacks`); never the LM head: families
    read their dtype off it, and the vocab-parallel head gathers float logits."""
    names = {f"{m}.weight" for m, mod in model.named_modules()
             if isinstance(mod, torch.nn.Linear)}
    return names - {"lm_head.weight"}


def _shard(cfg, tgt: str, f, name: str, tp: TPGroup, moe_split: str, quantize, stored: bool):
    """Rank `tp.rank`'s part of checkpoint tensor `name` (model name `tgt`): packed as stored
    (`stored`), quantized (`quantize`, where `quantizable` says so for the whole tensor), or
    the float shard."""
    sl = f.get_slice(name)
    shape = tuple(sl.get_shape())
    cut = shard_spans(cfg, tgt, shape, tp.size, tp.rank, moe_split)
    if stored and len(shape) == 2 and hasattr(f, "packed"):
        got = shard_packed(cut, f, name)
        if got is not None:
            return got
    if quantize and quantizable(tgt, torch.empty(shape, device="meta"), quantize):
        return shard_quantized(cut, sl, name, quantize, tp.size)
    return shard_tensor(cfg, tgt, sl, tp.size, tp.rank, moe_split)


def family_tp(cfg):
    """The TP module of `cfg`'s family (refused, naming the families with one, if none)."""
    return family.of(cfg).tp_module()
