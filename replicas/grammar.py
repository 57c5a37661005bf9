"""Constrained answers: a regular expression over the answer's text, as an automaton over
the model's tokens.

A constraint reaches the engine as a regular expression (the ingress turns a JSON schema,
a choice list or a client's regex into one). ``Grammars`` compiles it with outlines-core
(``Index``: a deterministic automaton whose transitions are the tokens whose bytes the
regex can read from that state) into a ``TokenAutomaton`` and keeps the last ones
compiled. ``replicas.constrained_block`` decodes a block under it.

The automaton adds one state of its own, ``ended``: an end id (EOS) read in an accepting
state leads there, and there any token goes (the text after an end id is never part of the
answer). Every state knows the fewest tokens that reach an accepting state from it
(``to_accept``): a diffusion canvas has a fixed length, so a block may end only in a state
the rest of the answer's room can still complete.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np
from outlines_core import Index, Vocabulary

from replicas.messages import RequestError
from replicas.token_bytes import token_bytes

COMPILED_KEPT = 64  # automata a replica keeps compiled (by regex)
MAX_STATES = 20_000  # a larger automaton is refused (a schema or regex that explodes)
MAX_REGEX_CHARS = 65_536
UNREACHABLE = np.iinfo(np.int64).max


class ConstraintError(RequestError):
    """A constraint that cannot be compiled for this model (a 400 naming ``response_format``)."""


def _ranges(start: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For compressed rows (``start``: each row's first entry, then the end), the entries of
    ``states``' rows, and how many each has."""
    counts = start[states + 1] - start[states]
    first = np.repeat(start[states] - (np.cumsum(counts) - counts), counts)
    return first + np.arange(int(counts.sum())), counts


