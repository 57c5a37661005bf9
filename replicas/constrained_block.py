"""Decoding one block of a constrained row (DINGO's dynamic program, arXiv 2505.23061).

The row's algorithm has chosen, as it always does, which positions of the block to fill
this step and proposed a token for each. Under a constraint the positions stay the rule's
choice, but their tokens are the best ones for which the whole block can still be
completed into text the automaton reads: a Viterbi pass over the automaton's states, in
which each position is one of

* fixed: filled at an earlier step (its token is read);
* chosen: filled this step: any token allowed there, scored by its log-probability, with
  the rule's own proposal preferred wherever it is allowed (so an unconstrained answer
  that already matches comes out unchanged, and a sampled proposal stays sampled);
* masked: still to fill: any one token (DINGO's mask symbol, unscored).

The block must end in a state the answer's room after it can still complete
(``TokenAutomaton.to_accept``), or, where the answer's room ends inside the block, in an
accepting state there. Positions before the answer (a prompt's end in the block) and after
its room are not read. By induction every step has a solution: the previous step's best
assignment of the masked positions is one.
"""

from __future__ import annotations

import numpy as np

from replicas.grammar import TokenAutomaton

PREFER = 1.0e6  # a proposal's bonus: above any block's spread of log-probabilities
FLOOR = -1.0e4  # log-probabilities below this count as this (no -inf arithmetic)


class NoValidBlock(RuntimeError):
    """The block cannot be completed under the constraint (an engine bug, not the user's)."""


def _best_per_target(prev: np.ndarray, tokens: np.ndarray, targets: np.ndarray, scores: np.ndarray):
    """Of candidate moves, the best-scoring one into each target state."""
    order = np.lexsort((-scores, targets))  # by target, the best first
    ordered = targets[order]
    first = np.ones(ordered.size, dtype=bool)
    first[1:] = ordered[1:] != ordered[:-1]
    keep = order[first]
    return prev[keep], tokens[keep], targets[keep], scores[keep]


def constrain_block(automaton: TokenAutomaton, state: int, fed: np.ndarray, block: np.ndarray, mask_id: int,
                    logprobs: dict[int, np.ndarray], first: int, stop: int, room_after: int | None) -> np.ndarray:
    """The block's tokens with the chosen positions' tokens decided under the constraint.

    ``state``: the automaton's state before position ``first`` (the answer's start in the
    block); ``fed``/``block``: the block's tokens before and after the rule's step;
    ``logprobs``: each chosen position's log-probabilities over the vocabulary; ``stop``:
    where the answer's room ends (at most the block's length); ``room_after``: the answer's
    tokens left after the block, or None where its room ends at ``stop``."""
    states, scores = np.array([state], dtype=np.int64), np.zeros(1)
    trail: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []  # (position, targets, prev, tokens)
    for position in range(first, stop):
        fed_token, token = int(fed[position]), int(block[position])
        if token == mask_id:  # masked: any one token, unscored
            targets, counts = automaton.successors(states)
            prev, tokens, values = np.repeat(states, counts), np.full(targets.size, mask_id), np.repeat(scores, counts)
        elif token == fed_token:  # fixed
            moved = [(q, automaton.next_state(q, token), score) for q, score in zip(states.tolist(), scores.tolist())]
            moved = [(q, target, score) for q, target, score in moved if target is not None]
            prev, targets, values = (np.array(column, dtype=dtype) for column, dtype in
                                     zip(zip(*moved) if moved else ((), (), ()), (np.int64, np.int64, float)))
            tokens = np.full(targets.size, token)
        else:  # chosen this step
            entries, counts = automaton.moves(states)
            prev, tokens, targets = np.repeat(states, counts), automaton.move_token[entries], automaton.move_target[entries]
            values = np.repeat(scores, counts)
            ended = states == automaton.ended  # there any token goes: the proposal
            if ended.any():
                prev, tokens = np.append(prev, automaton.ended), np.append(tokens, token)
                targets, values = np.append(targets, automaton.ended), np.append(values, scores[ended])
            values = values + np.maximum(logprobs[position][tokens], FLOOR) + PREFER * (tokens == token)
        if not targets.size:
            raise NoValidBlock(f"no state of the constraint reads position {position} of the block")
        prev, tokens, states, scores = _best_per_target(prev, tokens, targets, values)
        trail.append((position, states, prev, tokens))
    frontier_states, frontier_scores = states, scores
    if room_after is None:
        valid = automaton.accepting[frontier_states]
    else:
        valid = automaton.to_accept[frontier_states] <= room_after
    if not valid.any():
        raise NoValidBlock("no completion of the block matches the constraint within the answer's room")
    best = int(frontier_states[np.flatnonzero(valid)[np.argmax(frontier_scores[valid])]])
    out = block.copy()
    for position, targets, prev, tokens in reversed(trail):
        at = int(np.searchsorted(targets, best))
        if block[position] != fed[position] and block[position] != mask_id:
            out[position] = tokens[at]
        best = int(prev[at])
    return out
