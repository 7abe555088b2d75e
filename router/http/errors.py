"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for every refusal.

Statuses come from the one map in `baton/contract/status.py`; bad input is a 4xx that names
the field in `param` and in the message, never a 500.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from baton.contract.status import http_status_of

TYPE_OF_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
    405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
    499: "cancelled", 503: "service_unavailable",
}
FIELD_WORDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "prompt",
               "messages", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "logit_bias", "min_tokens", "n")
"""Fields an error from the router or a worker may start with; it becomes `param`."""
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
"""Union-branch tags pydantic puts in an error's location: not field names."""


class ApiError(Exception):
    """A refusal by the HTTP layer itself (counted as such in the request metrics)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    kind = TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def api_error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), status_code=e.status)


def baton_error_response(e: BaseException) -> JSONResponse:
    """A Baton error raised behind the API (router or worker): its status, its message."""
    status = http_status_of(e)
    message = str(e) if status < 500 else f"{type(e).__name__}: {e}"
    return JSONResponse(error_body(status, message, param_of(message)), status_code=status)


def param_of(message: str) -> str | None:
    word = re.match(r"\w+", message)
    return word.group(0) if word and word.group(0) in FIELD_WORDS else None


def from_validation(e: ValidationError) -> ApiError:
    """The first problem pydantic found, as OpenAI words it."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    if err["type"] == "model_type" and not err["loc"]:
        return ApiError(400, "the body must be a JSON object")
    param = _param(err["loc"])
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param,
                        "unknown_parameter")
    if err["type"] == "missing":
        return ApiError(400, f"you must provide a '{param}' parameter", param, "missing_required")
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return ApiError(400, f"invalid value for '{param}': {err['msg']} (got {got})", param,
                    "invalid_value")


def _param(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; union-branch tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _NAME.match(part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            continue  # a union branch such as 'list[int]': not a field
    return out
