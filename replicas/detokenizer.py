"""A request's output text, made block by block and emitted only once it is final.

Decoding a prefix of the ids does not always give a prefix of the text: a byte-level BPE
decodes an incomplete UTF-8 sequence as U+FFFD, transformers' clean-up of tokenization
spaces turns " ." into "." once the "." arrives, and a stop string may begin in one block
and end in the next. So ``Detokenizer.feed`` holds back, until the next block or the end:

* a trailing run of U+FFFD (an incomplete character, or a truly invalid one the end will
  show);
* with clean-up on, a trailing beginning of one of the clean-up patterns;
* a trailing beginning of a stop string.

The text emitted after some ids is a function of those ids alone, not of how they were cut
into blocks, so a continuation on another replica (``resume_ids``) knows what was emitted
before it. Each feed decodes only the new ids and ``CONTEXT_TOKENS`` before them (what a
decoder's context rules, e.g. a leading space, need): its cost follows the block, not the
answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4
MAX_IDS_PER_CHARACTER = 4  # a character is at most 4 UTF-8 bytes, and a token at least one
# what transformers' clean_up_tokenization replaces (each begins with a space)
CLEAN_UP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


def held_suffix(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper beginning of a pattern."""
    longest = 0
    for pattern in patterns:
        for size in range(min(len(pattern) - 1, len(text)), longest, -1):
            if text.endswith(pattern[:size]):
                longest = size
                break
    return longest


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """(start, end) of the stop string in ``text`` that a token-by-token reader would see
    complete first (the earliest end; of those, the longest), or None."""
    hits = [(at + len(stop), at) for stop in stops if (at := text.find(stop)) >= 0]
    if not hits:
        return None
    end, start = min(hits)
    return start, end


class Detokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = (),
                 clean_up: bool = False, resumed_ids: Sequence[int] = ()):
        """``decode``: ids -> text (special tokens skipped); ``clean_up``: whether ``decode``
        cleans up tokenization spaces; ``resumed_ids``: output another replica produced and
        emitted the text of (held text included: it is emitted again from here)."""
        self.decode = decode
        self.stops = tuple(stops)
        self.clean_up = clean_up
        self._start = 0  # the first id of the decoded window
        self._taken = 0  # characters of the window's text emitted, or held for a stop string
        self._held = ""  # taken but not emitted: maybe the beginning of a stop string
        if resumed_ids:
            self.feed(resumed_ids, 0, final=False)

    def feed(self, ids: Sequence[int], before: int, final: bool) -> tuple[str, int | None]:
        """The output is now ``ids``, of which the first ``before`` were fed already; ``final``:
        no more will come. Returns the text that became final, and where a stop string ends
        in it, the number of ids the text up to that stop needs (the output ends there: the
        stop and what follows it are not emitted)."""
        window = self.decode(ids[self._start:])
        end = len(window) if final else self._settled_end(window)
        candidate = self._held + window[self._taken:end]
        stop = first_stop(candidate, self.stops)
        if stop is not None:
            through = window[:self._taken - len(self._held) + stop[1]]
            return candidate[:stop[0]], self._ids_through(ids, through, before)
        held = 0 if final else held_suffix(candidate, self.stops)
        self._held = candidate[len(candidate) - held:]
        self._taken = end
        if not final:  # nothing follows the last feed
            self._slide(ids, window)
        return candidate[:len(candidate) - held], None

    def _slide(self, ids: Sequence[int], window: str) -> None:
        """Start the window ``CONTEXT_TOKENS`` before the ids of the text not emitted yet
        (held, or not settled), if it decodes that text the same from there."""
        pending = len(window) - self._taken + len(self._held)
        start = max(self._start, len(ids) - CONTEXT_TOKENS - MAX_IDS_PER_CHARACTER * pending)
        if start == self._start:
            return
        moved = self.decode(ids[start:])
        if min(len(moved), len(window)) > pending and moved.endswith(window[len(window) - pending - 1:]):
            self._start, self._taken = start, len(moved) - (len(window) - self._taken)

    def _settled_end(self, window: str) -> int:
        """Where the window's text stops being final (see the module docstring)."""
        end = len(window.rstrip(REPLACEMENT))
        if self.clean_up:
            end -= held_suffix(window[:end], CLEAN_UP_PATTERNS)
        return end

    def _ids_through(self, ids: Sequence[int], text: str, before: int) -> int:
        """The fewest ids (more than ``before``) whose window decodes to ``text`` and on."""
        for count in range(before + 1, len(ids)):
            if self.decode(ids[self._start:count]).startswith(text):
                return count
        return len(ids)
