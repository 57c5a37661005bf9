"""The one rule for how long a request may be: pages for its prompt and its blocks."""

from __future__ import annotations


def pages_needed(prompt_tokens: int, max_tokens: int, block_length: int) -> int:
    """KV pages a request can occupy: its prompt pages plus one per possible output block."""
    return -(-prompt_tokens // block_length) + -(-max_tokens // block_length)


def length_error(prompt_tokens: int, max_tokens: int, block_length: int, max_model_len: int) -> str | None:
    """Why the request is too long for ``max_model_len`` positions, or None if it fits."""
    needed = pages_needed(prompt_tokens, max_tokens, block_length) * block_length
    if needed > max_model_len // block_length * block_length:
        return (f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs {needed} positions "
                f"in blocks of {block_length}; this model serves at most {max_model_len}")
    return None
