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
