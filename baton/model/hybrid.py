"""The causal LM every family's model is: embeddings, a stack of layers over Baton's paged
pools, a final norm and an LM head, with the `prefill` / `prefill_batch` / `decode` contract
the engine calls (`baton.model.protocol.CausalLM`), written once. A family's model
subclasses `HybridLM` and declares its parts: its module tree (named as its checkpoint
names its tensors), `embedding`, `layer_list`, `final_norm`, `fast_parts` (how
`fast_decode` splits one of its layers) and `state_kind` (its recurrent layers' name, for
errors). Its layers take `(h, ctx, decode)` (`protocol.Layer`).

    ids -> embedding -> layer 0 .. layer N-1 -> final_norm -> lm_head -> float32 logits
                        (decode on the fast path: every layer in one call, fast_decode)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from baton.errors import ConfigError, InvalidRequestError
from baton.model.layers import fast_decode, fused
from baton.model.paged import StepContext, decode_meta, prefill_meta, slot_context
from baton.model.pools import Pools, PoolSpec
from baton.model.protocol import LOCAL


class HybridLM(nn.Module):
    capabilities = LOCAL
    first = last = True
    """A whole model is its own first and last stage (`protocol.Stage`)."""
    tp_place: tuple[int, int] | None = None
    full_config = None
    """A tensor-parallel rank's shard: the whole model's config (`protocol.CausalLM`)."""
    state_kind = "state"
    """What the family calls its recurrent layers ("Mamba", "DeltaNet"), for errors."""
    config: object
    lm_head: nn.Linear

    # ---- what a family declares ---------------------------------------------------------
    @property
    def embedding(self) -> nn.Embedding:
        raise NotImplementedError

    @property
    def layer_list(self) -> nn.ModuleList:
        """The layers, in order (the fast path caches its plan on this module)."""
        raise NotImplementedError

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def fast_parts(layer) -> list:
        """(norm weight as the kernel reads it, eps, watched norm weight, module, is mixer)
        of each part of `layer` (`fast_decode.decode_layers`)."""
        raise NotImplementedError

    # ---- written once -------------------------------------------------------------------
    @property
    def layer_ids(self) -> range:
        return range(self.config.num_layers)

    def blocks(self) -> list[nn.Module]:
        return list(self.layer_list)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def make_pools(self, num_blocks: int, tokens_per_block: int, num_slots: int,
                   kv_dtype: torch.dtype | None = None) -> Pools:
        """Pools for every layer of this model, in its dtype (KV: `kv_dtype` where given) and
        on its device."""
        spec = PoolSpec.for_model(self.config, num_blocks=num_blocks,
                                  tokens_per_block=tokens_per_block, num_slots=num_slots,
                                  dtype=self.dtype, device=str(self.device), kv_dtype=kv_dtype)
        return Pools(spec)

    def run(self, ids: torch.Tensor, ctx: StepContext, decode: bool,
            on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Final-normed hidden states of token ids through every layer."""
        h = self.embedding(ids)
        layers = self.layer_list
        if decode and on_layer is None and fast_decode.applies(h, ctx.pools):
            # the fast path: every layer in one call of the kernels (fast_decode)
            return self.final_norm(fast_decode.decode_layers(layers, h, ctx, self.fast_parts))
        for i, layer in enumerate(layers):
            h = layer(h, ctx, decode)
            if on_layer is not None:
                on_layer(i)  # layer i's KV and state for this call are final now
        return self.final_norm(h)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.LongTensor, start_pos: int, block_table: list[int],
                slot: int, pools: Pools, all_logits: bool = False) -> torch.Tensor:
        """Run prompt tokens input_ids[T] that sit at positions start_pos..start_pos+T-1.

        Attention layers write K/V at the blocks of `block_table` and attend over 0..p;
        recurrent layers start from slot `slot` (zeros when start_pos == 0) and leave the
        state after the last token there. Returns float32 logits [vocab] of the last token
        ([T, vocab] if all_logits).
        """
        ids = input_ids[None]
        return self.prefill_batch(ids, [start_pos], [block_table], [slot], pools, all_logits)[0]

    @torch.inference_mode()
    def prefill_batch(self, input_ids: torch.LongTensor, start_positions: list[int],
                      block_tables: list[list[int]], slots: list[int], pools: Pools,
                      all_logits: bool = False,
                      on_layer: Callable[[int], None] | None = None,
                      hidden_out: list | None = None) -> torch.Tensor:
        """`prefill` of n sequences with the same number of new tokens in one forward:
        input_ids[n, T], sequence i at start_positions[i] with its own table and slot.
        Returns float32 logits [n, vocab] ([n, T, vocab] if all_logits); each row is what
        `prefill` of that sequence alone gives. `on_layer(i)` runs after global layer i has
        written its KV and state (layer-wise handoff). `hidden_out` (a list): gets the
        final-normed hidden states [n, T, hidden] appended (what an MTP head reads).
        """
        self.check_pools(pools)
        n, T = input_ids.shape
        if T == 0:
            raise InvalidRequestError("prefill got no tokens: input_ids is empty")
        attn = prefill_meta(start_positions, T, block_tables, pools) if pools.has_kv else None
        ctx = slot_context(pools, attn, slots, fresh=[p == 0 for p in start_positions])
        h = self.run(input_ids.to(self.device), ctx, decode=False, on_layer=on_layer)
        if hidden_out is not None:
            hidden_out.append(h)
        return self.lm_head(h if all_logits else h[:, -1]).float()

    @torch.inference_mode()
    def decode(self, input_ids: torch.LongTensor, positions: torch.LongTensor,
               block_tables: list[list[int]] | torch.Tensor, slots: torch.LongTensor,
               pools: Pools, hidden_out: list | None = None,
               static: bool = False) -> torch.Tensor:
        """One token for each of B sequences, as one batch: token input_ids[i] sits at
        positions[i] of the sequence with block table block_tables[i] and state slot slots[i].
        Returns float32 logits [B, vocab]. `hidden_out` (a list): gets the final-normed
        hidden states [B, hidden] appended (what an MTP head reads). `static`: the bucketed
        step's tensors, read without a host sync (`baton.model.paged.decode_meta`)."""
        self.check_pools(pools)
        attn = (decode_meta(positions, block_tables, pools, lean=fused.kernel_attention(pools),
                            static=static) if pools.has_kv else None)
        ctx = slot_context(pools, attn, slots if static else slots.tolist())
        h = self.run(input_ids.to(self.device), ctx, decode=True)
        if hidden_out is not None:
            hidden_out.append(h)
        return self.lm_head(h).float()

    def check_pools(self, pools: Pools) -> None:
        """Fail before any layer writes: pools must hold every attention and recurrent layer
        (KV layers past the model's own, an MTP head's, may follow)."""
        cfg, spec = self.config, pools.spec
        n = len(cfg.attention_layers)
        if spec.attn_layers[:n] == cfg.attention_layers \
                and tuple(spec.state_layers) == cfg.state_layers \
                and all(layer >= cfg.num_layers for layer in spec.attn_layers[n:]):
            return
        missing = sorted(set(cfg.attention_layers) - set(spec.attn_layers)
                         | set(cfg.state_layers) - set(spec.state_layers))
        raise ConfigError(
            f"pools hold attention layers {list(spec.attn_layers)} and {self.state_kind} "
            f"layers {list(spec.state_layers)} but the model (pattern {cfg.pattern!r}) also "
            f"needs layers {missing}: build them with PoolSpec.for_model(config, ...) over all "
            f"layers"
        )


