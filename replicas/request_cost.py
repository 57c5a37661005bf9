"""What a request costs: KV pages for its prompt and blocks, row-steps for admission.

Pure functions (no torch): the engine, the ingress and the capacity simulator all size
requests with these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def blocks_needed(max_tokens: int, block_length: int) -> int:
    """Answer blocks a request can take at most."""
    return -(-max_tokens // block_length)


def aligned_head(prompt_tokens: int, block_length: int, aligned: bool) -> int:
    """Prompt tokens in the first answer block: with blocks aligned to the sequence's start,
    the prompt's end shares it; otherwise none."""
    return prompt_tokens % block_length if aligned else 0


def prompt_pages(prompt_tokens: int, block_length: int, aligned: bool) -> int:
    """Pages of a prompt (the last one maybe partial); aligned: its full pages only (its
    end is in the first answer block)."""
    return prompt_tokens // block_length if aligned else -(-prompt_tokens // block_length)


def pages_needed(prompt_tokens: int, max_tokens: int, block_length: int, suffix_tokens: int = 0) -> int:
    """KV pages a request can occupy: its prompt pages, one per possible output block, and
    its suffix's (an infill's text after the answer)."""
    return (-(-prompt_tokens // block_length) + blocks_needed(max_tokens, block_length)
            + -(-suffix_tokens // block_length))


def room_for_output(prompt_tokens: int, block_length: int, max_model_len: int, suffix_tokens: int = 0) -> int:
    """The most output tokens that fit beside the prompt (and suffix) in ``max_model_len``
    positions (whole blocks; 0: none)."""
    pages = max_model_len // block_length - -(-prompt_tokens // block_length) - -(-suffix_tokens // block_length)
    return max(0, pages) * block_length


def length_error(prompt_tokens: int, max_tokens: int, block_length: int, max_model_len: int,
                 suffix_tokens: int = 0) -> str | None:
    """Why the request is too long for ``max_model_len`` positions, or None if it fits."""
    needed = pages_needed(prompt_tokens, max_tokens, block_length, suffix_tokens) * block_length
    if needed > max_model_len // block_length * block_length:
        suffix = f" and the suffix ({suffix_tokens} tokens)" if suffix_tokens else ""
        return (f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}){suffix} needs {needed} positions "
                f"in blocks of {block_length}; this model serves at most {max_model_len}")
    return None


# admission admits while the predicted completion is within this fraction of the SLO (the
# prediction is a mean: a queue filled to the SLO itself finishes about half its requests late)
SLO_HEADROOM = 0.8


def request_cost(max_tokens: int, block_length: int, steps_per_block: float,
                 max_cost: int | None = None) -> int:
    """Row-steps charged for a request at admission: its most blocks x steps per block,
    rounded up to a whole number, at most ``max_cost`` (see ``max_request_cost``)."""
    cost = math.ceil(blocks_needed(max_tokens, block_length) * steps_per_block - 1e-9)
    return cost if max_cost is None else min(cost, max_cost)


def max_request_cost(max_model_len: int, block_length: int) -> int:
    """The most row-steps one request is charged, whatever its parameters: what one replica
    row holds for the longest request the model serves (``max_model_len`` positions less
    one prompt page, all answer blocks) at the worst case of every filling rule,
    ``block_length`` + 1 forwards per block. Edit steps beyond that (``joint_threshold``) are not charged, so
    a request's parameters can never make its charge block everyone else."""
    return max(1, max_model_len // block_length - 1) * (block_length + 1)


def steps_quantile(counts: Mapping[int, float], quantile: float) -> int | None:
    """The ``quantile`` (in (0, 1]) of a steps-per-block histogram {steps: count or
    weight}; None when it is empty."""
    if not 0 < quantile <= 1:
        raise ValueError(f"the quantile must be in (0, 1], got {quantile}")
    total = sum(counts.values())
    if total <= 0:
        return None
    rank, seen = quantile * total, 0.0
    for steps in sorted(counts):
        seen += counts[steps]
        if seen >= rank - 1e-12 * total:
            return int(steps)
    return int(max(counts))
