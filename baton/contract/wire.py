"""Contract dataclasses <-> baton.v1 protobuf: the only module past the stubs that knows both.

Used by every gRPC edge alike: the router's server and worker clients, both worker servers,
the registration thread, the command-line client and the test fakes. Unset optional fields
take the dataclass defaults (`SamplingParams()`, `DEFAULT_LEASE_SECONDS`, ...), so a default
is defined once, in the contract, and proto/ documents the same values (a test checks).
"""

from __future__ import annotations

import numpy as np
from google.protobuf.unknown_fields import UnknownFieldSet

from baton.contract.types import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_TOKENS_PER_BLOCK,
    DecodeChunk,
    FinishReason,
    GenerateChunk,
    GenerateInput,
    GenerateSummary,
    PrefillInput,
    PrefillResult,
    Reservation,
    ReserveInput,
    Role,
    ServeInput,
    SnapshotEvent,
    SnapshotShipment,
    StageInfo,
    TokenLogprob,
    WorkerInfo,
    WorkerLoad,
    WorkerView,
)
from baton.errors import InvalidRequestError
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import worker_pb2 as wpb
from baton.sampling import SamplingParams

ROLE_TO_PB = {Role.PREFILL: pb.WORKER_ROLE_PREFILL, Role.DECODE: pb.WORKER_ROLE_DECODE}
ROLE_FROM_PB = {v: k for k, v in ROLE_TO_PB.items()}
FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}
_SAMPLING_DEFAULTS = SamplingParams()


# ---- shared pieces --------------------------------------------------------------------------

