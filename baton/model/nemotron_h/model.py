"""NemotronH causal LM over Baton's paged pools: the `prefill` / `decode` contract the engine uses.

Module names mirror the HF checkpoint (`backbone.layers.{i}.mixer.*`, `lm_head.weight`), so
`load_state_dict` takes a real NemotronH checkpoint unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from baton.errors import ConfigError, InvalidRequestError
from baton.model.layers import fast_decode, fused
from baton.model.layers.attention import Attention
from baton.model.layers.mamba2 import Mamba2Mixer
from baton.model.layers.mlp import MLP
from baton.model.layers.moe import MoE
from baton.model.layers.norms import RMSNorm
from baton.model.nemotron_h.config import ModelConfig
from baton.model.paged import StepContext, decode_meta, prefill_meta, slot_context
from baton.model.pools import Pools, PoolSpec
from baton.model.protocol import LOCAL, Mix

MIXERS = {"M": Mamba2Mixer, "*": Attention, "-": MLP, "E": MoE}


class Block(nn.Module):
    """Pre-norm residual block around one mixer."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = MIXERS[cfg.pattern[layer_idx]](cfg, layer_idx=layer_idx)
        # MLP and MoE mixers read no KV or state: one forward for prefill and decode
        self.stateless = getattr(self.mixer, "stateless", False)

    def forward(self, h: torch.Tensor, ctx: StepContext, decode: bool) -> torch.Tensor:
        x = self.norm(h)
        if self.stateless:
            return h + self.mixer(x)
        return h + (self.mixer.decode(x, ctx) if decode else self.mixer.prefill(x, ctx))

    def run_mixed(self, h: torch.Tensor, mix: Mix) -> torch.Tensor:
        x = self.norm(h)
        return h + (self.mixer(x) if self.stateless else mix(self.mixer, x))


def nemotron_parts(block: Block):
    """A `Block`'s parts for `fast_decode`: one, its mixer (or MLP / MoE)."""
    n = block.norm
    return [(n.weight, n.eps, n.weight, block.mixer, not block.stateless)]


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)

    def forward(self, ids: torch.Tensor, ctx: StepContext, decode: bool,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        h = self.embeddings(ids)
        if decode and on_layer is None and fast_decode.applies(h, ctx.pools):
            # the fast path: every layer in one call of the kernels (fast_decode)
            return self.norm_f(fast_decode.decode_layers(self.layers, h, ctx,
                                                         nemotron_parts))
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, decode)
            if on_layer is not None:
                on_layer(i)  # layer i's KV and state for this call are final now
        return self.norm_f(h)


class NemotronHModel(nn.Module):
    capabilities = LOCAL

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.mtp: nn.Module | None = None
        """The MTP head, when the checkpoint has one (`baton.model.loader.attach_mtp`)."""
        self.backbone = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (linear weights may be stored narrower: model.weight_dtype)."""
        return self.backbone.norm_f.weight.dtype

    @property
    def embedding(self) -> nn.Embedding:
        return self.backbone.embeddings

    def blocks(self) -> list[Block]:
        return list(self.backbone.layers)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm_f(h)

    def make_pools(self, num_blocks: int, tokens_per_block: int, num_slots: int) -> Pools:
        """Pools for every layer of this model, in its dtype and on its device."""
        spec = PoolSpec.for_model(
            self.config,
            num_blocks=num_blocks,
            tokens_per_block=tokens_per_block,
            num_slots=num_slots,
            dtype=self.dtype,
            device=str(self.device),
        )
        return Pools(spec)

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: torch.LongTensor,
        start_pos: int,
        block_table: list[int],
        slot: int,
        pools: Pools,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run prompt tokens input_ids[T] that sit at positions start_pos..start_pos+T-1.

        Attention layers write K/V at the blocks of `block_table` and attend over 0..p; Mamba
        layers start from slot `slot` (zeros when start_pos == 0) and leave the state after the
        last token there. Returns float32 logits [vocab] of the last token ([T, vocab] if
        all_logits).
        """
        ids = input_ids[None]
        return self.prefill_batch(ids, [start_pos], [block_table], [slot], pools, all_logits)[0]

    @torch.inference_mode()
    def prefill_batch(
        self,
        input_ids: torch.LongTensor,
        start_positions: list[int],
        block_tables: list[list[int]],
        slots: list[int],
        pools: Pools,
        all_logits: bool = False,
        on_layer: Callable[[int], None] | None = None,
        hidden_out: list | None = None,
    ) -> torch.Tensor:
        """`prefill` of n sequences with the same number of new tokens in one forward:
        input_ids[n, T], sequence i at start_positions[i] with its own table and slot. Returns
        float32 logits [n, vocab] ([n, T, vocab] if all_logits); each row is what `prefill` of
        that sequence alone gives. `on_layer(i)` runs after global layer i has written its
        KV and state (layer-wise handoff). `hidden_out` (a list): gets the final-normed hidden
        states [n, T, hidden] appended (what an MTP head reads).
        """
        _check_pools(self.config, pools)
        n, T = input_ids.shape
        if T == 0:
            raise InvalidRequestError("prefill got no tokens: input_ids is empty")
        attn = prefill_meta(start_positions, T, block_tables, pools) if pools.has_kv else None
        ctx = slot_context(pools, attn, slots, fresh=[p == 0 for p in start_positions])
        h = self.backbone(input_ids.to(self.device), ctx, decode=False, on_layer=on_layer)
        if hidden_out is not None:
            hidden_out.append(h)
        return self.lm_head(h if all_logits else h[:, -1]).float()

    @torch.inference_mode()
    def decode(
        self,
        input_ids: torch.LongTensor,
        positions: torch.LongTensor,
        block_tables: list[list[int]] | torch.Tensor,
        slots: torch.LongTensor,
        pools: Pools,
        hidden_out: list | None = None,
        static: bool = False,
    ) -> torch.Tensor:
        """One token for each of B sequences, as one batch: token input_ids[i] sits at
        positions[i] of the sequence with block table block_tables[i] and state slot slots[i].
        Returns float32 logits [B, vocab]. `hidden_out` (a list): gets the final-normed
        hidden states [B, hidden] appended (what an MTP head reads). `static`: the bucketed
        step's tensors, read without a host sync (`baton.model.paged.decode_meta`)."""
        _check_pools(self.config, pools)
        attn = (decode_meta(positions, block_tables, pools, lean=fused.kernel_attention(pools),
                            static=static) if pools.has_kv else None)
        ctx = slot_context(pools, attn, slots if static else slots.tolist())
        h = self.backbone(input_ids.to(self.device), ctx, decode=True)
        if hidden_out is not None:
            hidden_out.append(h)
        return self.lm_head(h).float()


def _check_pools(cfg: ModelConfig, pools: Pools) -> None:
    """Fail before any layer writes: pools must hold every attention and Mamba layer (KV
    layers past the model's own, an MTP head's, may follow)."""
    spec = pools.spec
    n = len(cfg.attention_layers)
    if spec.attn_layers[:n] == cfg.attention_layers and spec.state_layers == cfg.state_layers \
            and all(layer >= cfg.num_layers for layer in spec.attn_layers[n:]):
        return
    missing = sorted(
        set(cfg.attention_layers) - set(spec.attn_layers)
        | set(cfg.state_layers) - set(spec.state_layers)
    )
    raise ConfigError(
        f"pools hold attention layers {list(spec.attn_layers)} and Mamba layers "
        f"{list(spec.state_layers)} but the model (pattern {cfg.pattern!r}) also needs layers "
        f"{missing}: build them with PoolSpec.for_model(config, ...) over all layers"
    )
