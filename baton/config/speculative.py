"""`speculative`: MTP speculative decoding (drafts from the checkpoint's MTP head, verified by
the target in one forward; see baton/engine/speculative/)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from baton.errors import ConfigError

MAX_DRAFT_TOKENS = 8
MAX_TREE_TOKENS = 64
MAX_TOP_K = 8


@dataclass(frozen=True)
class TreeConfig:
    """Tree drafts (baton/engine/speculative/tree.py), for greedy requests: the MTP head
    proposes the top-k tokens of every node at each depth; the target verifies all nodes in
    one forward and keeps the path its argmax follows. Requests sampled at temperature > 0
    draft a chain instead (the rejection rule is for chains). One state slot per node and
    request is kept for the verify pass (`cache.num_state_slots` must hold them)."""

    top_k: tuple[int, ...] = ()
    """Children per expanded node at depth 1, 2, ...: its length is the tree's depth and
    must equal `num_draft_tokens`, each 1..8 (e.g. [3, 2, 1])."""
    max_total_draft_tokens: int = 0
    """Most nodes per request per step (1..64); 0: every node top_k allows."""

    @property
    def depth(self) -> int:
        return len(self.top_k)

    @property
    def max_nodes(self) -> int:
        """Nodes per request per step: the budget, or what top_k allows."""
        full, width = 0, 1
        for k in self.top_k:
            width *= k
            full += width
        return min(full, self.max_total_draft_tokens) if self.max_total_draft_tokens else full

    def check(self, num_draft_tokens: int) -> None:
        bad = [k for k in self.top_k if isinstance(k, bool) or not 1 <= k <= MAX_TOP_K]
        if bad:
            raise ConfigError(f"speculative.tree.top_k entries must be in 1..{MAX_TOP_K}, got "
                              f"{list(self.top_k)}")
        if self.depth != num_draft_tokens:
            raise ConfigError(
                f"speculative.tree.top_k has {self.depth} depths but speculative."
                f"num_draft_tokens={num_draft_tokens}: they must be equal (the tree's depth)")
        n = self.max_total_draft_tokens
        if not 0 <= n <= MAX_TREE_TOKENS:
            raise ConfigError(f"speculative.tree.max_total_draft_tokens must be in "
                              f"0..{MAX_TREE_TOKENS} (0 = what top_k allows), got {n}")
        if self.max_nodes > MAX_TREE_TOKENS:
            raise ConfigError(
                f"speculative.tree.top_k {list(self.top_k)} allows {self.max_nodes} nodes, "
                f"more than {MAX_TREE_TOKENS}; set max_total_draft_tokens to at most "
                f"{MAX_TREE_TOKENS}")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_draft_tokens: int = 0
    """Draft tokens per decode step (`--speculative-tokens`): 0 = off (the default), 1..8.
    Needs a checkpoint with an MTP head (`num_nextn_predict_layers` > 0 and `mtp.*`
    tensors). Each step drafts K tokens with the MTP head applied K times, the target
    verifies K+1 positions in one forward and greedy acceptance emits the accepted drafts
    plus one target token: greedy output is identical to speculation off. Temperature > 0:
    the target's token at each position is its own (seed, position) draw, as a plain step
    draws it, and a draft is kept exactly when it equals that token (the exact rejection
    rule for one-hot drafts), so a seeded request's tokens are those of speculation off, at
    any batch. A prefill-only handoff does not draft."""
    tree: TreeConfig | None = None
    """Tree drafts instead of a chain (greedy requests; see TreeConfig)."""
    max_batch: int = 2
    """Draft only while at most this many requests decode in one step; a larger batch is
    compute-bound and decodes without drafts (same tokens). 0: always draft. The default is
    measured on the 2-core dev CPU (bench 100m, fast path, CPU time): a K=3 step (drafts and
    the verify of 4 rows a request) costs 1.7x a plain step at 1-2 requests, 2.9x at 4,
    3.9x at 8 and 4.6x at 32, so past 2 requests it loses at any realistic acceptance."""
    method: Literal["mtp"] = "mtp"
    """Where drafts come from: the checkpoint's multi-token-prediction head (the only one)."""

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS:
            raise ConfigError(
                f"speculative.num_draft_tokens must be an integer in 0..{MAX_DRAFT_TOKENS} "
                f"(0 = off), got {k!r}"
            )
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) \
                or self.max_batch < 0:
            raise ConfigError(f"speculative.max_batch must be an integer >= 0 (0 = always "
                              f"draft), got {self.max_batch!r}")
        if self.tree is not None:
            if not k:
                raise ConfigError("speculative.tree needs speculative.num_draft_tokens > 0 "
                                  "(the tree's depth); got 0")
            self.tree.check(k)

    def with_draft_tokens(self, k: int) -> SpeculativeConfig:
        """This section with `num_draft_tokens` = k (`--speculative-tokens`), every other key
        as configured (`max_batch`, a tree, whose depth must then be k); k = 0 drops the
        tree (speculation off)."""
        return replace(self, num_draft_tokens=k, tree=self.tree if k else None)

    @property
    def rows_per_request(self) -> int:
        """Draft rows of one request's verify pass: K, or the tree's nodes."""
        return self.tree.max_nodes if self.tree is not None else self.num_draft_tokens
