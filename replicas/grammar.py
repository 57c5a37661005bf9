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
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from outlines_core import Index, Vocabulary

from replicas.messages import RequestError
from replicas.token_bytes import token_bytes

COMPILED_KEPT = 64  # automata a replica keeps compiled (by regex)
MAX_STATES = 20_000  # a larger automaton is refused (a schema or regex that explodes)
MAX_REGEX_CHARS = 65_536
UNREACHABLE = np.iinfo(np.int64).max
# a structured answer ends at an end id in an accepting state: the text after one is no answer
IGNORE_EOS_UNSTRUCTURED = "ignore_eos cannot be used with a structured answer: its end is the structure's"


# characters to compile a structure after (``Grammars._lead``), the likeliest to help first:
# control characters, then marks JSON and most regexes do not use
LEADS = [bytes([b]) for b in range(1, 32) if b not in (9, 10, 13)] + [c.encode() for c in "~`^|!;=_"]


class ConstraintError(RequestError):
    """A constraint that cannot be served (a 400); ``param``: the field at fault where it
    is not the structure's own (``max_tokens``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class TokenAutomaton:
    """States numbered 0..S-1 (``ended`` = S); tokens in *classes*, the tokens that lead
    from every state to the same state (a JSON schema's automaton over a 150K-token
    vocabulary has a few hundred: the DP runs over states x classes, not x tokens).

    ``token_class[t]``: the class of token ``t`` (the tokens the constraint never reads
    share one, allowed only in ``ended``); ``next_by_class[q, c]``: where class ``c`` leads
    from ``q``, -1 where it is not allowed; ``accepting[q]``; ``to_accept[q]``: the fewest
    tokens from ``q`` to an accepting state."""

    def __init__(self, index: Index, end_ids: Sequence[int], vocab_size: int, start: int):
        """``start``: the index's state that the answer starts in."""
        transitions = index.get_transitions()
        finals = index.get_final_states()
        ids = {state: i for i, state in enumerate(sorted(set(transitions) | finals | {index.get_initial_state()}))}
        self.ended = len(ids)
        self.start = ids[start]
        self.end_ids = np.array(sorted(set(end_ids)), dtype=np.int64)
        ends = set(self.end_ids.tolist())
        self.accepting = np.zeros(self.ended + 1, dtype=bool)
        self.accepting[[ids[state] for state in finals]] = True
        self.accepting[self.ended] = True
        moves = [(ids[state], token, ids[target]) for state, row in transitions.items()
                 for token, target in row.items() if token not in ends]
        moves += [(state, token, self.ended) for state in np.flatnonzero(self.accepting[:-1]).tolist()
                  for token in ends]  # an end id ends the answer
        table = np.array(moves, dtype=np.int64).reshape(-1, 3)
        states, tokens, targets = table[:, 0], table[:, 1], table[:, 2]
        # a token's class: a hash of the (state, target) pairs it has (random 64-bit mixing)
        mix = np.random.default_rng(0).integers(1, 2**63, size=(2, self.ended + 1), dtype=np.uint64)
        signature = np.zeros(max(vocab_size, int(tokens.max(initial=-1)) + 1), dtype=np.uint64)
        with np.errstate(over="ignore"):
            np.add.at(signature, tokens, mix[0][states] * mix[1][targets])
        _, self.token_class = np.unique(signature, return_inverse=True)
        self.token_class = self.token_class.astype(np.int64)
        classes = int(self.token_class.max()) + 1
        self.next_by_class = np.full((self.ended + 1, classes), -1, dtype=np.int64)
        self.next_by_class[states, self.token_class[tokens]] = targets
        self.next_by_class[self.ended] = self.ended  # any token goes once the answer ended
        self.to_accept = self._distances()
        # where one token of any kind leads from each state (the masks of ``accepts_block``)
        self.successors = [frozenset(np.unique(row[row >= 0]).tolist()) for row in self.next_by_class]

    @property
    def num_states(self) -> int:
        return self.ended + 1

    @property
    def num_classes(self) -> int:
        return self.next_by_class.shape[1]

    def _distances(self) -> np.ndarray:
        """Fewest tokens from each state to an accepting one (breadth-first, backwards)."""
        before: list[list[int]] = [[] for _ in range(self.num_states)]
        for q, row in enumerate(self.next_by_class):
            for target in np.unique(row[row >= 0]).tolist():
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

    def next_state(self, state: int, token: int) -> int | None:
        """Where ``token`` leads from ``state``; None where it is not allowed."""
        target = int(self.next_by_class[state, self.token_class[token]])
        return None if target < 0 else target

    def accepts_block(self, state: int, tokens: Sequence[int], mask_id: int, room_after: int) -> bool:
        """Whether ``tokens`` (masks standing for any one token each) can be read from
        ``state`` into a state at most ``room_after`` tokens from acceptance: a walk over the
        set of states the masks may lead to (a few, mostly), no scores."""
        frontier = {state}
        for token in tokens:
            if token == mask_id:
                frontier = frozenset().union(*(self.successors[q] for q in frontier))
            else:
                column = self.next_by_class[:, self.token_class[token]]
                frontier = {target for q in frontier if (target := int(column[q])) >= 0}
            if not frontier:
                return False
        return any(self.to_accept[q] <= room_after for q in frontier)

    def check_room(self, state: int, max_tokens: int, spent: int = 0) -> None:
        """Raise ConstraintError where no answer of ``max_tokens`` tokens, ``spent`` of them
        already read (into ``state``), can match."""
        shortest = int(self.to_accept[state])
        if shortest == UNREACHABLE:
            raise ConstraintError("no text this model's tokens can spell matches the structure")
        if shortest > max_tokens - spent:
            raise ConstraintError(f"the shortest answer that matches the structure has {shortest + spent} tokens; "
                                  f"max_tokens is {max_tokens}", param="max_tokens")

    def walk(self, state: int, tokens: Iterable[int]) -> int | None:
        """The state after ``tokens``; None where one is not allowed."""
        for token in tokens:
            state = self.next_state(state, token)
            if state is None:
                return None
        return state


