"""What one request may ask of a worker: checked alike by the router (before any worker call,
from what workers registered) and by every engine (against its own config), so both refuse
with the same INVALID_ARGUMENT message, naming the value, the limit and what to change."""

from __future__ import annotations

from baton.errors import InvalidRequestError


def check_length(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """The prompt and prompt + max_tokens must fit the max model length."""
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {prompt_len} tokens but the max model length is {max_model_len} "
            f"(prompt + at least one output token); shorten the prompt"
        )
    if prompt_len + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) is "
            f"{prompt_len + max_tokens} tokens, beyond the max model length {max_model_len}; "
            f"lower max_tokens to at most {max_model_len - prompt_len} or shorten the prompt"
        )


def check_pool(tokens: int, tokens_per_block: int, num_blocks: int) -> None:
    """`tokens` (prompt + max_tokens) must fit a KV pool of `num_blocks` blocks even when the
    pool holds nothing else; past that no amount of waiting helps."""
    need = -(-tokens // tokens_per_block)
    if need > num_blocks:
        raise InvalidRequestError(
            f"prompt + max_tokens ({tokens} tokens) needs {need} KV blocks of "
            f"{tokens_per_block} tokens but a worker's whole pool has {num_blocks} "
            f"(cache.num_blocks); shorten the prompt or lower max_tokens"
        )


def sample_blocks(n: int, prompt_len: int, max_tokens: int, tokens_per_block: int,
                  max_model_len: int | None = None) -> int:
    """KV blocks a request of `n` samples may hold at most: the prompt's full blocks once
    (shared), and per sample the rest of its prompt + max_tokens (its partial prompt block is
    a private copy)."""
    total = prompt_len + max_tokens if max_model_len is None else \
        min(prompt_len + max_tokens, max_model_len)
    per = -(-total // tokens_per_block)
    full = prompt_len // tokens_per_block
    return full + n * (per - full)


def max_samples(prompt_len: int, max_tokens: int, max_seqs: int, tokens_per_block: int,
                num_blocks: int, bound: int) -> int:
    """Most samples (`n`) the cache can hold for this request, at most `bound`: one live
    state slot each (`max_seqs`), and their KV blocks (`num_blocks`; 0: no KV pool)."""
    most = min(bound, max_seqs)
    if num_blocks:
        while most > 1 and sample_blocks(most, prompt_len, max_tokens,
                                         tokens_per_block) > num_blocks:
            most -= 1
    return most


def check_samples(n: int, prompt_len: int, max_tokens: int, max_model_len: int, max_seqs: int,
                  tokens_per_block: int, num_blocks: int) -> None:
    """`n` samples need a live state slot each and blocks for their n tails (num_blocks 0:
    no KV pool); InvalidRequestError naming n and the most this cache can hold."""
    if n <= 1:
        return
    most = max_samples(prompt_len, min(max_tokens, max_model_len - prompt_len), max_seqs,
                       tokens_per_block, num_blocks, n)
    if n > most:
        raise InvalidRequestError(
            f"n={n} samples of this request need {n} state slots and "
            f"{sample_blocks(n, prompt_len, max_tokens, tokens_per_block, max_model_len)} KV "
            f"blocks, but a worker's cache holds at most {most} such samples "
            f"({max_seqs} sequences, {num_blocks} blocks); lower n to at most {most}"
        )
