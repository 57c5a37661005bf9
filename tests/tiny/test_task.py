"""The Sudoku canvas task: grids, unique puzzles, request layout, grading, held-out split."""

import numpy as np

from replicas.tiny import task


def test_all_grids_are_the_288_valid_sudokus():
    grids = task.all_grids()
    assert grids.shape == (288, 16)
    assert len({tuple(g) for g in grids.tolist()}) == 288
    for g in grids.reshape(-1, 4, 4):
        groups = [g[i] for i in range(4)] + [g[:, i] for i in range(4)]
        groups += [g[r:r + 2, c:c + 2].flatten() for r in (0, 2) for c in (0, 2)]
        assert all(sorted(x.tolist()) == [1, 2, 3, 4] for x in groups)


def test_sampled_puzzles_have_a_unique_solution_at_every_blank_count():
    generator = np.random.default_rng(0)
    for blanks in range(task.MAX_BLANKS + 1):
        weights = np.zeros(task.MAX_BLANKS + 1)
        weights[blanks] = 1
        givens, solutions = task.sample_puzzles(50, generator, weights)
        assert ((givens == 0).sum(-1) == blanks).all()
        assert (task.solutions_of(givens).sum(-1) == 1).all()
        assert ((givens == solutions) | (givens == 0)).all()


def test_sampling_excludes_given_keys():
    generator = np.random.default_rng(1)
    weights = np.zeros(task.MAX_BLANKS + 1)
    weights[0] = 1  # only 288 possible puzzles: exclude all but one grid
    grids = task.all_grids()
    givens, _ = task.sample_puzzles(20, generator, weights, exclude=task.puzzle_keys(grids[1:]))
    assert (givens == grids[0]).all()


def test_requests_are_seeded_and_span_one_to_six_puzzles():
    a, b = task.make_requests(200, seed=3), task.make_requests(200, seed=3)
    assert a == b
    assert {len(r.puzzles) for r in a} == set(range(1, 7))
    blanks = {p.count(task.BLANK) for r in a for p in r.puzzles}
    assert blanks == set(range(task.MAX_BLANKS + 1))


def test_prompt_is_a_seven_slot_canvas():
    request = task.make_requests(1, seed=5)[0]
    cells = "".join(request.prompt.split())
    assert len(cells) == 112
    k = len(request.puzzles)
    for j in range(7):
        slot = cells[16 * j:16 * (j + 1)]
        assert slot == (request.puzzles[j] if j < k else "-" * 16)


def test_grade_reads_grids_in_order():
    request = task.Request(("12.4" * 4, "...." * 4), ("1234" * 4, "4321" * 4))
    assert task.grade(request, request.answer) == [True, True]
    assert task.grade(request, " ".join([request.answer, "[EOS]"])) == [True, True]
    assert task.grade(request, "1234" * 4 + "4321" * 3 + "4312") == [True, False]
    assert task.grade(request, "1234" * 4) == [True, False]
    assert task.grade(request, "1234" * 3 + "[EOS]" + "4321" * 4) == [False, False]


def test_heldout_set_is_fixed_and_excluded_from_training():
    heldout = task.heldout_requests()
    assert len(heldout) >= 300
    keys = task.heldout_keys()
    generator = np.random.default_rng(0)
    givens, _ = task.sample_puzzles(2000, generator, exclude=keys)
    assert not np.isin(task.puzzle_keys(givens), keys).any()
