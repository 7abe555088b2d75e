"""HybridCacheManager: KV blocks, recurrent state slots and the prefix tree behind one API.

Life of a request in the cache:
  0. (tiers) `restoring`: when a tier holds a deeper prefix than the pool, post its read and
     keep the request waiting (other requests step) until it is done; `admit` then puts it
     into the tree. `cancel_restore` drops a pending read (nothing of the pool is held).
  1. `admit`: match the prompt in the tree (never its last token), lock the matched path,
     share its full blocks, copy a partial page into a private block, copy the snapshot's
     state into a fresh live slot, and hand back the snapshot points still ahead.
     (`admit_remote`, decode side: share leading full blocks, allocate the rest, no state.)
  2. `ensure_blocks` before each chunk; the engine ends a chunk at every snapshot point.
  3. `commit` at a point: insert the request's blocks as a tree path, move its lock down,
     copy live -> snapshot slot (and the partial page when the point is unaligned).
  4. `finish`: the decode-end snapshot (prompt + answer), then release; `abort`: release.
  n samples (`admit(..., samples=n)` holds their n - 1 extra live slots from admission): once
  the prompt is computed (or landed), `fork` gives each sample its own live entry sharing the
  prompt's full blocks, with a private copy of the partial last block and of the state slot.

Slots: `max_live` are reserved for live states; snapshots use at most the rest, so a
snapshot can never starve a running request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

from baton.cache.canary import CANARY
from baton.cache.integrity import check_manager
from baton.cache.policy import snapshot_points
from baton.cache.sessions import SessionTurns
from baton.cache.stats import CacheStats
from baton.cache.store import SnapshotStore
from baton.cache.tiers.chain import Loaded, Tiers
from baton.cache.tiers.restore import materialize, spill
from baton.cache.tree import MatchResult, Node, Snapshot
from baton.cache.value import AlphaTuner, FlopModel, tree_victim
from baton.config.cache import CacheConfig
from baton.config.cache_tiers import EvictionConfig
from baton.errors import CapacityError, ConfigError, InvalidRequestError
from baton.model.pools import Pools

log = logging.getLogger("baton.cache")


class Admission(NamedTuple):
    cached_tokens: int
    """Prompt tokens whose KV and recurrent state are restored (0 if none)."""
    block_table: list[int]
    """Blocks covering the cached tokens (shared ones, then a private partial-page copy)."""
    slot: int
    """The request's live state slot (snapshot state copied in, or zeroed)."""
    snapshot_points: tuple[int, ...]
    """Points > cached_tokens where the engine must end a chunk (and commit)."""


@dataclass(eq=False)
class _Live:
    prompt: list[int]
    slot: int
    table: list[int]
    node: Node
    """Deepest tree node this request locks (its shared and inserted blocks lie above)."""
    points: list[int]
    """Snapshot points not yet reached, ascending."""
    turn: list[Snapshot] | None = None
    spare: int = 0
    """Live slots promised to the samples it forks (n - 1 until `fork`)."""
    stage: int | None = None
    """A snapshot-pool slot holding (prefill) or receiving (decode) its handed-off state in
    16 bits (`stage`), released with the request."""


