"""Pipelined decoding's block bookkeeping (``DllmAlgorithm.pipelined``: D2F), read from the
row table before each step; the scheduler applies it.

A pipelined request has its active block and the blocks decoded ahead of it
(``Request.ahead``, in order). Before each step the rule's *complete* flags are set: the
active block is always complete (the block before it is committed, or the prompt), an
ahead block once the block before it has ``completes_next`` of its positions decoded
(and stays so). Then one block may join after the last: where the rule ``adds_block`` of
the last block's decoded share, the request may still take a block (``max_tokens``), no
block holds an end id (unless ``ignore_eos``), and the active block did not start this step
(that start is the step's one new block). A block's decoded share counts its positions
that are not the mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Set
from typing import Any

import numpy as np

from replicas.request import Request
from replicas.rows import RowTable


def _decoded(rows: RowTable, row: int, page_index: int, mask_id: int) -> float:
    block = rows.tokens[row, page_index]
    return float((block != mask_id).sum()) / block.size


def _pages(request: Request) -> list[int]:
    """The page indices of the request's active block and its ahead blocks, in order."""
    return [request.active_page_index] + [ahead.page_index for ahead in request.ahead]


def complete_flags(request: Request, rows: RowTable, mask_id: int) -> list[Any] | None:
    """The states of the request's active and ahead blocks (in order) with their complete
    flags set as they stand now; None where none changes."""
    states = [request.algorithm_state] + [ahead.algorithm_state for ahead in request.ahead]
    flagged = list(states)
    if not flagged[0].complete:
        flagged[0] = dataclasses.replace(flagged[0], complete=True)
    pages = _pages(request)
    for i in range(1, len(flagged)):
        if not flagged[i].complete and request.algorithm.completes_next(
                request.algorithm_params, _decoded(rows, request.row, pages[i - 1], mask_id)):
            flagged[i] = dataclasses.replace(flagged[i], complete=True)
    return None if all(new is old for new, old in zip(flagged, states)) else flagged


def joins(request: Request, rows: RowTable, mask_id: int, end_ids: Set[int]) -> bool:
    """Whether a block joins after the request's last one this step (see the module docstring)."""
    if request.steps_in_block == 0:
        return False
    if request.block_index - request.first_block_index + 1 + len(request.ahead) >= request.blocks_to_denoise:
        return False
    pages = _pages(request)
    if not request.params.ignore_eos and np.isin(rows.tokens[request.row, pages], list(end_ids)).any():
        return False
    return request.algorithm.adds_block(request.algorithm_params, _decoded(rows, request.row, pages[-1], mask_id))


def joining_state(request: Request, rows: RowTable, mask_id: int) -> Any:
    """The state of a block joining after the request's last one: fresh, complete only where
    the last block is decoded far enough."""
    state = request.algorithm.init_state(request.algorithm_params, request.block_index + len(request.ahead) + 1)
    complete = request.algorithm.completes_next(request.algorithm_params,
                                                _decoded(rows, request.row, _pages(request)[-1], mask_id))
    return dataclasses.replace(state, complete=complete)


def refusal(algorithm: str, spec, shape, structured: bool, logprobs: bool) -> str | None:
    """Why pipelined decoding (``algorithm``'s) cannot serve a request to ``spec``'s model on
    ``shape`` (a ``ServingShape``), with a structure or log-probabilities asked; None: it can."""
    if spec.bidirectional or shape.canvas == "full" or shape.aligned:
        return (f"algorithm {algorithm} decodes several blocks at once: it needs a block-causal model on the "
                "block canvas with page-aligned blocks (D2F's LLaDA: model override attention "
                "block_causal_whole_prompt)")
    if structured or logprobs:
        return f"algorithm {algorithm} does not take a structured output or logprobs yet"
    return None
