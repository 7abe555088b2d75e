"""Any family's model at tensor-parallel size t, rank r: `build_rank` builds the rank's module
tree with the family's TP module (its spec's `tp`: `local_config`, `sections`, `RULES`,
`MOE_RULES`, `parallelize`); its weights are cut from the TP-1 checkpoint section by section, each
rank reading only its rows (`shard_tensor`)."""

from __future__ import annotations

from pathlib import Path

import torch

from baton.errors import ConfigError
from baton.model import family
from baton.model.config import load_config
from baton.model.layers.moe_tp import MODES
from baton.model.layers.parallel import TPGroup, VocabParallelEmbedding, VocabParallelHead
from baton.model.loader import _canonical, checkpoint_files, family_loader
from baton.model.quant import safe_open  # the checkpoint as the float one it encodes
from baton.model.tp_shard import held_units
from baton.model.tp_stacks import TPExpertStacks


def shard_tensor(cfg, name: str, t, tp: int, rank: int,
                 moe_split: str = MODES[0]) -> torch.Tensor:
    """Rank `rank`'s part of checkpoint tensor `name` (TP-1 shape), by its family's rules.
    `t` is a tensor or a safetensors slice: then only the rank's rows are read, so a rank
    never holds a whole tensor it shards."""
    fam = family.of(cfg).tp_module()
    rules = fam.MOE_RULES[moe_split] + fam.RULES
    rule = next(((s, a) for suf, s, a in rules if name.endswith(suf)), None)
    if rule is None or tp == 1:
        return t[:] if not isinstance(t, torch.Tensor) else t
    what, axis = rule
    size = (t.shape if isinstance(t, torch.Tensor) else t.get_shape())[axis]
    parts, start = [], 0
    for units, width in fam.sections(cfg, what):
        lo, hi = held_units(units, tp, rank)
        a, b = start + lo * width, start + hi * width
        parts.append(t[(slice(None),) * axis + (slice(a, b),)])
        start += units * width
    if start != size:
        raise ConfigError(f"checkpoint tensor {name}: {size} rows along axis {axis}, "
                          f"expected {start}")
    return torch.cat(parts, dim=axis).contiguous()


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
                  stage: tuple[range, bool, bool] | None = None, moe_split: str = MODES[0]):
    """Rank `tp.rank`'s model (or, with `stage` = (layers, first, last), its share of one
    pipeline stage) with its shard of the checkpoint's weights; `.config` is the shard's
    (its pools'), `.full_config` the whole model's. `moe_split`: how routed experts are
    split (`layers.moe_tp.MODES`)."""
    path = Path(path)
    cfg = load_config(path)
    with torch.device("meta"):
        model = build_rank(cfg, tp, moe_split, stage)
    expected = model.state_dict()
    fam = family_loader(cfg)
    state = {}
    stacks = TPExpertStacks(expected, tp.size, tp.rank, moe_split)
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
                    t = shard_tensor(cfg, tgt, f.get_slice(name), tp.size, tp.rank,
                                     moe_split)
                    if tuple(t.shape) != tuple(expected[tgt].shape):
                        raise ConfigError(
                            f"checkpoint tensor {name}: rank {tp.rank} shard {list(t.shape)}, "
                            f"expected {list(expected[tgt].shape)}")
                    want = torch.float32 if tgt.endswith(fam.fp32_suffixes) else dtype
                    state[tgt] = t.to(device=device, dtype=want)
    stacks.load(state, device, dtype)
    missing = [k for k in expected if k not in state]
    if missing:
        raise ConfigError(f"checkpoint {str(path)!r} is missing tensor(s) {missing[:8]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.full_config = cfg
    model.requires_grad_(False)
    return model.eval()


def family_tp(cfg):
    """The TP module of `cfg`'s family (refused, naming the families with one, if none)."""
    return family.of(cfg).tp_module()