def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults (proto/ documents the same)."""
    d = _SAMPLING_DEFAULTS
    return SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else d.max_tokens,
        temperature=m.temperature if m.HasField("temperature") else d.temperature,
        top_p=m.top_p if m.HasField("top_p") else d.top_p,
        top_k=m.top_k if m.HasField("top_k") else d.top_k,
        seed=m.seed if m.HasField("seed") else d.seed,
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else d.logprobs,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else d.prompt_logprobs,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty")
        else d.repetition_penalty,
        logit_bias=tuple(sorted(m.logit_bias.items())),
        min_tokens=m.min_tokens,
        n=m.n if m.HasField("n") else d.n,
        grammar=m.grammar,
        grammar_replay=m.grammar_replay,
    )


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens,
        grammar=s.grammar,
        grammar_replay=s.grammar_replay,
    )
    if s.top_k:
        m.top_k = s.top_k
    if s.seed is not None:
        m.seed = s.seed
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(s, name) is not None:
            setattr(m, name, getattr(s, name))
    if s.repetition_penalty != 1.0:
        m.repetition_penalty = s.repetition_penalty
    if s.n != 1:
        m.n = s.n
    return m


def logprob_to_pb(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])


def logprob_from_pb(m: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob, tuple(zip(m.top_ids, m.top_logprobs, strict=True)))


def logprobs_to_pb(lps) -> list[pb.TokenLogprob]:
    return [logprob_to_pb(lp) for lp in lps]


def logprobs_from_pb(ms) -> tuple[TokenLogprob, ...]:
    return tuple(logprob_from_pb(m) for m in ms)


def finish_from_pb(value: int) -> FinishReason | None:
    return FINISH_FROM_PB.get(value)


def finish_to_pb(reason: FinishReason | str | None) -> int:
    return FINISH_TO_PB[None if reason is None else FinishReason(reason)]


def role_from_pb(value: int) -> Role:
    if value not in ROLE_FROM_PB:
        raise InvalidRequestError(f"worker role must be PREFILL or DECODE, got {value}")
    return ROLE_FROM_PB[value]


def role_to_pb(role: Role) -> int:
    return ROLE_TO_PB[role]


def load_from_pb(m: pb.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        m.running, m.waiting, m.free_blocks, m.free_slots, m.total_blocks, m.total_slots
    )


def load_to_pb(w: WorkerLoad) -> pb.WorkerLoad:
    return pb.WorkerLoad(
        running=w.running,
        waiting=w.waiting,
        free_blocks=w.free_blocks,
        free_slots=w.free_slots,
        total_blocks=w.total_blocks,
        total_slots=w.total_slots,
    )


def event_from_pb(m: pb.SnapshotEvent) -> SnapshotEvent:
    if m.kind not in (pb.SnapshotEvent.KIND_INSERTED, pb.SnapshotEvent.KIND_EVICTED):
        raise InvalidRequestError(
            f"snapshot event kind must be INSERTED or EVICTED, got {m.kind}")
    inserted = m.kind == pb.SnapshotEvent.KIND_INSERTED
    return SnapshotEvent(inserted, m.block_hash, m.snapshot_hash, m.num_tokens, m.tier)


def event_to_pb(e: SnapshotEvent) -> pb.SnapshotEvent:
    kind = pb.SnapshotEvent.KIND_INSERTED if e.inserted else pb.SnapshotEvent.KIND_EVICTED
    return pb.SnapshotEvent(
        kind=kind, block_hash=e.block_hash, snapshot_hash=e.snapshot_hash,
        num_tokens=e.num_tokens, tier=e.tier,
    )


# ---- Registry (worker -> router) ------------------------------------------------------------

def register_from_pb(m: rpb.RegisterRequest) -> WorkerInfo:
    return WorkerInfo(
        worker_id=m.worker_id,
        role=role_from_pb(m.role),
        address=m.address,
        tokens_per_block=m.tokens_per_block or DEFAULT_TOKENS_PER_BLOCK,
        load=load_from_pb(m.load),
        max_model_len=m.max_model_len,
        stages=tuple(StageInfo(s.first_layer, s.num_layers, s.transfer_endpoint)
                     for s in m.stages),
    )


def register_to_pb(w: WorkerInfo) -> rpb.RegisterRequest:
    return rpb.RegisterRequest(
        worker_id=w.worker_id,
        role=role_to_pb(w.role),
        address=w.address,
        tokens_per_block=w.tokens_per_block,
        load=load_to_pb(w.load),
        max_model_len=w.max_model_len,
        stages=[rpb.StageInfo(first_layer=s.first_layer, num_layers=s.num_layers,
                              transfer_endpoint=s.transfer_endpoint) for s in w.stages],
    )


def worker_view_to_pb(v: WorkerView) -> rpb.WorkerInfo:
    return rpb.WorkerInfo(
        worker_id=v.worker_id,
        role=role_to_pb(v.role),
        address=v.address,
        load=load_to_pb(v.load),
        seconds_since_heartbeat=v.seconds_since_heartbeat,
        inflight=v.inflight,
        tracked_snapshots=v.tracked_snapshots,
        tokens_per_block=v.tokens_per_block,
        max_model_len=v.max_model_len,
    )


def worker_view_from_pb(m: rpb.WorkerInfo) -> WorkerView:
    return WorkerView(
        worker_id=m.worker_id,
        role=role_from_pb(m.role),
        address=m.address,
        tokens_per_block=m.tokens_per_block or DEFAULT_TOKENS_PER_BLOCK,
        load=load_from_pb(m.load),
        inflight=m.inflight,
        seconds_since_heartbeat=m.seconds_since_heartbeat,
        tracked_snapshots=m.tracked_snapshots,
        max_model_len=m.max_model_len,
    )


# ---- Router.Generate (client <-> router) ----------------------------------------------------

def generate_from_pb(m: rpb.GenerateRequest) -> GenerateInput:
    _refuse_unknown_fields(m, "GenerateRequest")
    _refuse_unknown_fields(m.sampling, "GenerateRequest.sampling")
    return GenerateInput(
        request_id=m.request_id,
        prompt_ids=tuple(m.prompt_ids) or None,
        prompt_text=m.prompt or None,
        sampling=sampling_from_pb(m.sampling),
        session_id=m.session_id,
    )


def generate_to_pb(g: GenerateInput) -> rpb.GenerateRequest:
    m = rpb.GenerateRequest(
        request_id=g.request_id, sampling=sampling_to_pb(g.sampling), session_id=g.session_id
    )
    if g.prompt_ids is not None:
        m.prompt_ids.extend(g.prompt_ids)
    if g.prompt_text is not None:
        m.prompt = g.prompt_text
    return m


def chunk_to_pb(c: GenerateChunk) -> rpb.GenerateResponse:
    m = rpb.GenerateResponse(request_id=c.request_id, token_ids=c.token_ids, text=c.text,
                             logprobs=logprobs_to_pb(c.logprobs),
                             prompt_logprobs=logprobs_to_pb(c.prompt_logprobs), sample=c.sample)
    s = c.summary
    if s is not None:
        m.finish_reason = finish_to_pb(s.finish_reason)
        m.prompt_tokens = s.prompt_tokens
        m.cached_tokens = s.cached_tokens
        m.prefill_worker = s.prefill_worker
        m.decode_worker = s.decode_worker
        m.ttft_ms = s.ttft_ms
        m.latency_ms = s.latency_ms
        m.retries = s.retries
        m.draft_tokens = s.draft_tokens
        m.accepted_tokens = s.accepted_tokens
    return m


def chunk_from_pb(m: rpb.GenerateResponse) -> GenerateChunk:
    reason = finish_from_pb(m.finish_reason)
    summary = None
    if reason is not None:
        summary = GenerateSummary(
            finish_reason=reason,
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_tokens,
            prefill_worker=m.prefill_worker,
            decode_worker=m.decode_worker,
            ttft_ms=m.ttft_ms,
            latency_ms=m.latency_ms,
            retries=m.retries,
            draft_tokens=m.draft_tokens,
            accepted_tokens=m.accepted_tokens,
        )
    return GenerateChunk(m.request_id, tuple(m.token_ids), m.text, summary,
                         logprobs_from_pb(m.logprobs), logprobs_from_pb(m.prompt_logprobs),
                         m.sample)


# ---- DecodeWorker / PrefillWorker (router <-> workers) --------------------------------------

_packed: tuple[tuple[int, ...], bytes] = ((), b"")
"""The last prompt packed (the router sends one prompt twice: Reserve, then Prefill)."""


def prompt_le32(ids: tuple[int, ...]) -> bytes:
    """`ids` as little-endian int32s (`prompt_le32`): numpy packs a prompt in microseconds,
    where a repeated field converts it a token at a time (8k tokens: ~1 ms each way)."""
    global _packed
    last = _packed
    if last[0] is ids:
        return last[1]
    try:
        data = np.asarray(ids, dtype="<i4").tobytes()
    except OverflowError as e:  # as protobuf refuses it in prompt_ids
        raise ValueError(f"a prompt token id does not fit int32 ({e})") from None
    _packed = (ids, data)
    return data


def prompt_from_pb(m: wpb.ReserveRequest | wpb.PrefillRequest) -> tuple[int, ...]:
    """The prompt of a Reserve or Prefill request: `prompt_le32` or `prompt_ids` (one only)."""
    data = m.prompt_le32
    if not data:
        return tuple(m.prompt_ids)
    name = type(m).__name__
    if len(m.prompt_ids):
        raise InvalidRequestError(f"{name} sets both prompt_ids ({len(m.prompt_ids)} tokens) "
                                  "and prompt_le32; send the prompt in one of them")
    if len(data) % 4:
        raise InvalidRequestError(f"{name}.prompt_le32 holds {len(data)} bytes, not a multiple "
                                  "of 4; it carries little-endian int32 token ids")
    return tuple(np.frombuffer(data, dtype="<i4").tolist())


def reserve_to_pb(r: ReserveInput) -> wpb.ReserveRequest:
    return wpb.ReserveRequest(
        request_id=r.request_id,
        prompt_le32=prompt_le32(r.prompt_ids),
        sampling=sampling_to_pb(r.sampling),
        session_id=r.session_id,
    )


def reserve_from_pb(m: wpb.ReserveRequest) -> ReserveInput:
    return ReserveInput(
        m.request_id, prompt_from_pb(m), sampling_from_pb(m.sampling), m.session_id
    )


def reservation_from_pb(m: wpb.ReserveReply | wpb.Destination) -> Reservation:
    return Reservation(
        worker_id=m.worker_id,
        transfer_endpoint=m.transfer_endpoint,
        block_ids=tuple(m.block_ids),
        slot=m.slot if m.HasField("slot") else None,
        skip_blocks=m.skip_blocks,
        lease_seconds=m.lease_seconds or DEFAULT_LEASE_SECONDS,
        incarnation=m.incarnation,
        signature=m.signature,
    )


def reservation_to_pb(r: Reservation, cls=wpb.ReserveReply):
    """`cls` is ReserveReply (decode worker side) or Destination (inside PrefillRequest)."""
    m = cls(
        worker_id=r.worker_id,
        transfer_endpoint=r.transfer_endpoint,
        block_ids=r.block_ids,
        skip_blocks=r.skip_blocks,
        lease_seconds=r.lease_seconds,
        incarnation=r.incarnation,
        signature=r.signature,
    )
    if r.slot is not None:
        m.slot = r.slot
    return m


def prefill_to_pb(p: PrefillInput) -> wpb.PrefillRequest:
    m = wpb.PrefillRequest(
        request_id=p.request_id,
        prompt_le32=prompt_le32(p.prompt_ids),
        sampling=sampling_to_pb(p.sampling),
        session_id=p.session_id,
    )
    if p.destination is not None:
        m.destination.CopyFrom(reservation_to_pb(p.destination, wpb.Destination))
    return m


def prefill_from_pb(m: wpb.PrefillRequest) -> PrefillInput:
    return PrefillInput(
        m.request_id,
        prompt_from_pb(m),
        sampling_from_pb(m.sampling),
        m.session_id,
        destination_from_pb(m),
    )


def destination_to_pb(r: Reservation) -> wpb.PrefillRequest:
    """The second message of a Prefill stream: the destination alone."""
    return wpb.PrefillRequest(destination=reservation_to_pb(r, wpb.Destination))


def destination_from_pb(m: wpb.PrefillRequest) -> Reservation | None:
    return reservation_from_pb(m.destination) if m.HasField("destination") else None


def prefill_result_from_pb(m: wpb.PrefillReply) -> PrefillResult:
    samples = tuple(
        PrefillResult(s.first_token_id, m.cached_tokens, s.finished,
                      finish_from_pb(s.finish_reason),
                      logprob_from_pb(s.logprobs) if s.HasField("logprobs") else None)
        for s in m.samples)
    return PrefillResult(
        m.first_token_id, m.cached_tokens, m.finished, finish_from_pb(m.finish_reason),
        logprob_from_pb(m.logprobs) if m.HasField("logprobs") else None,
        logprobs_from_pb(m.prompt_logprobs), samples,
    )


def prefill_result_to_pb(r: PrefillResult) -> wpb.PrefillReply:
    m = wpb.PrefillReply(
        first_token_id=r.first_token_id,
        cached_tokens=r.cached_tokens,
        finished=r.finished,
        finish_reason=finish_to_pb(r.finish_reason),
        prompt_logprobs=logprobs_to_pb(r.prompt_logprobs),
    )
    if r.logprobs is not None:
        m.logprobs.CopyFrom(logprob_to_pb(r.logprobs))
    for s in r.samples:
        sm = m.samples.add(first_token_id=s.first_token_id, finished=s.finished,
                           finish_reason=finish_to_pb(s.finish_reason))
        if s.logprobs is not None:
            sm.logprobs.CopyFrom(logprob_to_pb(s.logprobs))
    return m


def decode_chunk_from_pb(m: wpb.DecodeResponse) -> DecodeChunk:
    return DecodeChunk(tuple(m.token_ids), finish_from_pb(m.finish_reason), m.cached_tokens,
                       m.snapshot_tokens, logprobs_from_pb(m.logprobs), m.draft_tokens,
                       m.accepted_tokens, m.sample)


def decode_chunk_to_pb(c: DecodeChunk) -> wpb.DecodeResponse:
    return wpb.DecodeResponse(token_ids=c.token_ids, finish_reason=finish_to_pb(c.finish_reason),
                              cached_tokens=c.cached_tokens, snapshot_tokens=c.snapshot_tokens,
                              logprobs=logprobs_to_pb(c.logprobs),
                              draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens,
                              sample=c.sample)


def serve_to_pb(r: ServeInput) -> wpb.ServeRequest:
    return wpb.ServeRequest(
        request_id=r.request_id,
        prompt_ids=r.prompt_ids,
        sampling=sampling_to_pb(r.sampling),
        session_id=r.session_id,
        max_uncached_tokens=r.max_uncached_tokens,
    )


def shipment_to_pb(s: SnapshotShipment) -> wpb.PullSnapshotRequest:
    return wpb.PullSnapshotRequest(request_id=s.request_id, token_ids=s.token_ids,
                                   source=reservation_to_pb(s.source, wpb.Destination))


def shipment_from_pb(m: wpb.PullSnapshotRequest) -> SnapshotShipment:
    if not m.HasField("source"):
        raise InvalidRequestError("PullSnapshot needs a source (a HoldSnapshot reply)")
    return SnapshotShipment(m.request_id, tuple(m.token_ids), reservation_from_pb(m.source))


def serve_from_pb(m: wpb.ServeRequest) -> ServeInput:
    return ServeInput(m.request_id, tuple(m.prompt_ids), sampling_from_pb(m.sampling),
                      m.session_id, m.max_uncached_tokens)


def _refuse_unknown_fields(m, where: str) -> None:
    """A field this router does not know is refused, not silently dropped (a newer client's
    sampling option would otherwise be ignored without a word)."""
    numbers = sorted({f.field_number for f in UnknownFieldSet(m)})
    if numbers:
        raise InvalidRequestError(
            f"{where} has unknown field number(s) {numbers}: this router speaks baton.v1 "
            f"as in proto/; upgrade the router or drop the field"
        )
