"""Builders shared by the algorithm tests: hand-made logits and one-call steps."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from algorithms import get_algorithm

VOCAB = 8
MASK = VOCAB - 1  # the mask id of every hand-built case


def position_logits(token: int, probability: float, vocab: int = VOCAB) -> list[float]:
    """Logits of one position: ``token`` has ``probability``, the rest share what is left."""
    rest = (1.0 - probability) / (vocab - 1)
    return [math.log(probability if t == token else rest) for t in range(vocab)]


def logits_of(rows: Sequence[Sequence[tuple[int, float]]], vocab: int = VOCAB) -> torch.Tensor:
    """``[B, L, V]`` logits from ``rows[b][i] = (argmax token, its probability)``."""
    return torch.tensor(
        [[position_logits(t, p, vocab) for t, p in row] for row in rows], dtype=torch.float32
    )


def run_step(name: str, logits: torch.Tensor, block: torch.Tensor, overrides=None, states=None):
    """One step of ``name`` on every row with the same parameters; returns (block, done,
    the rows' next states)."""
    algorithm = get_algorithm(name)
    params = [algorithm.make_params(overrides)] * block.shape[0]
    if states is None:
        states = [algorithm.init_state(p, 0) for p in params]
    block = block.clone()
    done = step_done(algorithm, logits, block, MASK, params, states)
    return block, done, states


def step_done(algorithm, logits: torch.Tensor, block: torch.Tensor, mask_id: int, params, states: list) -> torch.Tensor:
    """``algorithm.step`` on ``block`` (in place) and its done flags, as the engine reads
    them: what it returned, or where it returns None, the rows fed with no mask. ``states``
    (a list) becomes the rows' next states, as the engine's scheduler keeps them."""
    fed_unmasked = ~(block == mask_id).any(-1)
    done, next_states = algorithm.step(logits, block, mask_id, params, states)
    if next_states is not None:
        states[:] = next_states
    return fed_unmasked if done is None else done


def filled(before: torch.Tensor, after: torch.Tensor) -> list[list[int]]:
    """Per row, the positions whose token changed."""
    return [torch.nonzero(b != a).flatten().tolist() for b, a in zip(before, after)]
