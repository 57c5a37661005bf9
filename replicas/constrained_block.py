"""Decoding one block of a constrained row (DINGO's dynamic program, arXiv 2505.23061).

The row's algorithm has chosen, as it always does, which positions of the block to fill
this step and proposed a token for each. Under a constraint the positions stay the rule's
choice, but their tokens are the best ones for which the whole block can still be
completed into text the automaton reads: a Viterbi pass over the automaton's states (and
its token classes, ``replicas.grammar.TokenAutomaton``), in which each position is one of

* fixed: filled at an earlier step (its token is read);
* chosen: filled this step: any token allowed there, scored by its log-probability, with
  the rule's own proposal preferred wherever it is allowed (so an unconstrained answer
  that already matches comes out unchanged, and a sampled proposal stays sampled);
* masked: still to fill: any one token (DINGO's mask symbol, unscored).

The block must end in a state the answer's room after it can still complete
(``TokenAutomaton.to_accept``), or, where the answer's room ends inside the block, in an
accepting state there. The masks after the block's last decided position need no pass: a
state ``d`` tokens from acceptance completes ``k`` masks and ``r`` tokens of room after
them exactly where ``d <= k + r`` (an end id leads to ``ended``, where any token goes).
Where the rule's proposals can be completed as they are (a walk over the set of states the
masks may lead to), the program, which prefers them, would keep them: they are kept
without it. Positions before the answer (a prompt's end in the block) and after its room
are not read. By induction every step has a solution: the previous step's best assignment of the
masked positions is one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from replicas.grammar import TokenAutomaton

PREFER = 1.0e6  # a proposal's bonus: above any block's spread of log-probabilities


class NoValidBlock(RuntimeError):
    """The block cannot be completed under the constraint (an engine bug, not the user's)."""


def class_scores(automaton: TokenAutomaton, logits: torch.Tensor,
                 proposals: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """For positions' ``logits[P, V]`` and the rule's ``proposals[P]``: each token class's
    best score (log-probability, the proposal preferred) and the token that has it, ``[P, C]``
    each (-inf and V where a class has no token)."""
    scores = logits.float().log_softmax(-1)
    scores[torch.arange(scores.shape[0], device=scores.device), proposals] += PREFER
    vocab = scores.shape[1]
    token_class = torch.from_numpy(automaton.token_class[:vocab]).to(scores.device).expand_as(scores)
    best = scores.new_full((scores.shape[0], automaton.num_classes), float("-inf"))
    best.scatter_reduce_(1, token_class, scores, "amax")
    ids = torch.arange(vocab, device=scores.device).expand_as(scores)
    at_best = torch.where(scores == best.gather(1, token_class), ids, vocab)
    token = torch.full_like(best, vocab, dtype=torch.int64).scatter_reduce_(1, token_class, at_best, "amin")
    return best.cpu().numpy().astype(np.float64), token.cpu().numpy()


def _best_per_target(prev: np.ndarray, tokens: np.ndarray, targets: np.ndarray, scores: np.ndarray):
    """Of candidate moves, the best-scoring one into each target state (targets ascending)."""
    order = np.lexsort((-scores, targets))
    ordered = targets[order]
    first = np.empty(ordered.size, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    keep = order[first]
    return prev[keep], tokens[keep], targets[keep], scores[keep]


def constrain_block(automaton: TokenAutomaton, state: int, fed: np.ndarray, block: np.ndarray, mask_id: int,
                    scores_of: Callable[[], dict[int, tuple[np.ndarray, np.ndarray]]], first: int, stop: int,
                    room_after: int | None) -> np.ndarray:
    """The block's tokens with the chosen positions' tokens decided under the constraint.

    ``state``: the automaton's state before position ``first`` (the answer's start in the
    block); ``fed``/``block``: the block's tokens before and after the rule's step;
    ``scores_of()``: each chosen position's ``class_scores`` row (best score, its token),
    asked only where the program runs;
    ``stop``: where the answer's room ends (at most the block's length); ``room_after``: the
    answer's tokens left after the block, or None where its room ends at ``stop``."""
    decided = np.flatnonzero(block[first:stop] != mask_id)
    last = first + int(decided[-1]) + 1 if decided.size else first  # the masks from here on need no pass
    room = stop - last + (room_after or 0)
    if automaton.accepts_block(state, block[first:last].tolist(), mask_id, room):
        return block  # the rule's proposals can be completed as they are: the program would keep them
    chosen_scores = scores_of()
    table = automaton.next_by_class
    states, scores = np.array([state]), np.zeros(1)
    trail: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []  # (position, targets, prev, tokens)
    for position in range(first, last):
        token = int(block[position])
        if token == mask_id:  # masked: any one token, unscored
            targets = table[states]
            allowed = targets >= 0
            values, tokens = np.broadcast_to(scores[:, None], targets.shape)[allowed], np.full(allowed.sum(), mask_id)
        elif token == fed[position] and states.size == 1:  # fixed, from one state: no choice to make
            target = int(table[states[0], automaton.token_class[token]])
            if target < 0:
                raise NoValidBlock(f"no state of the constraint reads position {position} of the block")
            trail.append((position, np.array([target]), states, np.array([token])))
            states = np.array([target])
            continue
        elif token == fed[position]:  # fixed
            targets = table[states, automaton.token_class[token]][:, None]
            allowed = targets >= 0
            values, tokens = scores[allowed[:, 0]], np.full(allowed.sum(), token)
        else:  # chosen this step
            best, best_token = chosen_scores[position]
            targets = table[states]
            allowed = (targets >= 0) & np.isfinite(best)[None, :]
            values = (scores[:, None] + best[None, :])[allowed]
            tokens = np.broadcast_to(best_token[None, :], targets.shape)[allowed]
        prev = np.broadcast_to(states[:, None], targets.shape)[allowed]
        if not prev.size:
            raise NoValidBlock(f"no state of the constraint reads position {position} of the block")
        prev, tokens, states, scores = _best_per_target(prev, tokens, targets[allowed], values)
        trail.append((position, states, prev, tokens))
    valid = automaton.to_accept[states] <= room
    if not valid.any():
        raise NoValidBlock("no completion of the block matches the constraint within the answer's room")
    best_state = int(states[np.flatnonzero(valid)[np.argmax(scores[valid])]])
    out = block.copy()
    for position, targets, prev, tokens in reversed(trail):
        at = int(np.searchsorted(targets, best_state))
        if block[position] != fed[position] and block[position] != mask_id:
            out[position] = tokens[at]
        best_state = int(prev[at])
    return out
