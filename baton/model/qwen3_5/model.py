"""Qwen3.5 causal LM over Baton's paged pools: the `prefill` / `decode` contract the engine uses
(the same as `baton.model.nemotron_h.model`).

Module names mirror transformers' `Qwen3_5ForCausalLM` (`model.layers.{i}.linear_attn.*`,
`model.layers.{i}.self_attn.*`, `model.embed_tokens`, `model.norm`, `lm_head`), so a checkpoint
loads unchanged (the multimodal layout's `model.language_model.` prefix is mapped by the loader).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from baton.errors import ConfigError, InvalidRequestError
from baton.model.layers import fast_decode, fused
from baton.model.layers.deltanet import GatedDeltaNet
from baton.model.layers.gated_attention import GatedAttention
from baton.model.layers.gated_norms import ZeroCentredRMSNorm
from baton.model.layers.qwen_moe import feed_forward
from baton.model.paged import StepContext, decode_meta, prefill_meta, slot_context
from baton.model.pools import Pools, PoolSpec
from baton.model.protocol import LOCAL, Mix
from baton.model.qwen3_5.config import Qwen35Config


class DecoderLayer(nn.Module):
    """x += mixer(norm(x)); x += mlp(norm(x)); the mixer is `linear_attn` or `self_attn`."""

    def __init__(self, cfg: Qwen35Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.pattern[layer_idx] == "G":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx)
        self.mlp = feed_forward(cfg, layer_idx)  # SwiGLU, or the MoE block (MoE families)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def forward(self, h: torch.Tensor, ctx: StepContext, decode: bool) -> torch.Tensor:
        x, mixer = self.input_layernorm(h), self.mixer
        h = h + (mixer.decode(x, ctx) if decode else mixer.prefill(x, ctx))
        return h + self.mlp(self.post_attention_layernorm(h))

    def run_mixed(self, h: torch.Tensor, mix: Mix) -> torch.Tensor:
        h = h + mix(self.mixer, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


def qwen_parts(layer: DecoderLayer):
    """A `DecoderLayer`'s two parts for `fast_decode` (norm weight as the kernel reads it,
    eps, watched norm weight, module, is mixer)."""
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    return [(n1._scale(), n1.eps, n1.weight, layer.mixer, True),
            (n2._scale(), n2.eps, n2.weight, layer.mlp, False)]


class TextModel(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, ids: torch.Tensor, ctx: StepContext, decode: bool,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        h = self.embed_tokens(ids)
        if decode and on_layer is None and fast_decode.applies(h, ctx.pools):
            # the fast path: every layer in one call of the kernels (fast_decode)
            return self.norm(fast_decode.decode_layers(self.layers, h, ctx,
                                                       qwen_parts))
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, decode)
            if on_layer is not None:
                on_layer(i)  # layer i's KV and state for this call are final now
        return self.norm(h)


class Qwen35Model(nn.Module):
    capabilities = LOCAL

    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.config = config
        self.mtp: nn.Module | None = None
        """The MTP head, when the checkpoint has one (`baton.model.loader.attach_mtp`)."""
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def blocks(self) -> list[DecoderLayer]:
        return list(self.model.layers)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def make_pools(self, num_blocks: int, tokens_per_block: int, num_slots: int) -> Pools:
        spec = PoolSpec.for_model(self.config, num_blocks=num_blocks,
                                  tokens_per_block=tokens_per_block, num_slots=num_slots,
                                  dtype=self.dtype, device=str(self.device))
        return Pools(spec)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.LongTensor, start_pos: int, block_table: list[int],
                slot: int, pools: Pools, all_logits: bool = False) -> torch.Tensor:
        """Prompt tokens input_ids[T] at positions start_pos..; see `prefill_batch`."""
        ids = input_ids[None]
        return self.prefill_batch(ids, [start_pos], [block_table], [slot], pools, all_logits)[0]

    @torch.inference_mode()
    def prefill_batch(self, input_ids: torch.LongTensor, start_positions: list[int],
                      block_tables: list[list[int]], slots: list[int], pools: Pools,
                      all_logits: bool = False,
                      on_layer: Callable[[int], None] | None = None,
                      hidden_out: list | None = None) -> torch.Tensor:
        """n sequences of T new tokens each (input_ids[n, T]), sequence i at start_positions[i]
        with its own block table and state slot (zeros when it starts at 0). Returns float32
        logits [n, vocab] ([n, T, vocab] if all_logits). `hidden_out` (a list): gets the
        final-normed hidden states [n, T, hidden] appended (what an MTP head reads)."""
        _check_pools(self.config, pools)
        n, T = input_ids.shape
        if T == 0:
            raise InvalidRequestError("prefill got no tokens: input_ids is empty")
        attn = prefill_meta(start_positions, T, block_tables, pools) if pools.has_kv else None
        ctx = slot_context(pools, attn, slots, fresh=[p == 0 for p in start_positions])
        h = self.model(input_ids.to(self.device), ctx, decode=False, on_layer=on_layer)
        if hidden_out is not None:
            hidden_out.append(h)
        return self.lm_head(h if all_logits else h[:, -1]).float()

    @torch.inference_mode()
    def decode(self, input_ids: torch.LongTensor, positions: torch.LongTensor,
               block_tables: list[list[int]] | torch.Tensor, slots: torch.LongTensor,
               pools: Pools, hidden_out: list | None = None,
               static: bool = False) -> torch.Tensor:
        """One token for each of B sequences (token input_ids[i] at positions[i], table
        block_tables[i], slot slots[i]). Returns float32 logits [B, vocab]; `hidden_out` (a
        list) gets the final-normed hiddens [B, hidden] appended. `static`: the bucketed
        step's tensors, read without a host sync (`baton.model.paged.decode_meta`)."""
        _check_pools(self.config, pools)
        attn = (decode_meta(positions, block_tables, pools, lean=fused.kernel_attention(pools),
                            static=static) if pools.has_kv else None)
        ctx = slot_context(pools, attn, slots if static else slots.tolist())
        h = self.model(input_ids.to(self.device), ctx, decode=True)
        if hidden_out is not None:
            hidden_out.append(h)
        return self.lm_head(h).float()


def _check_pools(cfg: Qwen35Config, pools: Pools) -> None:
    """Fail before any layer writes: pools must hold every attention and DeltaNet layer (KV
    layers past the model's own, an MTP head's, may follow)."""
    spec = pools.spec
    held_state = spec.state_layers
    n = len(cfg.attention_layers)
    if spec.attn_layers[:n] == cfg.attention_layers and tuple(held_state) == cfg.state_layers \
            and all(layer >= cfg.num_layers for layer in spec.attn_layers[n:]):
        return
    missing = sorted(set(cfg.attention_layers) - set(spec.attn_layers)
                     | set(cfg.state_layers) - set(held_state))
    raise ConfigError(
        f"pools hold attention layers {list(spec.attn_layers)} and DeltaNet layers "
        f"{list(held_state)} but the model (pattern {cfg.pattern!r}) also needs layers "
        f"{missing}: build them with PoolSpec.for_model(config, ...) over all layers"
    )
