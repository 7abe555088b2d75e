"""Stage 0's stand-in for a family's model (`baton.model.protocol.CausalLM`): the engine calls `prefill_batch` / `decode` as
always; the call is split into micro-batches that flow through every stage.

    stage 0   [mb0][mb1][mb2][mb3]                 (embeddings + its layers, then sends)
    stage 1        [mb0][mb1][mb2][mb3]
    stage 2             [mb0][mb1][mb2][mb3] -> logits of each micro-batch back to stage 0

The plan of every micro-batch goes to every stage first (non-blocking), so stage k works on
micro-batch i+1 while stage k+1 works on micro-batch i. Cache operations recorded by the
mirrored pools ride ahead of the first micro-batch.

A prefill forward with fewer sequences than micro-batches also splits its tokens: sequences
[0, n) x tokens [0, T) become micro-batches (sequence group, token range), the token ranges
in order, at multiples of the Mamba scan chunk. Every stage runs a sequence's token ranges in
order, as chunked prefill does (the scan is exact for any split), and only the last range of
each group sends logits back. With m micro-batches and N stages each stage is busy for about
m / (m + N - 1) of a forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from baton.engine.pipeline.channel import TAG_CTRL, TAG_HIDDEN, TAG_OUT, TAG_REPLY, Channel
from baton.engine.pipeline.mirror import MirroredPools
from baton.engine.pipeline.stage import run_layers
from baton.model.protocol import STAGED, Stage

MIN_TOKENS = 128
"""The fewest tokens per sequence a token-split prefill micro-batch gets: smaller ones cost
more in per-forward overhead than the overlap gains."""


def split(n: int, parts: int) -> list[range]:
    """[0, n) in `parts` contiguous, nearly equal ranges (no empty one)."""
    parts = max(1, min(n, parts))
    q, r = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = q + (1 if i < r else 0)
        out.append(range(start, start + size))
        start += size
    return out


def token_split(T: int, parts: int, align: int, least: int = MIN_TOKENS) -> list[range]:
    """[0, T) in at most `parts` contiguous ranges of at least `least` tokens, every inner
    boundary a multiple of `align` (the scan's chunk, so no range pads a chunk it shares)."""
    align = max(1, align)
    unit = align * max(1, -(-least // align))
    most = max(1, T // unit)
    parts = max(1, min(parts, most))
    if parts == 1:
        return [range(0, T)]
    chunks = -(-T // align)
    # equal ranges when a count a little above the asked one divides the chunks evenly
    parts = next((p for p in range(parts, min(2 * parts, most) + 1) if chunks % p == 0), parts)
    bounds = [0] + [min(T, round(chunks * i / parts) * align) for i in range(1, parts)] + [T]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


class PipelineModel:
    def __init__(self, stage: Stage, pools: MirroredPools, channel: Channel,
                 layers: list[range], micro_batches: int | None = None, local_stages=None,
                 on_link_lost: Callable[[BaseException], None] | None = None):
        self.stage, self.pools, self.ch = stage, pools, channel
        self.config = stage.config
        self.layers = layers
        """Global layer range of every stage."""
        self.size = channel.size
        self.agents = channel.size
        """Processes with a transfer agent (`protocol.StagedLM`)."""
        self.micro_batches = micro_batches or 2 * self.size
        """Most micro-batches of a decode forward. A prefill forward may use up to twice this:
        one per sequence, or token ranges of each sequence when it has fewer sequences (its
        sequences are long enough to keep each micro-batch efficient)."""
        self.busy_s = 0.0
        self.min_tokens = MIN_TOKENS
        self.token_split_forwards = 0
        """Prefill forwards whose sequences were also split by tokens."""
        self.closed = False
        self.local_stages = local_stages
        """The child processes of stages 1..N-1 (None: started by another launcher)."""
        self.on_link_lost = on_link_lost
        """Called when a message to or from another stage fails: the pipeline is broken for
        good, so the worker must leave (the router then moves its requests) rather than end
        them one by one as failed, which a client would see as finished."""

    @property
    def device(self) -> torch.device:
        return self.stage.device

    @property
    def dtype(self) -> torch.dtype:
        return self.stage.dtype

    # ---- the CausalLM contract the engine uses --------------------------------------
    capabilities = STAGED
    """Only the last stage holds the head and it returns last-position logits: requests that
    ask for prompt logprobs are refused up front (Engine.validate)."""

    mtp = None
    """The MTP head (on the meta device: its layers' ids; the weights are the last stage's)
    when the worker speculates (pipeline/speculative.py)."""
    tp_place: tuple[int, int] | None = None
    full_config = None
    rank_layout: str | None = None
    """Tensor parallelism: what every rank process holds (the builder sets it)."""

    def ops_digests(self) -> list[str]:
        """Stages apply their own cache operations (no digest to compare): []."""
        return []

    def prefill_batch(self, input_ids, start_positions, block_tables, slots, pools=None,
                      all_logits: bool = False, on_layer=None, hidden_out: list | None = None,
                      mtp_next: list | None = None) -> torch.Tensor:
        """`mtp_next`: per sequence the tokens after its chunk's positions (None: no head
        pass); the last stage writes the MTP head's KV and `hidden_out` gets the last
        position's final-normed hidden [n, 1, H]."""
        if all_logits:
            raise NotImplementedError("all_logits is not available with pipeline parallelism")
        n, T = input_ids.shape
        extra = None if mtp_next is None else {"mtp_next": mtp_next}
        out, hidden = self._run(False, input_ids, list(start_positions), block_tables,
                                list(slots), T, 2 * self.micro_batches, extra)
        if hidden_out is not None and hidden is not None:
            hidden_out.append(hidden[:, None])
        return out

    def decode(self, input_ids, positions, block_tables, slots, pools=None) -> torch.Tensor:
        return self._run(True, input_ids, positions.tolist(), block_tables, slots.tolist(), 1,
                         self.micro_batches)[0]

    def verify(self, rows, scratch, tree: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`verify_forward` through every stage: (final-normed hidden [R, H], logits)."""
        from baton.engine.speculative.verify import VerifyPlan

        plan = VerifyPlan.of(rows, scratch, tree)
        ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.long)
        extra = {"verify": {"counts": plan.counts, "scratch": plan.scratch,
                            "parents": plan.parents}}
        logits, hidden = self._run(True, ids, plan.starts, plan.tables, plan.slots, 1,
                                   self.micro_batches, extra)
        return hidden, logits

    def drafter(self):
        from baton.engine.pipeline.speculative import PipelineDrafter

        return PipelineDrafter(self)

    # ---- control --------------------------------------------------------------------------
    def sync(self) -> None:
        """Every stage has applied every cache operation so far (a barrier)."""
        with self._link():
            self._broadcast({"op": "sync"})
            for k in range(1, self.size):
                self.ch.recv_msg(k, TAG_REPLY)

    def call(self, name: str, args_of, reply: bool = True) -> list[dict]:
        """Run a role handler on stages 1..N-1 (`args_of(k)`: that stage's arguments, None to
        skip it); returns the replies of the stages called, in stage order."""
        ops = self.pools.take_ops()
        called = []
        with self._link():
            for k in range(1, self.size):
                args = args_of(k)
                msg = {"op": "ops", "ops": ops} if args is None else \
                    {"op": "call", "name": name, "args": args, "reply": reply, "ops": ops}
                self.ch.send_msg(msg, k, TAG_CTRL)
                if args is not None:
                    called.append(k)
            return [self.ch.recv_msg(k, TAG_REPLY) for k in called] if reply else []

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._broadcast({"op": "stop"})
            self.ch.flush()
        finally:
            if self.local_stages is not None:
                self.local_stages.stop()
            dist.destroy_process_group()

    # ---- internals --------------------------------------------------------------------------
    @contextmanager
    def _link(self) -> Iterator[None]:
        """Around messages between stages: a failure there is the pipeline's, not a request's."""
        try:
            yield
        except Exception as e:
            if self.on_link_lost is not None and not self.closed:
                self.on_link_lost(e)
            raise

    def _broadcast(self, msg: dict) -> None:
        msg["ops"] = self.pools.take_ops()
        for k in range(1, self.size):
            self.ch.send_msg(msg, k, TAG_CTRL)

    def _run(self, decode, ids, starts, tables, slots, T, parts, extra=None):
        """(logits, the last stage's hidden states or None); `extra`: speculation's fields
        of the micro-batches (pipeline/speculative.py)."""
        with self._link():
            out, hidden, error = self._exchange(decode, ids, starts, tables, slots, T, parts,
                                                extra or {})
        if error is not None:
            raise error
        if torch.isnan(out).any():
            raise RuntimeError("a pipeline stage's forward failed (see that stage's log)")
        return out, hidden

    def plan(self, n: int, T: int, parts: int, decode: bool) -> list[tuple[range, range]]:
        """The micro-batches of a forward: (sequences, tokens), each sequence's token ranges
        in order."""
        groups = split(n, parts)
        if decode or len(groups) >= parts:
            return [(r, range(0, T)) for r in groups]
        tokens = token_split(T, -(-parts // len(groups)), self.config.chunk_size,
                             self.min_tokens)
        self.token_split_forwards += len(tokens) > 1
        return [(r, t) for t in tokens for r in groups]

    def _exchange(self, decode, ids, starts, tables, slots, T, parts, extra):
        """Every micro-batch through every stage: (logits, hidden states the last stage sent
        back or None, this stage's forward error)."""
        from baton.engine.pipeline.speculative import run_verify
        from baton.engine.pipeline.stage import hidden_shape, out_rows, wants_hidden

        counts = extra["verify"]["counts"] if "verify" in extra else None
        row0 = [0] if counts is None else [sum(counts[:i]) for i in range(len(counts) + 1)]
        nexts = extra.get("mtp_next")
        mbs = []
        plan = self.plan(len(starts), T, parts, decode)
        for i, (r, t) in enumerate(plan):
            mb = {"op": "fwd", "decode": decode, "T": len(t),
                  "starts": [p + t.start for p in starts[r.start:r.stop]],
                  "tables": [list(b) for b in tables[r.start:r.stop]],
                  "slots": slots[r.start:r.stop], "out": t.stop == T}
            if counts is not None:
                v = extra["verify"]
                mb["verify"] = {"counts": counts[r.start:r.stop],
                                "scratch": v["scratch"][r.start:r.stop],
                                "parents": None if v["parents"] is None
                                else v["parents"][r.start:r.stop]}
            if nexts is not None:
                mb["mtp_next"] = [None if n is None else n[t.start:t.stop]
                                  for n in nexts[r.start:r.stop]]
            if i == 0:
                self._broadcast(mb)
            else:
                mb["ops"] = []
                for k in range(1, self.size):
                    self.ch.send_msg(mb, k, TAG_CTRL)
            mbs.append((r, t, mb))
        error = None
        local = self.pools.local
        for r, t, mb in mbs:
            t0 = time.perf_counter()
            try:
                if counts is not None:
                    part = ids[row0[r.start]:row0[r.stop]]
                    h = run_verify(self.stage, local, mb, part)
                else:
                    part = ids[r.start:r.stop] if decode else ids[r.start:r.stop, t.start:t.stop]
                    h = run_layers(self.stage, local, mb, part)
            except Exception as e:  # noqa: BLE001 - the later stages still expect an input
                error = error or e
                h = torch.full(hidden_shape(self.stage, mb), float("nan"), dtype=self.dtype)
            self.busy_s += time.perf_counter() - t0
            self.ch.isend(h, 1, TAG_HIDDEN)
        vocab, hs, last = self.config.vocab_size, self.config.hidden_size, self.size - 1
        outs, hiddens = [], []
        for _, _, mb in mbs:
            if not mb["out"]:
                continue
            n = out_rows(mb)
            outs.append(self.ch.recv((n, vocab), torch.float32, last, TAG_OUT))
            if wants_hidden(mb):
                hiddens.append(self.ch.recv((n, hs), self.dtype, last, TAG_OUT))
        self.ch.flush()
        return torch.cat(outs), torch.cat(hiddens) if hiddens else None, error
