"""What the engine may call on a model, written down: `CausalLM` (a whole model, or the
stand-in of a pipeline / tensor-parallel worker), `Stage` (one pipeline stage) and `Layer`,
with the capabilities the engine branches on declared as data (`Capabilities`), never probed.

    plain model      a family's `model` (a HybridLM)                          LOCAL
    PP / TP / TPxPP  PipelineModel, TPModel, TPPipelineModel (baton.engine)  STAGED
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from baton.model.paged import StepContext


@dataclass(frozen=True)
class Capabilities:
    decode_takes_tables: bool = False
    """`decode` takes the block tables as one [B, nb] tensor (baton.engine.decode_batch) and
    the bucketed step's `static` tensors; False: lists (sent over the wire)."""
    decode_hidden: bool = False
    """`decode(hidden_out=)` gives the final-normed hiddens: a speculating engine's steps
    without drafts decode plainly (baton/engine/speculative/decoder.py)."""
    scores_every_position: bool = True
    """`prefill_batch(all_logits=True)` works (prompt logprobs)."""
    staged: bool = False
    """The forward runs across processes: speculation calls the model's own `verify` and
    `drafter` (baton/engine/pipeline/speculative.py)."""


LOCAL = Capabilities(decode_takes_tables=True, decode_hidden=True)
"""A family's whole model in this process."""
STAGED = Capabilities(scores_every_position=False, staged=True)
"""Pipeline and tensor-parallel stand-ins: only the last stage holds the head, and it
returns last-position logits."""


class CausalLM(Protocol):
    config: object
    capabilities: Capabilities
    mtp: torch.nn.Module | None
    """The MTP head (a whole model's when loaded; a pipeline's on the meta device)."""
    tp_place: tuple[int, int] | None
    """(TP rank, TP size) of this process when it holds a tensor-parallel part (TP x PP:
    its rank within its stage); None: decided by its channel, or no tensor parallelism."""
    full_config: object | None
    """A tensor-parallel rank's shard: the whole model's config (`config` is the shard's)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def prefill_batch(self, input_ids, start_positions, block_tables, slots, pools=None,
                      all_logits: bool = False, on_layer=None,
                      hidden_out: list | None = None) -> torch.Tensor: ...

    def decode(self, input_ids, positions, block_tables, slots, pools=None) -> torch.Tensor: ...


class StagedLM(CausalLM, Protocol):
    """What a model whose forward runs across processes (`capabilities.staged`) answers
    besides: PipelineModel, TPModel, TPPipelineModel. The worker reads these where
    `capabilities.staged` says they exist, never by probing."""

    stage: Stage
    """This process's own part (stage 0, or TP rank 0's shard)."""
    layers: list[range]
    """Every pipeline stage's global layers."""
    size: int
    """Processes of the pipeline (or TP ranks)."""
    agents: int
    """Processes with a transfer agent (every rank of a TP x PP pipeline)."""
    rank_layout: str | None
    """What every rank process holds, for the start-up line (tensor parallelism)."""

    def call(self, name: str, args_of, reply: bool = True) -> list[dict]:
        """Run handler `name` on the other processes; their replies."""

    def ops_digests(self) -> list[str]:
        """Every process's digest of the cache operations it applied; [] when the others
        mirror no cache operation of their own (a pipeline's stages)."""

    def close(self) -> None: ...


Mix = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
"""(mixer, normed input) -> the mixer's output: a verify pass's stand-in for a stateful
mixer's own call (baton/engine/speculative/verify.py)."""


class VerifyPosition(NamedTuple):
    """One position of a speculative verify pass's recurrent steps (a chain's position j,
    a tree's depth; baton/engine/speculative/verify.py and tree.py)."""

    ctx: StepContext
    """The slots of the requests still running at this position."""
    rows: torch.Tensor
    """Rows of the pass at this position (one per request still running)."""
    save_to: torch.Tensor | None
    """Scratch rows for the requests with a later position (their state is saved)."""
    save_slots: torch.Tensor | None
    copy_from: torch.Tensor | None = None
    """Tree levels: the parents' slots, copied into `ctx.slots` before the step."""


class RecurrentMixer(nn.Module):
    """A recurrent layer kind (Mamba2, gated DeltaNet, ...), behind one interface: its state
    tensors by name, the prefill scan, the decode step, the fast path's kernel step and the
    per-position verify of speculation. The engine recognises a recurrent layer by this
    base class and what it declares, never by probing its methods."""

    layer_idx: int
    state_names: tuple[str, ...]
    """The names of its state tensors in the pools (`ctx.state(layer_idx, name)`), in the
    order the kind reads them; the model's `state_tensors` declares each name once, so two
    kinds with different names (say `conv`/`ssm` and `gdn_conv`/`recurrent`) mix in one
    model."""
    has_kernel_step: ClassVar[bool] = False
    """True: `kernel_inputs(h)` (the row-wise input projections) and `kernel_step(inputs,
    ctx, src, dst)` (one step reading slots src, writing slots dst) run the fast path's step
    kernel, and `out_proj` the output projection (baton/engine/speculative/kernel_verify.py)."""

    def prefill(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h [n, T, hidden]: a chunked scan from each sequence's slot (zeros when fresh)."""
        raise NotImplementedError

    def decode(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h [b, hidden]: one step of each sequence, in its slot."""
        raise NotImplementedError

    def kernel_inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def kernel_step(self, inputs: tuple[torch.Tensor, ...], ctx: StepContext,
                    src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def save_state(self, ctx: StepContext, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots `dst` <- slots `src`, every state tensor of this layer."""
        for name in self.state_names:
            t = ctx.state(self.layer_idx, name)
            t.index_copy_(0, dst, t.index_select(0, src))

    def verify_positions(self, x: torch.Tensor, positions: list[VerifyPosition],
                         counts: list[int], tree: bool) -> torch.Tensor:
        """The layer over a verify pass's rows x [R, H] (request-major; `counts` rows per
        request), position after position, the state after each saved where `positions`
        say. Here: `decode` once per position; a kind may do the row-wise parts at once."""
        out = torch.empty_like(x)
        for p in positions:
            if p.copy_from is not None:
                self.save_state(p.ctx, p.copy_from, p.ctx.slots)
            out.index_copy_(0, p.rows, self.decode(x.index_select(0, p.rows), p.ctx))
            if p.save_to is not None:
                self.save_state(p.ctx, p.save_slots, p.save_to)
        return out


class Layer(Protocol):
    def forward(self, h: torch.Tensor, ctx, decode: bool) -> torch.Tensor: ...

    def run_mixed(self, h: torch.Tensor, mix: Mix) -> torch.Tensor:
        """The layer's decode forward on rows h [R, H] with its stateful mixer (attention
        or recurrent) called through `mix`; stateless parts (norms, MLP, MoE) run as in
        decode."""


class Stage(Protocol):
    """A whole model or one pipeline stage of it (a family's `stage`), as the pipeline,
    tensor-parallel and verify code see it."""

    config: object
    layer_ids: range
    first: bool
    last: bool
    mtp: torch.nn.Module | None
    before_forward: Callable | None
    """A hook run on each micro-batch before the stage's layers (TP x PP leaders)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def embedding(self) -> torch.nn.Embedding:
        """The token embeddings (first stage, or a last stage that holds the MTP head)."""

    def set_embedding(self, table: torch.nn.Embedding) -> None: ...

    def blocks(self) -> Iterable[Layer]:
        """This stage's layers, in order."""

    def final_norm(self, h: torch.Tensor) -> torch.Tensor: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def run_layers(self, h: torch.Tensor, ctx, decode: bool) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...
