"""Log-probabilities of tokens, as clients read them (OpenAI's `logprobs`, lm-eval's scores).

The values are the log-softmax of the model's fp32 logits, before any sampling parameter
(temperature, top-k/p, penalties, bias): what vLLM reports and what `transformers` gives for the
same checkpoint. The worker that computes a token computes its logprob, so nothing extra crosses
the prefill -> decode handoff.
"""

from __future__ import annotations

import torch

from baton.contract import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`logits` [B, vocab] (any device), `tokens` [B]: each token's logprob and the `top` most
    likely tokens of its row, best first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).view(-1, 1)).view(-1).tolist()
    if top:
        vals, ids = torch.topk(lp, top, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(),
                                                               strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(tokens, chosen, tops, strict=True)]


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], start: int, end: int,
                    top: int) -> list[TokenLogprob]:
    """The logprobs of prompt tokens start+1 .. min(end, len(prompt) - 1) from the
    all-position logits [end - start, vocab] of the chunk prompt[start:end]: position j's row
    predicts token j + 1, so the chunk's last row scores the next chunk's first token (or,
    after the prompt's end, the generated token, which is not a prompt token)."""
    last = min(end, len(prompt) - 1)  # the row of position len-1 predicts no prompt token
    if last <= start:
        return []
    return token_logprobs(logits[: last - start], list(prompt[start + 1: last + 1]), top)
