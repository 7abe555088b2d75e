"""What one pipeline stage computes for a micro-batch, and the loop of stages 1..N-1.

A micro-batch's plan (msgpack, from stage 0):
    {"op": "fwd", "decode": bool, "T": tokens per sequence (prefill), "starts": [position],
     "tables": [[block]], "slots": [slot], "out": whether the last stage returns logits
     (False for a token range before a sequence's last), "ops": [mirrored cache operations]}
With MTP speculation (pipeline/speculative.py) a decode micro-batch may be a verify pass,
"verify": {"counts": rows per request, "scratch": [[slot per position but the last]]}, and
a prefill one may carry "mtp_next": per sequence the tokens after its positions (or None);
the last stage then sends the final-normed hidden states (every verify row, the last
prefill position) to stage 0 after the logits.
A stage other than 0 receives its input hidden states from the stage before it and sends
its output to the stage after it; the last stage sends float32 logits (last token of each
sequence) to stage 0. Other control ops: "sync" (apply ops, reply), "call" (a role's
handler, e.g. a transfer agent's; replies when asked; built in: "stats" (busy seconds),
"canaries" (which of the given free blocks/slots lost their canary) and "expert_load" (tokens
routed to each expert of the stage's MoE layers)), "stop".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from baton.cache.canary import bad_blocks, bad_slots
from baton.engine.pipeline.channel import TAG_CTRL, TAG_HIDDEN, TAG_OUT, TAG_REPLY, Channel
from baton.engine.pipeline.mirror import apply_ops
from baton.model.layers.linear import decode_scope
from baton.model.layers.moe import routed_tokens
from baton.model.paged import decode_meta, prefill_meta, slot_context
from baton.model.pools import Pools
from baton.model.protocol import Stage

log = logging.getLogger("baton.pipeline")

Handler = Callable[[dict], dict | None]
"""A role's extra control op: gets the message, returns the reply (or None)."""


@torch.inference_mode()
def run_layers(model: Stage, pools: Pools, mb: dict, h: torch.Tensor) -> torch.Tensor:
    """This stage's layers over micro-batch `mb` (input hidden states, or token ids on the
    first stage)."""
    decode, starts, tables, slots = mb["decode"], mb["starts"], mb["tables"], mb["slots"]
    before = model.before_forward
    if before is not None:  # TP x PP: the stage's other TP ranks get the micro-batch first
        before(mb, h)
    h = model.embed(h) if model.first else h.to(model.device)
    if decode:
        attn = decode_meta(torch.tensor(starts), tables, pools) if pools.has_kv else None
        ctx = slot_context(pools, attn, slots)
    else:
        attn = prefill_meta(starts, mb["T"], tables, pools) if pools.has_kv else None
        ctx = slot_context(pools, attn, slots, fresh=[p == 0 for p in starts])
    return model.run_layers(h, ctx, decode)


@torch.inference_mode()
def last_logits(model: Stage, h: torch.Tensor, decode: bool) -> torch.Tensor:
    if not decode:
        return model.logits(h[:, -1])
    with decode_scope():  # decode's final norm and LM head, as a colocated `model.decode`
        return model.logits(h)


def hidden_shape(model: Stage, mb: dict) -> tuple[int, ...]:
    n, hs = len(mb["starts"]), model.config.hidden_size
    if "verify" in mb:
        return (sum(mb["verify"]["counts"]), hs)
    return (n, hs) if mb["decode"] else (n, mb["T"], hs)


def out_rows(mb: dict) -> int:
    """Rows of logits (and of hidden states, with speculation) the last stage sends back."""
    return sum(mb["verify"]["counts"]) if "verify" in mb else len(mb["starts"])


def wants_hidden(mb: dict) -> bool:
    """Whether the last stage sends final-normed hidden states after the logits: a verify
    pass (every row) or a prefill whose head reads them (the last position)."""
    return "verify" in mb or mb.get("mtp_next") is not None