class HybridCacheManager:
    def __init__(self, cfg: CacheConfig, pools: Pools, max_live: int, reserved_slots: int = 0,
                 pad_rows: bool = False, tiers: Tiers | None = None,
                 flops: FlopModel | None = None):
        """`reserved_slots`: the top slots of the pools that this manager never hands out
        (speculative decoding's per-position states, `slots_speculative` in stats).
        `pad_rows`: one more slot (just below those) and the top KV block are kept out too,
        for the pad rows of bucketed decode steps (`pad_slot`, `pad_block`).
        `tiers`: where evicted snapshots go and prefixes come back from (cache/tiers/);
        `flops`: the model's FLOP counts, for `cache.eviction.policy: value`."""
        spec = pools.spec
        if spec.tokens_per_block != cfg.tokens_per_block:
            raise ConfigError(
                f"pools have tokens_per_block={spec.tokens_per_block} but "
                f"cache.tokens_per_block={cfg.tokens_per_block}; build the pools from the config"
            )
        if max_live < 1:
            raise ConfigError(f"max_live={max_live} must be >= 1 (worker.max_num_seqs)")
        num_slots = spec.num_slots if pools.has_state else cfg.num_state_slots
        self.reserved_slots = reserved_slots if pools.has_state else 0
        num_slots -= self.reserved_slots
        self.pad_slot = self.pad_block = None
        """Where bucketed decode steps' pad rows write (never handed out), None when off."""
        if pad_rows and pools.has_state:
            num_slots -= 1
            self.pad_slot = num_slots
        if pad_rows and pools.has_kv:
            self.pad_block = spec.num_blocks - 1
        if num_slots < max_live:
            raise CapacityError(
                f"cache.num_state_slots={num_slots} cannot hold one live Mamba state per "
                f"concurrent request (worker.max_num_seqs={max_live}); raise num_state_slots "
                f"to at least {max_live} (plus room for snapshots) or lower max_num_seqs"
            )
        self.cfg, self.pools, self.max_live = cfg, pools, max_live
        self.tpb = cfg.tokens_per_block
        self._kv = pools.has_kv
        self.snapshot_budget = num_slots - max_live
        if pools.has_state and spec.snapshot_slots:  # their own (16-bit) slots
            self.snapshot_budget = spec.snapshot_slots
        self.store = SnapshotStore(pools, self.tpb, num_slots, self.snapshot_budget,
                                   spec.num_blocks - (self.pad_block is not None))
        self.blocks, self.slots, self.tree = self.store.blocks, self.store.slots, self.store.tree
        self._setup_tiers(tiers, flops)
        self.policy = cfg.mamba_state_config
        self._reuse = cfg.enable_prefix_reuse
        if self._reuse and self.snapshot_budget == 0:
            log.warning(
                "prefix reuse disabled: cache.num_state_slots=%d leaves no snapshot slot after "
                "%d live slots (worker.max_num_seqs); raise num_state_slots to reuse prefixes",
                num_slots, max_live,
            )
            self._reuse = False
        per_conv = self._reuse and self.policy.per_conversation
        self.sessions = SessionTurns(self.policy.max_num_turns) if per_conv else None
        self._live: dict[str, _Live] = {}
        self._quarantine: dict[str, tuple[list[int], int | None]] = {}
        """Failed remote reservations a late write may still reach: request id -> (blocks,
        slot) kept out of service until `release_quarantine` (see transfer/receiver.py)."""
        self.quarantined_total = 0
        self.canaries = False
        """Whether `arm_canaries` ran: free blocks and slots must hold CANARY (tests only)."""
        self._queried = self._hit = self._rqueried = self._rhit = self._tier_hit = 0
        self._restoring: dict[str, Future | None] = {}
        """Tier reads posted for waiting requests (None: looked, nothing deeper in a tier)."""
        self.restores_posted = 0

    def _setup_tiers(self, tiers: Tiers | None, flops: FlopModel | None) -> None:
        self.tiers, self.flops = tiers, flops
        self.layout = tiers.layout if tiers is not None else None
        if tiers is not None:
            self.tree.on_evict = lambda snap: spill(self, snap)
        if self.cfg.eviction.policy == "value":
            if flops is None:
                raise ConfigError("cache.eviction.policy=value needs the model's FLOP counts "
                                  "(pass flops=FlopModel.for_model(config))")
            self.tree.victim = lambda units: tree_victim(self, units)
        self.tuner = None
        """`cache.eviction.tune_alpha`: the online alpha tuner (value.py), else None."""
        if self.cfg.eviction.policy == "value" and self.cfg.eviction.tune_alpha:
            self.tuner = AlphaTuner(flops, self.tpb, self.snapshot_budget, self.cfg.eviction)

    def eviction_now(self) -> EvictionConfig:
        """The eviction config in force (alpha as tuned, when it is)."""
        return self.tuner.cfg if self.tuner is not None else self.cfg.eviction

    def saved_flops(self, n: int, p: int = 0) -> float:
        """Prefill FLOPs a snapshot after n tokens saves over one after p (0 without a model)."""
        return self.flops.saved(n, p) if self.flops is not None else 0.0

    # ---- queries -----------------------------------------------------------------------
    @property
    def reuse_enabled(self) -> bool:
        return self._reuse

    def cached_prefix(self, prompt: list[int]) -> int:
        """Prompt tokens `admit` would restore now: its deepest snapshot whose KV blocks are all
        present, in the pool or a tier (never the last token; 0 when reuse is off)."""
        if not self._reuse or len(prompt) < 2:
            return 0
        n = self.tree.match(prompt, len(prompt) - 1).cached_tokens
        return n if self.tiers is None else self.tiers.peek(prompt, n, len(prompt) - 1)

    def restoring(self, req_id: str, prompt: list[int], reuse: bool = True) -> bool:
        """Whether a waiting request must wait for a tier read before `admit`: on its first
        call, posts the read when a tier holds (or is writing) a deeper prefix than the pool;
        True until that read is done. The read goes to a staging buffer, not the pool: a
        request dropped meanwhile (`cancel_restore`) leaves nothing held."""
        if self.tiers is None or not (self._reuse and reuse) or len(prompt) < 2:
            return False
        if req_id not in self._restoring:
            lo = self.tree.match(prompt, len(prompt) - 1).cached_tokens
            fut = self._restoring[req_id] = self.tiers.start_load(prompt, lo, len(prompt) - 1)
            self.restores_posted += fut is not None
        fut = self._restoring[req_id]
        return fut is not None and not fut.done()

    def restore_pending(self, req_id: str) -> bool:
        """True while a read `restoring` posted for this request is in flight."""
        fut = self._restoring.get(req_id)
        return fut is not None and not fut.done()

    def cancel_restore(self, req_id: str) -> None:
        """Forget the request's tier read (its result, if it comes, is dropped)."""
        self._restoring.pop(req_id, None)

    @property
    def restores_waiting(self) -> int:
        """Requests with a tier read looked up or posted and not admitted yet."""
        return len(self._restoring)

    def snapshot_points(self, prompt_len: int) -> list[int]:
        """Where a prompt of this length is snapshotted ([] when reuse is off)."""
        return snapshot_points(self.policy, prompt_len) if self._reuse else []

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free queue (tree blocks are not counted: see `can_allocate`)."""
        return self.blocks.num_free if self._kv else 0

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus those evicting the tree's unlocked units would free: what
        `can_allocate` can hand out now (the `free_blocks` a worker reports)."""
        return self.blocks.num_free + self.tree.num_evictable_blocks if self._kv else 0

    @property
    def num_free_slots(self) -> int:
        """Slots not held by a running request (snapshot slots are always evictable)."""
        return self.slots.num_slots - len(self._live) - self._quarantined_slots() - self._spare()

    def _spare(self) -> int:
        return sum(live.spare for live in self._live.values())

    def _quarantined_slots(self) -> int:
        return sum(1 for _, slot in self._quarantine.values()
                   if slot is not None and slot < self.slots.num_slots)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether `num_blocks` blocks can be had now, counting evictable tree blocks."""
        if not self._kv:
            return True
        return num_blocks <= self.blocks.num_free + self.tree.num_evictable_blocks

    def block_table(self, req_id: str) -> list[int]:
        return list(self._get(req_id).table)

    def slot(self, req_id: str) -> int:
        return self._get(req_id).slot

    # ---- 16-bit handoffs (docs/state-precision.md) -------------------------------------
    def stage(self, req_id: str) -> int | None:
        """A snapshot-pool slot (16-bit) for the request's handed-off state, held until the
        request is released (or `land`ed): a prefill worker narrows its rounded prompt-end
        state into it and sends from there, a decode worker receives into it. Evicts LRU
        snapshots for it; None when the pools have no snapshot pool or every one of its
        slots is staging another handoff."""
        live = self._get(req_id)
        if live.stage is None and self.pools.spec.snapshot_slots:
            live.stage = self.store.stage_slot()
        return live.stage

    def staged(self, req_id: str) -> int | None:
        return self._get(req_id).stage

    def land(self, req_id: str) -> None:
        """Decode side: the state landed in the request's staging slot: widen it into its
        live slot and free the staging slot (nothing when it has none)."""
        live = self._get(req_id)
        if live.stage is not None:
            self.pools.copy_slot(live.stage, live.slot)
            self.slots.release(live.stage)
            live.stage = None

    # ---- admission ---------------------------------------------------------------------
    def admit(self, req_id: str, prompt: list[int], session: str | None = None,
              reuse: bool = True, samples: int = 1) -> Admission:
        """Start a request on this worker, restoring the deepest usable snapshot (none when
        `reuse` is False: a request that scores every prompt position computes them all);
        `samples` > 1 also holds the live slots its samples will `fork` into."""
        self._check_new(req_id, prompt, samples)
        none = MatchResult(self.tree.root, None, 0)
        m = self.tree.match(prompt, len(prompt) - 1) if self._reuse and reuse else none
        if self.tiers is not None and self._reuse and reuse:
            if req_id in self._restoring:  # `restoring` posted (or found no) read: its result
                fut = self._restoring.pop(req_id)
                m = self._put_back(prompt, m, fut.result() if fut is not None else None)
            else:
                m = self._from_tiers(prompt, m)
        live = self._register(req_id, prompt, m.node)
        live.spare = samples - 1
        try:
            self._restore(live, m.snapshot)
        except CapacityError:
            self._release(req_id)
            raise
        live.points = [p for p in self.snapshot_points(len(prompt)) if p > m.cached_tokens]
        if self._reuse and reuse and self.policy.branch_point_snapshot:
            live.points = self._with_branch_point(prompt, m.cached_tokens, live.points)
        self._start_turn(live, session)
        self._queried += len(prompt)
        self._hit += m.cached_tokens
        if self.tuner is not None and reuse:
            self.tuner.observe(prompt, self.snapshot_points(len(prompt)))
        return Admission(m.cached_tokens, list(live.table), live.slot, tuple(live.points))

    def admit_remote(self, req_id: str, prompt: list[int], session: str | None = None,
                     samples: int = 1) -> Admission:
        """Decode side: blocks for the whole prompt (leading full tree blocks shared) + a slot
        (+ the slots of the samples it will `fork`)."""
        adm = self._admit_blocks(req_id, prompt, session, samples)
        self._rqueried += len(prompt)
        self._rhit += adm.cached_tokens
        return adm

    def admit_pull(self, req_id: str, tokens: list[int]) -> Admission:
        """Like `admit_remote`, for another worker's snapshot of `tokens` to be pulled in and
        then `adopt`ed; not a prompt, so the prefix hit counters do not see it."""
        return self._admit_blocks(req_id, tokens, None)

    def _admit_blocks(self, req_id: str, prompt: list[int], session: str | None,
                      samples: int = 1) -> Admission:
        self._check_new(req_id, prompt, samples)
        node = self.tree.match_blocks(prompt, len(prompt)) if self._reuse else self.tree.root
        live = self._register(req_id, prompt, node)
        live.spare = samples - 1
        self.pools.zero_slot(live.slot)  # the prompt's state arrives by transfer
        cached = len(live.table) * self.tpb
        try:
            self.ensure_blocks(req_id, len(prompt))
        except CapacityError:
            self._release(req_id)
            raise
        self._start_turn(live, session)
        return Admission(cached, list(live.table), live.slot, ())

    def hold_snapshot(self, req_id: str, tokens: list[int]) -> Admission | None:
        """To ship a snapshot of exactly `tokens` to another worker: restore it into a fresh
        live slot, its blocks locked (shared full blocks, a private copy of a partial page),
        until `abort(req_id)`. None, holding nothing, when no such snapshot is held now."""
        self._check_new(req_id, tokens)
        if not self._reuse:
            return None
        m = self.tree.match(tokens, len(tokens))
        if m.cached_tokens != len(tokens):
            return None
        live = self._register(req_id, tokens, m.node)
        try:
            self._restore(live, m.snapshot)
        except CapacityError:
            self._release(req_id)
            raise
        return Admission(m.cached_tokens, list(live.table), live.slot, ())

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> Admission:
        """Another sample of the parent's prompt (n > 1), after its first `num_tokens`: the
        full blocks shared (one reference per sample, as prefix reuse shares them), the
        partial last block copied into a private one, the state slot copied into a new one.
        With reuse on, the full blocks become tree blocks the parent and every sample lock,
        so a sample that finishes first can never leave them unlocked yet held."""
        parent = self._get(parent_id)
        if parent.spare < 1:
            raise CapacityError(f"request {parent_id!r} holds no slot for another sample")
        parent.spare -= 1  # this sample's slot, held since admission
        self._check_new(child_id, parent.prompt)
        full = num_tokens // self.tpb if self._kv else 0
        if self._reuse and full:
            self._lock_path(parent, self.tree.insert(parent.prompt, parent.table[:full]))
        slot = self.slots.allocate()
        assert slot is not None, "snapshot budget invariant broken: no slot for a live request"
        self.tree.lock(parent.node)
        child = self._live[child_id] = _Live(list(parent.prompt), slot, parent.table[:full],
                                             parent.node, [])
        for b in child.table:
            self.blocks.incref(b)
        try:
            if self._kv and num_tokens % self.tpb:
                child.table.append(self.store.alloc_block())
                self.pools.copy_block(parent.table[full], child.table[-1])
        except CapacityError:
            self._release(child_id)
            raise
        self.pools.copy_slot(parent.slot, child.slot)
        return Admission(num_tokens, list(child.table), child.slot, ())

    def _lock_path(self, live: _Live, node: Node) -> None:
        """Move the request's lock down to `node` (never up)."""
        if node.depth > live.node.depth:
            self.tree.lock(node)
            self.tree.unlock(live.node)
            live.node = node

    def ensure_blocks(self, req_id: str, num_tokens: int) -> None:
        """Grow the request's block table to cover `num_tokens` tokens, evicting if needed."""
        live = self._get(req_id)
        if not self._kv:
            return
        need = -(-num_tokens // self.tpb) - len(live.table)
        if need <= 0:
            return
        if not self.can_allocate(need):
            raise CapacityError(
                f"request {req_id!r} needs {need} more KV blocks for {num_tokens} tokens but "
                f"only {self.blocks.num_free} are free and {self.tree.num_evictable_blocks} "
                f"evictable of cache.num_blocks={self.blocks.num_blocks}; raise num_blocks "
                "or run fewer requests at once"
            )
        for _ in range(need):
            live.table.append(self.store.alloc_block())

    # ---- snapshots ---------------------------------------------------------------------
    def commit(self, req_id: str, token_ids: list[int]) -> bool:
        """A chunk ended after `token_ids`; snapshot there if it is one of the request's points."""
        live = self._get(req_id)
        n = len(token_ids)
        hit = n in live.points
        live.points = [p for p in live.points if p > n]  # the state is past the others now
        if not hit:
            return False
        if list(token_ids) != live.prompt[:n]:
            raise ValueError(f"commit for {req_id!r}: token_ids are not the prompt's first {n}")
        return self._snapshot(live, token_ids)

    def finish(self, req_id: str, token_ids: list[int]) -> bool:
        """The request is done: commit its decode-end snapshot if configured, then release.
        True when that snapshot is held now."""
        live = self._get(req_id)
        try:
            if self._reuse and self.policy.decode_end_snapshot and token_ids:
                return self._snapshot(live, token_ids)
            return False
        finally:
            self._release(req_id)

    def adopt(self, req_id: str, token_ids: list[int]) -> bool:
        """A snapshot shipped in by transfer (`admit_remote` reserved it) has landed: commit
        it as this worker's own snapshot of `token_ids`, then release. True when held now.
        A state pulled in 16 bits into a staging slot is widened into the live one first."""
        live = self._get(req_id)
        try:
            self.land(req_id)
            return self._reuse and self._snapshot(live, token_ids)
        finally:
            self._release(req_id)

    def abort(self, req_id: str) -> None:
        """Release everything the request holds, committing nothing; KeyError if unknown."""
        self._get(req_id)
        self._release(req_id)

    def quarantine(self, req_id: str, blocks: list[int], keep_slot: bool,
                   key: str | None = None) -> None:
        """Release the request, committing nothing, but keep `blocks` (of its table) and, if
        `keep_slot`, its slot out of service until `release_quarantine(key)` (`key` defaults
        to the request id): a transfer into them failed and its bytes may still land.
        KeyError if the request is unknown, ValueError if `key` is held already."""
        live = self._get(req_id)
        key = req_id if key is None else key
        if key in self._quarantine:
            raise ValueError(f"quarantine {key!r} is already held")
        keep = set(blocks)
        held = [b for b in live.table if b in keep]
        for b in held:
            self.blocks.incref(b)  # the quarantine's own reference
        slot = (live.slot if live.stage is None else live.stage) if keep_slot else None
        self._quarantine[key] = (held, slot)
        self.quarantined_total += 1
        self._release(req_id, keep_slot=keep_slot)

    def release_quarantine(self, key: str) -> bool:
        """Return a quarantine's blocks and slot; False if none is held under `key`."""
        entry = self._quarantine.pop(key, None)
        if entry is None:
            return False
        blocks, slot = entry
        for b in blocks:
            self.blocks.decref(b)
        if slot is not None:
            self.slots.release(slot)
        return True

    def quarantined(self) -> dict[str, tuple[list[int], int | None]]:
        return dict(self._quarantine)

    # ---- test canaries (baton/cache/canary.py) -----------------------------------------
    def arm_canaries(self) -> None:
        """Write CANARY into every free block and slot now and into each one freed later."""
        pools = self.pools
        if self._kv:
            self.blocks.on_free = lambda b: pools.fill_block(b, CANARY)
            for b in self.blocks.free_ids():
                pools.fill_block(b, CANARY)
        if pools.has_state:
            self.slots.on_free = lambda s: pools.fill_slot(s, CANARY)
            for s in self.slots.free_ids():
                pools.fill_slot(s, CANARY)
        self.canaries = True

    def free_ids(self) -> tuple[list[int], list[int]]:
        """(free KV block ids, free state slot ids): what the canaries cover."""
        return (self.blocks.free_ids() if self._kv else []), self.slots.free_ids()

    # ---- reporting ---------------------------------------------------------------------
    def stats(self) -> CacheStats:
        t = self.tree
        return CacheStats(
            queried_tokens=self._queried,
            hit_tokens=self._hit,
            remote_queried_tokens=self._rqueried,
            remote_hit_tokens=self._rhit,
            snapshots_taken=self.store.taken,
            snapshots_evicted=t.snapshots_evicted,
            snapshots_retired=self.sessions.retired if self.sessions else 0,
            blocks_evicted=t.blocks_evicted,
            blocks_total=self.blocks.num_blocks if self._kv else 0,
            blocks_free=self.num_free_blocks,
            blocks_cached=(t.num_nodes + t.num_partials) if self._kv else 0,
            blocks_evictable=t.num_evictable_blocks,
            slots_total=len(self.slots.ids()),
            slots_live=len(self._live),
            slots_snapshot=t.num_snapshots,
            snapshot_budget=self.snapshot_budget,
            tree_nodes=t.num_nodes,
            partial_snapshots=t.num_partials,
            blocks_quarantined=sum(len(b) for b, _ in self._quarantine.values()),
            slots_quarantined=self._quarantined_slots(),
            quarantined_total=self.quarantined_total,
            slots_speculative=self.reserved_slots,
            state_bytes=self.pools.spec.state_bytes() if self.pools.has_state else 0,
            state_bytes_per_snapshot=(self.pools.spec.snapshot_bytes_per_slot()
                                      if self.pools.has_state else 0),
            tier_hit_tokens=self._tier_hit,
            tiers=self.tiers.counters() if self.tiers is not None else {},
        )

    def set_snapshot_listener(self, fn: Callable[[bool, list[int], int], None] | None) -> None:
        """`fn(added, tokens, num_tokens)` on every snapshot added or dropped (router events)."""
        if fn is None:
            self.tree.listener = None
        else:
            self.tree.listener = lambda added, snap: fn(
                added, self.tree.snapshot_tokens(snap), snap.num_tokens
            )

    def check_integrity(self) -> None:
        """AssertionError naming the first block, slot or count that is owned wrongly."""
        check_manager(self)

    def live_requests(self) -> dict[str, _Live]:
        return dict(self._live)

    def live_room(self) -> int:
        """Requests (or snapshot holds) that can still be admitted before `max_live`."""
        return self.max_live - len(self._live) - self._quarantined_slots() - self._spare()

    # ---- internals ---------------------------------------------------------------------
    def _get(self, req_id: str) -> _Live:
        try:
            return self._live[req_id]
        except KeyError:
            msg = f"request {req_id!r} holds no cache (unknown or already released)"
            raise KeyError(msg) from None

    def _check_new(self, req_id: str, prompt: list[int], samples: int = 1) -> None:
        if req_id in self._live:
            raise InvalidRequestError(f"request id {req_id!r} is already admitted")
        if not prompt:
            raise InvalidRequestError(f"request {req_id!r} has an empty prompt")
        if len(self._live) + self._quarantined_slots() + self._spare() + samples > self.max_live:
            raise CapacityError(
                f"all {self.max_live} live slots are in use (worker.max_num_seqs; "
                f"{self._quarantined_slots()} quarantined after failed transfers); "
                "wait for a request to finish"
            )

    def _register(self, req_id: str, prompt: list[int], node: Node) -> _Live:
        slot = self.slots.allocate()
        assert slot is not None, "snapshot budget invariant broken: no slot for a live request"
        self.tree.lock(node)
        table = self.tree.path_blocks(node)
        for b in table:
            self.blocks.incref(b)
        live = self._live[req_id] = _Live(list(prompt), slot, table, node, [])
        return live

    def _from_tiers(self, prompt: list[int], m: MatchResult) -> MatchResult:
        """A deeper prefix than the pool's from a tier, put back into the tree first."""
        return self._put_back(prompt, m, self.tiers.load(prompt, m.cached_tokens,
                                                         len(prompt) - 1))

    def _put_back(self, prompt: list[int], m: MatchResult, got: Loaded | None) -> MatchResult:
        if got is None or got.header.n <= m.cached_tokens:
            return m  # a miss, or the pool got as deep meanwhile
        if materialize(self, prompt, got):
            got.tier.stats.hits += 1
            got.tier.stats.hit_tokens += got.header.n
            self._tier_hit += got.header.n
        # match again either way: making room may have evicted the pool's own match
        return self.tree.match(prompt, len(prompt) - 1)

    def _with_branch_point(self, prompt: list[int], cached: int, points: list[int]) -> list[int]:
        """`points` plus the branch point: where the prompt's blocks leave the tree's KV, when
        that lies past the restored snapshot and before the prompt's end."""
        if self.policy.per_conversation:
            return points
        b = self.tree.match_blocks(prompt, len(prompt) - 1).depth * self.tpb
        return sorted({*points, b}) if cached < b < len(prompt) else points

    def _restore(self, live: _Live, snap: Snapshot | None) -> None:
        page = self.store.restore(snap, live.slot)
        if page is not None:
            live.table.append(page)

    def _start_turn(self, live: _Live, session: str | None) -> None:
        if self.sessions is not None and session is not None:
            live.turn = self.sessions.start_turn(session, self.tree)

    def _release(self, req_id: str, keep_slot: bool = False) -> None:
        live = self._live.pop(req_id)
        self.tree.unlock(live.node)
        for b in live.table:
            self.blocks.decref(b)
        kept = (live.slot if live.stage is None else live.stage) if keep_slot else None
        for slot in (live.slot, live.stage):
            if slot is not None and slot != kept:
                self.slots.release(slot)

    def _snapshot(self, live: _Live, tokens: list[int]) -> bool:
        n, tpb = len(tokens), self.tpb
        if self._kv and len(live.table) * tpb < n:
            raise ValueError(
                f"snapshot after {n} tokens but the request's blocks cover only "
                f"{len(live.table) * tpb}; call ensure_blocks first"
            )
        full = n // tpb
        node = self.tree.insert(tokens, live.table[:full] if self._kv else [None] * full)
        self._lock_path(live, node)
        tail = tuple(tokens[full * tpb : n])
        tail_block = live.table[full] if tail and self._kv else None
        snap = self.store.take(node, tail, live.slot, tail_block)
        if snap is not None and live.turn is not None and snap not in live.turn:
            live.turn.append(snap)
        return snap is not None