class TokenAutomaton:
    """States numbered 0..S-1 (``ended`` = S), and in compressed rows per state: the tokens
    allowed there and where each leads (``move_*``, by token), the states one token of any
    kind leads to (``next_*``); whether each state accepts and its distance to acceptance."""

    def __init__(self, index: Index, end_ids: Sequence[int]):
        transitions = index.get_transitions()
        finals = index.get_final_states()
        ids = {state: i for i, state in enumerate(sorted(set(transitions) | finals | {index.get_initial_state()}))}
        self.ended = len(ids)
        self.start = ids[index.get_initial_state()]
        self.end_ids = np.array(sorted(set(end_ids)), dtype=np.int64)
        ends = set(self.end_ids.tolist())
        self.accepting = np.zeros(self.ended + 1, dtype=bool)
        self.accepting[[ids[state] for state in finals]] = True
        self.accepting[self.ended] = True
        moves: list[tuple[int, int, int]] = []  # (state, token, target)
        for state, row in transitions.items():
            moves += [(ids[state], token, ids[target]) for token, target in row.items() if token not in ends]
        for state in np.flatnonzero(self.accepting[:-1]).tolist():  # an end id ends the answer
            moves += [(state, token, self.ended) for token in ends]
        moves.sort()
        table = np.array(moves, dtype=np.int64).reshape(-1, 3)
        self.move_start = np.searchsorted(table[:, 0], np.arange(self.ended + 2))
        self.move_token, self.move_target = table[:, 1].copy(), table[:, 2].copy()
        # one token of any kind: each state's distinct targets (from ``ended``: itself)
        pairs = np.unique(np.concatenate([table[:, [0, 2]], [[self.ended, self.ended]]]), axis=0)
        self.next_start = np.searchsorted(pairs[:, 0], np.arange(self.ended + 2))
        self.next_state_of = pairs[:, 1].copy()
        self.to_accept = self._distances(pairs)

    @property
    def num_states(self) -> int:
        return self.ended + 1

    def _distances(self, pairs: np.ndarray) -> np.ndarray:
        """Fewest tokens from each state to an accepting one (breadth-first, backwards)."""
        before: list[list[int]] = [[] for _ in range(self.num_states)]
        for q, target in pairs.tolist():
            before[target].append(q)
        distance = np.full(self.num_states, UNREACHABLE, dtype=np.int64)
        queue = deque(np.flatnonzero(self.accepting).tolist())
        distance[list(queue)] = 0
        while queue:
            q = queue.popleft()
            for earlier in before[q]:
                if distance[earlier] == UNREACHABLE:
                    distance[earlier] = distance[q] + 1
                    queue.append(earlier)
        return distance

    def moves(self, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The entries of ``states``' allowed tokens (into ``move_token``/``move_target``),
        and how many each state has (``ended``: none; any token goes there)."""
        return _ranges(self.move_start, states)

    def successors(self, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The states one token of any kind leads to from each of ``states``, and how many."""
        entries, counts = _ranges(self.next_start, states)
        return self.next_state_of[entries], counts

    def next_state(self, state: int, token: int) -> int | None:
        """Where ``token`` leads from ``state``; None where it is not allowed."""
        if state == self.ended:
            return state
        low, high = self.move_start[state], self.move_start[state + 1]
        at = low + int(np.searchsorted(self.move_token[low:high], token))
        return int(self.move_target[at]) if at < high and self.move_token[at] == token else None

    def walk(self, state: int, tokens: Iterable[int]) -> int | None:
        """The state after ``tokens``; None where one is not allowed."""
        for token in tokens:
            state = self.next_state(state, token)
            if state is None:
                return None
        return state


class Grammars:
    """One model's vocabulary as outlines-core reads it (each token's bytes; the end ids,
    the mask and the special tokens left out, so none of them is ever text), and the
    automata of the regexes asked lately."""

    def __init__(self, tokenizer, end_ids: Sequence[int], excluded_ids: Iterable[int] = ()):
        self.end_ids = tuple(sorted(set(end_ids)))
        self._tokenizer = tokenizer
        self._excluded = set(excluded_ids) | set(self.end_ids) | set(getattr(tokenizer, "all_special_ids", ()))
        self.automaton = functools.lru_cache(maxsize=COMPILED_KEPT)(self._compile)

    @functools.cached_property
    def vocabulary(self) -> Vocabulary:
        bytes_of = token_bytes(self._tokenizer)
        by_bytes: dict[bytes, list[int]] = {}
        for token_id in range(len(self._tokenizer)):
            if token_id not in self._excluded:
                piece = bytes_of(token_id)
                if piece:
                    by_bytes.setdefault(piece, []).append(token_id)
        # outlines-core wants one EOS id outside the map; the automaton adds every end id itself
        eos = self.end_ids[0] if self.end_ids else max(self._excluded, default=len(self._tokenizer))
        return Vocabulary(eos, by_bytes)

    def _compile(self, regex: str) -> TokenAutomaton:
        """The automaton of ``regex`` (raises ConstraintError)."""
        if len(regex) > MAX_REGEX_CHARS:
            raise ConstraintError(f"the constraint's regular expression has {len(regex)} characters; "
                                  f"at most {MAX_REGEX_CHARS}")
        try:
            index = Index(regex, self.vocabulary)
        except (ValueError, RuntimeError) as exc:
            raise ConstraintError(f"cannot be compiled for this model's vocabulary: {exc}") from None
        states = len(index.get_transitions())
        if states > MAX_STATES:
            raise ConstraintError(f"the constraint needs {states} automaton states; at most {MAX_STATES}")
        return TokenAutomaton(index, self.end_ids)

    def compile_quietly(self, regex: str) -> None:
        """Compile ``regex`` into the kept automata, where it compiles (``begin`` says why not)."""
        try:
            self.automaton(regex)
        except ConstraintError:
            pass

    def begin(self, regex: str, max_tokens: int, resumed: Sequence[int] = ()) -> tuple[TokenAutomaton, int]:
        """The automaton of ``regex`` and its state after ``resumed`` (a continuation's
        output so far); refused where no answer of ``max_tokens`` tokens (``resumed``
        included) can match."""
        automaton = self.automaton(regex)
        state = automaton.walk(automaton.start, resumed)
        if state is None:
            raise ConstraintError("the resumed output does not match the constraint")
        shortest = int(automaton.to_accept[state])
        if shortest == UNREACHABLE:
            raise ConstraintError("no text this model's tokens can spell matches the constraint")
        if shortest > max_tokens - len(resumed):
            raise ConstraintError(f"the shortest answer that matches the constraint has "
                                  f"{shortest + len(resumed)} tokens; max_tokens is {max_tokens}")
        return automaton, state
