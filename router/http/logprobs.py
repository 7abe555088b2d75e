"""OpenAI's logprobs objects from Baton's TokenLogprob values.

Completions (`logprobs: N`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one
entry a token; an echoed prompt's first token has `null` logprob and top. Each top dict maps a
token's text to its logprob and, as vLLM's, also holds the chosen token. Chat (`logprobs: true`,
`top_logprobs: N`): `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
A token's text is its own decode (a byte-level piece of a character decodes to U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from baton.contract import TokenLogprob


@dataclass(frozen=True)
class LogprobView:
    text_of: Callable[[int], str]
    """One token id's text (the router tokenizer's decode)."""

    def completion(self, ids: Sequence[int], lps: Sequence[TokenLogprob | None], answer) -> dict:
        """The entries of `ids`; advances `answer.text_offset` past their text."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(ids, lps, strict=True):
            s = self.text_of(tid)
            out["tokens"].append(s)
            out["text_offset"].append(answer.text_offset)
            answer.text_offset += len(s)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top = {self.text_of(t): v for t, v in lp.top}
            top.setdefault(s, lp.logprob)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
        return out

    def chat(self, ids: Sequence[int], lps: Sequence[TokenLogprob]) -> list[dict]:
        return [{**self._entry(tid, lp.logprob),
                 "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                for tid, lp in zip(ids, lps, strict=True)]

    def _entry(self, tid: int, logprob: float) -> dict:
        s = self.text_of(tid)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def token_text(tokenizer) -> Callable[[int], str]:
    """The text of one token id; `token_id:N` without a tokenizer (vLLM's spelling)."""
    if tokenizer is None:
        return lambda tid: f"token_id:{tid}"
    return lambda tid: tokenizer.decode([tid])
