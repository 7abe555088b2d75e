"""MTP speculation on a pipeline-parallel worker: the head sits on the last stage.

    stage 0 (scheduler, SpeculativeDecoder)        last stage (layers, norm, LM head, MTP head)
    PipelineDrafter.draft / .write  -- call ---->  Drafter over its own pools (the head's KV
                                   <-- drafts --   is a layer of the last stage's KV pool)
    PipelineModel.verify  -- fwd {"verify"} -->    every stage: `verify_layers` over its layers
                          <-- logits, hidden --    (per-position states into scratch slots)
    prefill with "mtp_next"  ---------------->     the head's KV of the chunk right after the
                          <-- last hidden ----     target's layers (no [n, T, H] on the wire)

The scratch slots are reserved in stage 0's cache manager like a colocated worker's; each
stage saves its own layers' per-position states during the verify forward, and the roll
back (`StateScratch.restore`, a slot copy) is mirrored to every stage ahead of the next
message. Hidden states travel in msgpack as raw bytes with dtype and shape (no pickle).
"""

from __future__ import annotations

import torch

from baton.engine.speculative.drafter import Drafter, DraftJob, Pending
from baton.engine.speculative.tree import Tree
from baton.engine.speculative.verify import VerifyPlan, final_norm, verify_layers
from baton.model.layers.linear import decode_scope


def pack_tensor(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": t.view(torch.uint8).numpy().tobytes() if t.numel() else b""}


def unpack_tensor(d: dict) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    if not d["data"]:
        return torch.empty(d["shape"], dtype=dtype)
    raw = torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8)
    return raw.view(dtype).reshape(d["shape"])


def _pack_jobs(jobs: list[DraftJob]) -> list[dict]:
    return [{"start": j.pending.start, "hidden": pack_tensor(j.pending.hidden),
             "next": list(j.next_ids), "table": list(j.table), "k": j.num_drafts}
            for j in jobs]


def _unpack_jobs(items: list[dict], device) -> list[DraftJob]:
    return [DraftJob(Pending(d["start"], unpack_tensor(d["hidden"]).to(device)), d["next"],
                     d["table"], d["k"]) for d in items]


class PipelineDrafter:
    """Stage 0's stand-in for `Drafter`: the same calls, run on the last stage."""

    shared = True
    """The head's KV is a layer of the last stage's KV pool (see `with_draft_layers`)."""
    in_forward = True
    """A prefill forward writes the head's KV itself (the micro-batches carry "mtp_next")."""

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self.head = pipeline.mtp
        self.device = pipeline.device

    def _call(self, name: str, jobs: list[DraftJob]) -> dict:
        last = self.pipeline.size - 1
        (reply,) = self.pipeline.call(name, lambda k: {"jobs": _pack_jobs(jobs)}
                                      if k == last else None)
        if not reply.get("ok"):
            raise RuntimeError(f"the last pipeline stage's {name} failed: {reply.get('error')}")
        return reply

    def write(self, jobs: list[DraftJob]) -> None:
        self._call("mtp_write", jobs)

    def draft(self, jobs: list[DraftJob]) -> list[list[int]]:
        return self._call("mtp_draft", jobs)["drafts"]

    def draft_tree(self, jobs: list[DraftJob], top_k: list[tuple[int, ...]]) -> list[Tree]:
        last = self.pipeline.size - 1
        args = {"jobs": _pack_jobs(jobs), "top_k": [list(k) for k in top_k]}
        (reply,) = self.pipeline.call("mtp_draft_tree", lambda k: args if k == last else None)
        if not reply.get("ok"):
            raise RuntimeError(f"the last pipeline stage's drafting failed: {reply.get('error')}")
        return [Tree(t, p) for t, p in reply["trees"]]

    def prefill(self, *args) -> None:  # done inside the forward (in_forward)
        return None


def stage_handlers(drafter: Drafter) -> dict:
    """The last stage's control handlers for a stage-0 `PipelineDrafter`."""
    dev = drafter.device

    @torch.inference_mode()
    def write(args: dict) -> dict:
        drafter.write(_unpack_jobs(args["jobs"], dev))
        return {}

    @torch.inference_mode()
    def draft(args: dict) -> dict:
        return {"drafts": drafter.draft(_unpack_jobs(args["jobs"], dev))}

    @torch.inference_mode()
    def draft_tree(args: dict) -> dict:
        trees = drafter.draft_tree(_unpack_jobs(args["jobs"], dev),
                                   [tuple(k) for k in args["top_k"]])
        return {"trees": [[t.tokens, t.parents] for t in trees]}

    return {"mtp_write": write, "mtp_draft": draft, "mtp_draft_tree": draft_tree}


def plan_of(mb: dict) -> VerifyPlan:
    v = mb["verify"]
    return VerifyPlan(v["counts"], mb["starts"], mb["slots"], mb["tables"], v["scratch"],
                      v.get("parents"))


@torch.inference_mode()
def run_verify(model, pools, mb: dict, h: torch.Tensor) -> torch.Tensor:
    """This stage's layers over a verify micro-batch (token ids on the first stage)."""
    h = model.embed(h) if model.first else h.to(model.device)
    return verify_layers(model, pools, plan_of(mb), h)


@torch.inference_mode()
def verify_out(model, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's (float32 logits [R, vocab], final-normed hidden [R, H]), as decode
    computes them (`stage.last_logits`)."""
    with decode_scope():
        hidden = final_norm(model, h)
        return model.lm_head(hidden).float(), hidden


@torch.inference_mode()
def head_prefill(model, drafter: Drafter | None, mb: dict, h: torch.Tensor) -> torch.Tensor:
    """The last stage after a prefill micro-batch's layers: the MTP head's KV of the chunk
    for the sequences with "mtp_next" (the tokens after each position), then the
    final-normed hidden [n, T, H] (its logits are the caller's)."""
    hidden = final_norm(model, h)
    nexts = mb.get("mtp_next")
    idx = [i for i, n in enumerate(nexts or ()) if n is not None]
    if idx and drafter is not None:
        sel = hidden if len(idx) == len(nexts) else hidden[idx]
        drafter.prefill(sel, [nexts[i] for i in idx], [mb["starts"][i] for i in idx],
                        [mb["tables"][i] for i in idx])
    return hidden
