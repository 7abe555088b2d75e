"""What the engine may call on a model, written down: `CausalLM` (a whole model, or the
stand-in of a pipeline / tensor-parallel worker), `Stage` (one pipeline stage) and `Layer`,
with the capabilities the engine branches on declared as data (`Capabilities`), never probed.

    plain model      a family's `model` (a HybridLM)                          LOCAL
    PP / TP / TPxPP  PipelineModel, TPModel, TPPipelineModel (baton.engine)  STAGED
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch


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

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def prefill_batch(self, input_ids, start_positions, block_tables, slots, pools=None,
                      all_logits: bool = False, on_layer=None,
                      hidden_out: list | None = None) -> torch.Tensor: ...

    def decode(self, input_ids, positions, block_tables, slots, pools=None) -> torch.Tensor: ...


Mix = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
"""(mixer, normed input) -> the mixer's output: a verify pass's stand-in for a stateful
mixer's own call (baton/engine/speculative/verify.py)."""


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
