"""A decode stream of a request with n > 1 samples: the outputs ready, one message a sample.

    box  ── outputs of every sample, in engine order (each names its `sample`) ──►
    drain_samples(box)   waits for one output, takes the rest already queued, and folds them
                         into one DecodeChunk per sample present (tokens in order; the chunk
                         of a sample whose output finished carries its finish fields)
    the stream ends      after the output that leaves no sample open (`open_samples` 0)

A sample that fails or is aborted alone ends with finish_reason ERROR / ABORT on its own
message; its siblings go on (the router decides what the client sees).
"""

from __future__ import annotations

import queue

from baton.contract import DecodeChunk
from baton.engine.request import RequestOutput


def drain_samples(box: queue.Queue[RequestOutput]) -> list[tuple[DecodeChunk, RequestOutput]]:
    """(chunk, its sample's last output) for each sample with outputs ready, at least one."""
    outs = [box.get()]
    while True:
        try:
            outs.append(box.get_nowait())
        except queue.Empty:
            break
    groups: dict[int, list[RequestOutput]] = {}
    for out in outs:
        groups.setdefault(out.sample, []).append(out)
    return [(sample_chunk(group), group[-1]) for group in groups.values()]


def sample_chunk(outs: list[RequestOutput]) -> DecodeChunk:
    """One sample's outputs as one message."""
    last = outs[-1]
    tokens = tuple(t for o in outs for t in o.new_token_ids)
    logprobs = tuple(lp for o in outs for lp in o.logprobs)
    if not last.finished:
        return DecodeChunk(tokens, logprobs=logprobs, sample=last.sample)
    return DecodeChunk(tokens, last.finish_reason, snapshot_tokens=last.snapshot_tokens,
                       logprobs=logprobs, draft_tokens=last.draft_tokens,
                       accepted_tokens=last.accepted_tokens, sample=last.sample)


def closes(out: RequestOutput) -> bool:
    """Whether `out` ends the request: finished with no sample left open."""
    return out.finished and not out.open_samples
