"""What speculation takes from the engine it runs in, and its construction: the state slots
kept out of the cache manager (one per draft row of every running request), the MTP head's
attention layers appended to the KV pool (so its KV shares the target's blocks, snapshots and
transfer layout), and the step itself, refused in one line when the model cannot speculate.
"""

from __future__ import annotations

import dataclasses

from baton.config.speculative import SpeculativeConfig
from baton.engine.speculative.decoder import SpeculativeDecoder
from baton.errors import ConfigError


def reserved_slots(cfg: SpeculativeConfig | None, num_slots: int, max_requests: int) -> int:
    """State slots speculation keeps out of the cache manager: one per draft row of every
    running request (K for a chain: the state after each verified position but the last,
    which is the live slot; a tree's node count: the state after each node). ConfigError
    naming the numbers when the pool cannot hold them beside the live slots."""
    k = cfg.rows_per_request if cfg is not None else 0
    if not k or not num_slots:
        return 0
    need = max_requests * (1 + k)
    if num_slots < need:
        tree = cfg.tree is not None
        what = f"speculative.tree ({k} nodes)" if tree else f"speculative.num_draft_tokens={k}"
        raise ConfigError(
            f"{what} needs {need} state slots (worker.max_num_seqs="
            f"{max_requests} x (1 live + {k} per {'node' if tree else 'position'})) but "
            f"cache.num_state_slots={num_slots}; raise num_state_slots to at least {need} "
            f"(more for snapshots) or lower "
            f"{'max_total_draft_tokens' if tree else 'num_draft_tokens'} or max_num_seqs"
        )
    return max_requests * k


def with_draft_layers(spec, model, cfg: SpeculativeConfig | None, num_blocks: int = 0):
    """`spec` with the MTP head's attention layers appended to the KV pool when speculation
    is on: its KV then shares the target's blocks, prefix tree, snapshots and transfer
    layout (an attention-only layer: no recurrent state). An attention-free spec gets a KV
    pool of `num_blocks` for them (a pipeline's last stage), or none when 0 (the head then
    keeps a pool of its own)."""
    head = model.mtp
    if cfg is None or not cfg.num_draft_tokens or head is None:
        return spec
    if not spec.attn_layers:
        if not num_blocks:
            return spec
        mcfg = model.config
        return dataclasses.replace(spec, attn_layers=tuple(head.attention_layers),
                                   num_blocks=num_blocks, num_kv_heads=mcfg.num_key_value_heads,
                                   head_dim=mcfg.head_dim)
    extra = tuple(x for x in head.attention_layers if x not in spec.attn_layers)
    return dataclasses.replace(spec, attn_layers=spec.attn_layers + extra)


def build_speculative(model, pools, cfg: SpeculativeConfig | None, max_requests: int,
                      reserved: int, where: str = "the checkpoint"):
    """The step of `cfg`, or None when speculation is off; ConfigError in one line when the
    model cannot speculate. `reserved`: the slots the cache manager keeps for it."""
    if cfg is None or cfg.num_draft_tokens == 0:
        return None
    k = cfg.num_draft_tokens
    want = reserved_slots(cfg, pools.spec.num_slots, max_requests)
    if reserved != want:
        raise ConfigError(f"speculative.num_draft_tokens={k} needs {want} state slots kept out "
                          f"of the cache manager but it keeps {reserved}: build the engine "
                          f"with build_engine")
    if model.mtp is None:
        raise ConfigError(
            f"speculative.num_draft_tokens={k} needs an MTP head but {where} has none "
            f"(num_nextn_predict_layers > 0 and mtp.* tensors); set it to 0 or use a "
            f"checkpoint with MTP weights"
        )
    return SpeculativeDecoder(model, pools, k, max_requests, pools.spec.num_slots - reserved,
                              cfg.tree, cfg.max_batch)