def compile_index(regex: str, vocabulary: Vocabulary) -> Index:
    """outlines-core's automaton of ``regex`` over ``vocabulary`` (raises ConstraintError)."""
    try:
        return Index(regex, vocabulary)
    except (ValueError, RuntimeError) as exc:
        raise ConstraintError(f"cannot be compiled for this model's vocabulary: {exc}") from None


class Grammars:
    """One model's vocabulary as outlines-core reads it (each token's bytes; the end ids,
    the mask and the special tokens left out, so none of them is ever text), and the
    automata of the regexes asked lately."""

    def __init__(self, tokenizer, end_ids: Sequence[int], excluded_ids: Iterable[int] = (), vocab_size: int = 0,
                 index_of: Callable[[str, Vocabulary], Index] | None = None):
        """``vocab_size``: the model's (its logits'), where larger than the tokenizer's;
        ``index_of(regex, vocabulary)``: outlines-core's automaton of a regex (raises
        ConstraintError; default ``index_of``: in this process)."""
        self.index_of = index_of or compile_index
        self.end_ids = tuple(sorted(set(end_ids)))
        self._vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._excluded = set(excluded_ids) | set(self.end_ids) | set(getattr(tokenizer, "all_special_ids", ()))
        self.automaton = functools.lru_cache(maxsize=COMPILED_KEPT)(self.compile)

    @functools.cached_property
    def _pieces(self) -> dict[bytes, list[int]]:
        """The ids of each token text (several ids may spell the same bytes)."""
        bytes_of = token_bytes(self._tokenizer)
        by_bytes: dict[bytes, list[int]] = {}
        for token_id in range(len(self._tokenizer)):
            if token_id not in self._excluded:
                piece = bytes_of(token_id)
                if piece:
                    by_bytes.setdefault(piece, []).append(token_id)
        return by_bytes

    @functools.cached_property
    def vocabulary(self) -> Vocabulary:
        # outlines-core wants one EOS id outside the map; the automaton adds every end id itself
        eos = self.end_ids[0] if self.end_ids else max(self._excluded, default=len(self._tokenizer))
        return Vocabulary(eos, self._pieces)

    @functools.cached_property
    def _lead(self) -> tuple[str, int] | None:
        """An ASCII character one token spells alone, which the fewest tokens start with (as a
        regex, and that token), or None. outlines-core builds an automaton whose start state
        many tokens leave in seconds (16 s for a top-level ``anyOf`` of a bounded string, an
        integer and null at a 1,793-token vocabulary; 6 s for ``json_object``), and the same
        one after a leading character in milliseconds: the automaton of ``c + regex`` from the
        state after ``c`` is the regex's. Not after a space (``json_object`` took 16.7 s
        after one, 0.9-1.0 s after ``~``, ``a`` or ``!`` at a 256-character vocabulary)."""
        starts = Counter(piece[:1] for piece in self._pieces)
        singles = [piece for piece in self._pieces if len(piece) == 1 and piece in LEADS]
        if not singles:
            return None
        lead = min(singles, key=lambda piece: (starts[piece], LEADS.index(piece)))
        return f"\\x{{{lead[0]:02x}}}", self._pieces[lead][0]

    def compile(self, regex: str) -> TokenAutomaton:
        """The automaton of ``regex``, compiled now (``automaton``: kept); raises ConstraintError."""
        if len(regex) > MAX_REGEX_CHARS:
            raise ConstraintError(f"the constraint's regular expression has {len(regex)} characters; "
                                  f"at most {MAX_REGEX_CHARS}")
        lead, lead_token = self._lead or ("", None)
        index = self.index_of(lead + regex, self.vocabulary)
        states = len(index.get_transitions())
        if states > MAX_STATES:
            raise ConstraintError(f"the constraint needs {states} automaton states; at most {MAX_STATES}")
        start = index.get_initial_state()
        if lead_token is not None:
            start = index.get_next_state(start, lead_token)
        return TokenAutomaton(index, self.end_ids, max(self._vocab_size, len(self._tokenizer)), start)

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
        automaton.check_room(state, max_tokens, len(resumed))
        return automaton, state
