"""What `baton generate` sends: prompts from flags or a JSONL file, as plain specs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from baton.engine.request import SamplingParams
from baton.errors import InvalidRequestError

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
                 "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "min_tokens", "n")
LINE_KEYS = {"id", "prompt", "prompt_ids", "session", *SAMPLING_KEYS}


@dataclass
class RequestSpec:
    id: str
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    session: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise InvalidRequestError(f"--prompt-ids must be comma-separated integers: {e}") from e


def sampling_from(d: dict, defaults: SamplingParams) -> SamplingParams:
    kw = {k: d[k] for k in SAMPLING_KEYS if k in d and d[k] is not None}
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    if "logit_bias" in kw:  # {"token id": bias}, as OpenAI's field
        try:
            kw["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in kw["logit_bias"].items()))
        except (AttributeError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"logit_bias must map token ids to numbers: {e}") from e
    merged = {**defaults.__dict__, **kw}
    return SamplingParams(**merged)


def load_jsonl(path: str | Path, defaults: SamplingParams, session: str | None) -> list[RequestSpec]:
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"requests file {str(p)!r} does not exist")
    specs = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{p}:{n}: not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise InvalidRequestError(f"{p}:{n}: each line must be a JSON object")
        unknown = sorted(set(d) - LINE_KEYS)
        if unknown:
            raise InvalidRequestError(f"{p}:{n}: unknown field {unknown[0]!r}; known: {sorted(LINE_KEYS)}")
        if ("prompt" in d) == ("prompt_ids" in d):
            raise InvalidRequestError(f"{p}:{n}: give exactly one of 'prompt' or 'prompt_ids'")
        specs.append(
            RequestSpec(
                id=str(d.get("id", f"req-{n}")),
                prompt=d.get("prompt"),
                prompt_ids=d.get("prompt_ids"),
                session=d.get("session", session),
                sampling=sampling_from(d, defaults),
            )
        )
    return specs


def logprobs_json(lps) -> list[dict]:
    """TokenLogprobs as `--json` prints them: {"token_id", "logprob", "top": [[id, lp], ...]}."""
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
            for lp in lps]


def result_dict(spec_id: str, out, text: str, prefill: str, decode: str) -> dict:
    extra = {k: logprobs_json(out[k]) for k in ("logprobs", "prompt_logprobs") if k in out}
    # speculative decoding's counts, when the engine speculated
    extra.update({k: out[k] for k in ("draft_tokens", "accepted_tokens") if k in out})
    return {**_result(spec_id, out, text, prefill, decode), **extra}


def _result(spec_id: str, out, text: str, prefill: str, decode: str) -> dict:
    return {
        "id": spec_id,
        "token_ids": list(out["token_ids"]),
        "text": text,
        "finish_reason": out["finish_reason"],
        "prompt_tokens": out["prompt_tokens"],
        "cached_tokens": out["cached_tokens"],
        "prefill_worker": prefill,
        "decode_worker": decode,
        "ttft_ms": out["ttft_ms"],
        "latency_ms": out["latency_ms"],
    }