class StageLoop:
    """Stages 1..N-1: obey stage 0's control messages until "stop" (or the group breaks)."""

    def __init__(self, model: Stage, pools: Pools, channel: Channel,
                 handlers: dict[str, Handler] | None = None):
        self.model, self.pools, self.ch = model, pools, channel
        self.handlers = dict(handlers or {})
        self.last = channel.rank == channel.size - 1
        self.busy_s = 0.0
        self._failed = False
        self.handlers["stats"] = lambda msg: {"busy_s": self.busy_s}
        self.handlers["canaries"] = lambda a: {"bad_blocks": bad_blocks(pools, a["blocks"]),
                                               "bad_slots": bad_slots(pools, a["slots"])}
        self.handlers["expert_load"] = lambda a: {
            "layers": {str(i): c for i, c in routed_tokens(model).items()}}
        self.drafter = None
        """The MTP head's drafter (the last stage of a speculating worker)."""
        if model.mtp is not None:
            from baton.engine.pipeline.speculative import Drafter, stage_handlers

            self.drafter = Drafter(model, pools)
            self.handlers.update(stage_handlers(self.drafter))

    def run(self) -> None:
        while True:
            msg = self.ch.recv_msg(0, TAG_CTRL)
            self._apply(msg.get("ops", ()))
            op = msg["op"]
            if op == "stop":
                self.ch.flush()
                return
            if op == "fwd":
                self._forward(msg)
            elif op == "sync":
                self.ch.send_msg({"ok": True}, 0, TAG_REPLY)
            elif op == "call":
                self._call(msg)
            elif op == "ops":
                pass  # applied above
            else:
                log.error("stage %d: unknown control op %r ignored", self.ch.rank, op)

    def _apply(self, ops) -> None:
        apply_ops(self.pools, ops)

    def _forward(self, mb: dict) -> None:
        from baton.engine.pipeline import speculative as spec

        h = self.ch.recv(hidden_shape(self.model, mb), self.model.dtype, self.ch.rank - 1,
                         TAG_HIDDEN)
        out = mb.get("out", True)
        verify = "verify" in mb
        extra = None  # the hidden states sent back after the logits (speculation)
        t0 = time.perf_counter()
        try:
            h = spec.run_verify(self.model, self.pools, mb, h) if verify \
                else run_layers(self.model, self.pools, mb, h)
            if self.last and verify:
                h, extra = spec.verify_out(self.model, h)
            elif self.last and mb.get("mtp_next") is not None:
                hidden = spec.head_prefill(self.model, self.drafter, mb, h)
                h, extra = self.model.lm_head(hidden[:, -1]).float(), hidden[:, -1]
            elif self.last and out:
                h = last_logits(self.model, h, mb["decode"])
            failed = False
        except Exception:  # noqa: BLE001 - stage 0 fails this forward's requests (NaN out)
            log.exception("stage %d: forward failed", self.ch.rank)
            failed = True
        self.busy_s += time.perf_counter() - t0
        if not self.last:
            self.ch.isend(torch.full_like(h, float("nan")) if failed else h, self.ch.rank + 1,
                          TAG_HIDDEN)
            return
        # the last stage: a failed token range poisons its forward's logits (sent with the
        # forward's last range; stage 0 fails the forward's requests on NaN)
        self._failed = self._failed or failed
        if not out:
            return
        rows, cfg = out_rows(mb), self.model.config
        if self._failed:
            h = torch.full((rows, cfg.vocab_size), float("nan"))
            extra = torch.full((rows, cfg.hidden_size), float("nan"), dtype=self.model.dtype)
        self._failed = False
        self.ch.isend(h, 0, TAG_OUT)
        if wants_hidden(mb):
            self.ch.isend(extra.to(self.model.dtype), 0, TAG_OUT)

    def _call(self, msg: dict) -> None:
        handler = self.handlers.get(msg["name"])
        try:
            if handler is None:
                raise KeyError(f"stage {self.ch.rank} has no handler {msg['name']!r}")
            reply = {"ok": True, **(handler(msg.get("args") or {}) or {})}
        except Exception as e:  # noqa: BLE001 - reported to stage 0, which decides
            log.exception("stage %d: %s failed", self.ch.rank, msg["name"])
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if msg.get("reply"):
            self.ch.send_msg(reply, 0, TAG_REPLY)
