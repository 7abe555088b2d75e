"""NemotronH multi-token-prediction (MTP) head, as published: `mtp.layers.{i}.*` (the loader's
`attach_mtp` gives a loaded model its family's head).

Config (`config.json`): `num_nextn_predict_layers` (0 = none) and the head's own pattern,
`mtp_hybrid_override_pattern` (e.g. "*-", "*E") or `mtp_layers_block_type` (a list of HF
block types). The layers together form ONE MTP step, applied K times for K drafts:

    x   = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])      h_i: target hidden after norm_f
    x   = x + mixer_l(norm_l(x))   for every layer l of the head ('*' attention, '-' MLP,
                                   'E' MoE: the target's MoE block, baton/model/layers/moe.py)
    out = final_layernorm(x)       (on the last layer) -> shared lm_head -> draft logits
    out is also the hidden of the next draft step.

Names: `mtp.layers.0.{enorm,hnorm,eh_proj}`, `mtp.layers.{l}.norm`, `mtp.layers.{l}.mixer.*`
(the target's mixer names), `mtp.layers.{last}.final_layernorm`. Embedding and LM head are
the target's (passed in, not owned). The head's attention layers get global layer ids after
the target's (`num_layers + l`) and keep their KV in a pool of their own (`make_pools`) that
shares the target's block ids, so a request's block table addresses both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.errors import ConfigError
from baton.model.layers import fast_decode
from baton.model.layers.attention import Attention
from baton.model.layers.mlp import MLP
from baton.model.layers.norms import RMSNorm
from baton.model.paged import StepContext
from baton.model.pools import Pools, PoolSpec

BLOCK_TYPE_TO_CHAR = {"full_attention": "*", "mlp": "-", "moe": "E", "linear_attention": "M"}
MTP_CHARS = "*-E"
MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class MTPSpec:
    num_steps: int
    """`num_nextn_predict_layers`: MTP steps the checkpoint declares (Baton applies step 0)."""
    pattern: str
    """One char per physical layer of one step: '*' attention, '-' MLP, 'E' MoE."""


def mtp_spec(cfg) -> MTPSpec | None:
    """The MTP head `cfg.raw` (the config.json) declares, or None."""
    raw = getattr(cfg, "raw", {}) or {}
    n = int(raw.get("num_nextn_predict_layers") or 0)
    if n <= 0:
        return None
    pattern = raw.get("mtp_hybrid_override_pattern")
    if not pattern:
        types = raw.get("mtp_layers_block_type") or ["full_attention", "moe"]
        unknown = [t for t in types if t not in BLOCK_TYPE_TO_CHAR]
        if unknown:
            raise ConfigError(f"mtp_layers_block_type entries {unknown} are unknown: expected "
                              f"some of {sorted(BLOCK_TYPE_TO_CHAR)}")
        pattern = "".join(BLOCK_TYPE_TO_CHAR[t] for t in types)
    bad = sorted({c for c in pattern if c not in MTP_CHARS})
    if bad:
        raise ConfigError(f"MTP layer kind(s) {bad} in mtp_hybrid_override_pattern {pattern!r} "
                          f"are not supported: Baton's MTP head takes {list(MTP_CHARS)}")
    return MTPSpec(n, str(pattern))


class MTPLayer(nn.Module):
    def __init__(self, cfg, kind: str, index: int, first: bool, last: bool):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        if first:
            self.enorm = RMSNorm(H, eps)
            self.hnorm = RMSNorm(H, eps)
            self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.norm = RMSNorm(H, eps)
        self.attention = kind == "*"
        gid = cfg.num_layers + index
        if self.attention:
            self.mixer = Attention(cfg, layer_idx=gid)
        elif kind == "E":
            from baton.model.layers.moe import MoE

            self.mixer = MoE(cfg, layer_idx=gid)
        else:
            self.mixer = MLP(cfg, layer_idx=gid)
        if last:
            self.final_layernorm = RMSNorm(H, eps)


class MTPHead(nn.Module):
    """One MTP step over the target's embedding and LM head (see the module docstring)."""

    def __init__(self, cfg, spec: MTPSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        n = len(spec.pattern)
        self.layers = nn.ModuleList(
            MTPLayer(cfg, c, i, i == 0, i == n - 1) for i, c in enumerate(spec.pattern))

    @property
    def declared(self) -> str:
        """What the config declares, for errors."""
        return f"num_nextn_predict_layers={self.spec.num_steps}, pattern {self.spec.pattern!r}"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Global ids of the head's attention layers (after the target's)."""
        return tuple(self.cfg.num_layers + i for i, c in enumerate(self.spec.pattern) if c == "*")

    def make_pools(self, target: PoolSpec) -> Pools:
        """KV for the head's attention layers, block for block beside the target's pool."""
        return Pools(PoolSpec.kv_beside(target, self.attention_layers, self.cfg))

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, embed: nn.Embedding,
                lm_head: nn.Linear, ctx: StepContext, decode: bool, logits: bool = True):
        """hidden [..., H] target (or previous step's) hidden of position i, next_ids [...] the
        token at i+1; decode: rows are independent queries ([R, H], `ctx.attn` from
        decode_meta), else [n, T, H] (prefill_meta). Returns (out hidden, float32 logits or
        None when not `logits`: a prompt pass only writes the head's KV)."""
        first = self.layers[0]
        e = first.enorm(embed(next_ids))
        x = first.eh_proj(torch.cat([e, first.hnorm(hidden.to(e.dtype))], dim=-1))
        # decode rows on the fast path: the layers in one call of plain decode's kernels
        y = fast_decode.program_only(self.layers, x, ctx, _parts) if decode else None
        if y is not None:
            x = y
        for layer in self.layers if y is None else ():
            y = layer.norm(x)
            if layer.attention:
                y = layer.mixer.decode(y, ctx) if decode else layer.mixer.prefill(y, ctx)
            else:
                y = layer.mixer(y)
            x = x + y
        out = self.layers[-1].final_layernorm(x)
        return out, lm_head(out).float() if logits else None

    def write_kv(self, hidden: torch.Tensor, next_ids: torch.Tensor, embed: nn.Embedding,
                 ctx: StepContext) -> None:
        """Only the head's KV entries of decode rows hidden [R, H] (with the tokens after them):
        the layers up to its last attention layer, of which only the norm and the k/v
        projections run (no query, attention, o_proj, later layers or LM head): what a prompt's
        or a verified position's entry needs, the same bits `forward` writes."""
        attn = [i for i, c in enumerate(self.spec.pattern) if c == "*"]
        if not attn:  # a head without attention keeps no KV
            return
        last = attn[-1]
        first = self.layers[0]
        e = first.enorm(embed(next_ids))
        x = first.eh_proj(torch.cat([e, first.hnorm(hidden.to(e.dtype))], dim=-1))
        for layer in self.layers[:last]:
            y = layer.norm(x)
            x = x + (layer.mixer.decode(y, ctx) if layer.attention else layer.mixer(y))
        self.layers[last].mixer.store_kv(self.layers[last].norm(x), ctx)


def _parts(layer: MTPLayer) -> list:
    """An `MTPLayer`'s part for `fast_decode` (as `nemotron_parts`): its mixer, MLP or MoE."""
    n = layer.norm
    return [(n.weight, n.eps, n.weight, layer.mixer, layer.attention)]


def build_head(cfg) -> MTPHead | None:
    """The MTP head `cfg` declares, or None (the family's `mtp`)."""
    spec = mtp_spec(cfg)
    return MTPHead(cfg, spec) if spec is not None else None
