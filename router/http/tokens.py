"""`POST /tokenize` and `POST /detokenize`, in vLLM's shape, with the router's tokenizer.

    /tokenize    {"prompt": "..."} or {"messages": [...], "add_generation_prompt": true}
                 -> {"count": N, "max_model_len": M, "tokens": [...]}
    /detokenize  {"tokens": [...]} -> {"prompt": "..."}
`model` is optional; when given it must be the served model.
"""

from __future__ import annotations

from pydantic import Field, ValidationError

from router.http.errors import ApiError, from_validation
from router.http.schemas import Message, _Strict


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def _parse(ctx, raw: bytes, cls):
    try:
        body = cls.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation(e) from None
    if body.model is not None and body.model != ctx.model_name:
        raise ApiError(404, f"The model '{body.model}' does not exist; this server serves "
                       f"'{ctx.model_name}' (GET /v1/models)", "model", "model_not_found")
    tok = ctx.orchestrator.tokenizer
    if tok is None:
        raise ApiError(400, "this router has no tokenizer (the model folder has none)")
    return body, tok


async def tokenize(ctx, raw: bytes) -> dict:
    body, tok = _parse(ctx, raw, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        if ctx.chat_template is None:
            raise ApiError(400, "messages: this model has no chat template", "messages")
        for i, m in enumerate(body.messages):
            if m.non_text():
                raise ApiError(400, f"messages[{i}].{m.non_text()}", f"messages[{i}].content")
        text = ctx.chat_template.render([{"role": m.role, "content": m.text()}
                                         for m in body.messages], body.add_generation_prompt)
    else:
        text = body.prompt
    ids = list(tok.encode(text))
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}


async def detokenize(ctx, raw: bytes) -> dict:
    body, tok = _parse(ctx, raw, DetokenizeRequest)
    bad = [t for t in body.tokens if not 0 <= t < 2**31]
    if bad:
        raise ApiError(400, f"tokens: ids must be in [0, 2^31), got {bad[:5]}", "tokens")
    return {"prompt": tok.decode(body.tokens)}