class HybridStage(nn.Module):
    """One pipeline stage of a family's model (`protocol.Stage`): a contiguous range of
    global layers, plus the embeddings on the first stage and the final norm and LM head on
    the last. A family's stage builds its module tree under the whole model's names (its
    layers in a ModuleDict keyed by global id, so it loads straight from the checkpoint) and
    declares `layer_dict`, `embedding`, `set_embedding`, `final_norm` and `dtype`."""

    lm_head: nn.Linear
    tp_place: tuple[int, int] | None = None
    """TP x PP: this rank's (TP rank, TP size) within its stage (`protocol.CausalLM`)."""
    full_config = None
    before_forward = None
    """TP x PP: the stage leader's hook handing each micro-batch to its TP peers first
    (`baton.engine.tp.pipeline.attach_leader`); None: no peers."""

    def __init__(self, config, layers: range, first: bool, last: bool):
        super().__init__()
        self.config, self.layer_ids, self.first, self.last = config, layers, first, last
        self.mtp: nn.Module | None = None
        """The MTP head on a speculating worker's last stage (`loader.load_stage`)."""

    @property
    def layer_dict(self) -> nn.ModuleDict:
        raise NotImplementedError

    def blocks(self) -> list[nn.Module]:
        return list(self.layer_dict.values())

    @property
    def param(self) -> torch.Tensor:
        return next(self.parameters())

    @property
    def device(self) -> torch.device:
        return self.param.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids.to(self.device))

    def run_layers(self, h: torch.Tensor, ctx: StepContext, decode: bool) -> torch.Tensor:
        for layer in self.layer_dict.values():
            h = layer(h, ctx, decode)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of the final hidden states `h` (last stage only)."""
        return self.lm_head(self.final_norm(h)).float()
