"""The tiny model's task: batches of 4x4 Sudoku puzzles, one answer block per puzzle.

A request holds k in 1..6 puzzles. Its prompt is a fixed canvas of 7 slots x 16 cells
(112 tokens, exactly 7 blocks): slot j < k holds puzzle j row-major ('1'-'4' givens,
'.' blanks) and the other slots are empty ('-' x 16; slot 6 is always empty). The answer
is one block per puzzle, the solved grid, then a block of 16 EOS (empty slot -> EOS), so
answer block j sits exactly 112 positions after prompt slot j.

Every puzzle has a unique solution; blank counts run from 0 (a pure copy) to 12 (four
givens, the fewest a 4x4 Sudoku with a unique solution can have).

numpy only: the load generator draws its prompts here; training turns them into tensors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

CELLS = 16
SLOTS = 7
MAX_PUZZLES = SLOTS - 1
MAX_BLANKS = 12
BLANK = "."
EMPTY = "-"
MAX_TOKENS = SLOTS * CELLS  # room for six grids and the EOS block; the model decides where to stop
HELDOUT_FILE = Path(__file__).with_name("heldout.txt")
HELDOUT_REQUESTS = 400


@lru_cache(maxsize=1)
def all_grids() -> np.ndarray:
    """Every solved 4x4 Sudoku grid as ``int64[288, 16]`` of digits 1-4, row-major."""
    rows = list(itertools.permutations(range(1, 5)))

    def fits(grid: tuple, row: tuple) -> bool:
        r = len(grid)
        box_above = grid[r - 1] if r % 2 else None
        return all(row[c] != above[c] for above in grid for c in range(4)) and (
            box_above is None
            or all(row[c] not in box_above[c - c % 2:c - c % 2 + 2] for c in range(4))
        )

    grids = [()]
    for _ in range(4):
        grids = [grid + (row,) for grid in grids for row in rows if fits(grid, row)]
    table = np.array([[d for row in grid for d in row] for grid in grids], dtype=np.int64)
    table.flags.writeable = False
    return table


def solutions_of(givens: np.ndarray) -> np.ndarray:
    """Match matrix ``bool[N, 288]`` for givens ``int[N, 16]`` (0 = blank)."""
    grids = all_grids()
    fits = (grids[None] == givens[:, None]) | (givens[:, None] == 0)
    return fits.all(-1)


def puzzle_keys(givens: np.ndarray) -> np.ndarray:
    """One int64 per puzzle (base-5 digits of its cells), for exclusion sets."""
    powers = 5 ** np.arange(CELLS, dtype=np.int64)
    return (np.asarray(givens, dtype=np.int64) * powers).sum(-1)


def sample_puzzles(
    n: int,
    rng: np.random.Generator,
    blank_weights: np.ndarray | None = None,
    exclude: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random puzzles with a unique solution: ``(givens, solutions)``, each ``int64[n, 16]``.

    Blank counts are drawn from ``blank_weights`` (13 weights for 0..12 blanks, uniform
    when None); a puzzle with several solutions, or whose key is in ``exclude``, is
    redrawn with the same blank count.
    """
    weights = np.ones(MAX_BLANKS + 1) if blank_weights is None else np.asarray(blank_weights, dtype=float)
    grids = all_grids()
    givens = np.zeros((n, CELLS), dtype=np.int64)
    solutions = np.zeros((n, CELLS), dtype=np.int64)
    blank_counts = rng.choice(MAX_BLANKS + 1, size=n, p=weights / weights.sum())
    todo = np.arange(n)
    while todo.size:
        m = todo.size
        grid = grids[rng.integers(len(grids), size=m)]
        order = rng.random((m, CELLS)).argsort(-1)
        blank = np.zeros((m, CELLS), dtype=bool)
        np.put_along_axis(blank, order, np.arange(CELLS)[None] < blank_counts[todo][:, None], axis=1)
        candidate = np.where(blank, 0, grid)
        ok = solutions_of(candidate).sum(-1) == 1
        if exclude is not None:
            ok &= ~np.isin(puzzle_keys(candidate), exclude)
        givens[todo[ok]] = candidate[ok]
        solutions[todo[ok]] = grid[ok]
        todo = todo[~ok]
    return givens, solutions


def cells_text(cells: np.ndarray) -> str:
    """16 digits (0 = blank) -> '1.3.' style text."""
    return "".join(BLANK if d == 0 else str(d) for d in cells.tolist())


def text_cells(text: str) -> list[int]:
    """'1.3.' style text -> 16 digits (0 = blank)."""
    return [0 if c == BLANK else int(c) for c in text]


@dataclass(frozen=True)
class Request:
    puzzles: tuple[str, ...]  # each 16 chars, '1'-'4' or '.'
    solutions: tuple[str, ...]  # each 16 chars, '1'-'4'

    @property
    def prompt(self) -> str:
        return format_prompt(self.puzzles)

    @property
    def answer(self) -> str:
        return format_answer(self.solutions)


def format_prompt(puzzles: tuple[str, ...] | list[str]) -> str:
    """The 7-slot canvas, rows of 4 cells separated by spaces (whitespace is not tokenized)."""
    if not 1 <= len(puzzles) <= MAX_PUZZLES:
        raise ValueError(f"a request holds 1..{MAX_PUZZLES} puzzles, got {len(puzzles)}")
    slots = list(puzzles) + [EMPTY * CELLS] * (SLOTS - len(puzzles))
    return " ".join(slot[r:r + 4] for slot in slots for r in range(0, CELLS, 4))


def format_answer(solutions: tuple[str, ...] | list[str]) -> str:
    """The expected output text (without the final EOS block): the solved grids in order."""
    return "".join(solutions)


def make_requests(n: int, seed: int, blank_weights: np.ndarray | None = None) -> list[Request]:
    """``n`` requests with k uniform in 1..6 and blank counts drawn from ``blank_weights``
    (see ``sample_puzzles``; default uniform in 0..12), seeded."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, MAX_PUZZLES + 1, size=n).tolist()
    givens, solutions = sample_puzzles(sum(counts), rng, blank_weights=blank_weights)
    requests, start = [], 0
    for k in counts:
        requests.append(Request(
            tuple(cells_text(g) for g in givens[start:start + k]),
            tuple(cells_text(s) for s in solutions[start:start + k]),
        ))
        start += k
    return requests


@lru_cache(maxsize=1)
def heldout_requests() -> tuple[Request, ...]:
    """The fixed held-out evaluation set (``heldout.txt``, drawn once: one request per
    line, its puzzles separated by spaces); training never sees any of its puzzles."""
    requests = []
    for line in HELDOUT_FILE.read_text().splitlines():
        puzzles = tuple(line.split())
        givens = np.array([text_cells(p) for p in puzzles])
        solutions = all_grids()[solutions_of(givens).argmax(-1)]
        requests.append(Request(puzzles, tuple(cells_text(s) for s in solutions)))
    return tuple(requests)


def heldout_keys() -> np.ndarray:
    """Keys of every held-out puzzle, to exclude from training."""
    return np.unique(puzzle_keys(np.array([text_cells(p) for r in heldout_requests() for p in r.puzzles])))


def grade(request: Request, output_text: str) -> list[bool]:
    """Per-puzzle correctness of generated text: whitespace is ignored, the grids are read
    in order, 16 characters each, up to the first EOS marker if the text contains one."""
    text = "".join(output_text.split()).split("[EOS]", 1)[0]
    return [text[16 * j:16 * (j + 1)] == s for j, s in enumerate(request.solutions)]
