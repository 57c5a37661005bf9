"""Poisson schedules and trace parsing."""

import json
import statistics

import pytest

from loadgen.arrivals import (chat_arrivals, load_trace, poisson_times, shared_prefix_prompts, tiny_prompts,
                              with_prompts)
from loadgen.records import LoadgenError


def test_poisson_gaps_have_mean_one_over_rate_and_are_exponential():
    rate = 4.0
    times = poisson_times(rate, seed=7, count=20000, max_count=20000)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert len(times) == 20000 and all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.05)  # exponential: std = mean


def test_poisson_schedule_is_deterministic_by_seed():
    assert poisson_times(10, seed=1, count=500) == poisson_times(10, seed=1, count=500)
    assert poisson_times(10, seed=1, count=500) != poisson_times(10, seed=2, count=500)
    # a duration bound cuts the same sequence
    long = poisson_times(10, seed=1, count=500)
    assert poisson_times(10, seed=1, duration_s=5) == [t for t in long if t <= 5]


def test_poisson_bounds_and_hard_cap():
    by_time = poisson_times(50, seed=0, duration_s=20)
    assert max(by_time) <= 20 and len(by_time) == pytest.approx(1000, rel=0.1)
    assert len(poisson_times(50, seed=0, count=30)) == 30
    assert len(poisson_times(50, seed=0, duration_s=20, max_count=100)) == 100
    assert len(poisson_times(50, seed=0, count=300, max_count=100)) == 100
    with pytest.raises(LoadgenError, match="bound"):
        poisson_times(5, seed=0)
    with pytest.raises(LoadgenError, match="positive"):
        poisson_times(0, seed=0, count=3)


def test_prompts_are_the_tiny_task_and_cycle():
    prompts = tiny_prompts(4, seed=0)
    assert prompts == tiny_prompts(4, seed=0) and len(set(prompts)) == 4
    assert all(len("".join(p.split())) == 112 for p in prompts)  # 7 slots of 16 cells
    arrivals = with_prompts([0.1, 0.2, 0.3], ["a", "b"])
    assert [(a.time_s, a.prompt, a.max_tokens) for a in arrivals] == [(0.1, "a", None), (0.2, "b", None),
                                                                     (0.3, "a", None)]


def test_shared_prefix_prompts_begin_alike_and_end_their_own_way():
    prompts = shared_prefix_prompts(20, seed=0)
    cells = ["".join(p.split()) for p in prompts]
    assert prompts == shared_prefix_prompts(20, seed=0) and all(len(c) == 112 for c in cells)
    assert len({c[:64] for c in cells}) == 1 and len({c[64:] for c in cells}) == 20  # 4 puzzles of 16 cells
    alone = sum(c[80:96] == "-" * 16 for c in cells)  # then 1 or 2 puzzles of their own
    assert 10 <= alone < 20 and all(c[96:] == "-" * 16 for c in cells)
    grouped = ["".join(p.split())[:64] for p in shared_prefix_prompts(20, seed=0, groups=3)]
    assert grouped[0] == cells[0][:64] and len(set(grouped)) == 3 and grouped[:3] == grouped[3:6]


def test_chat_arrivals_deal_turns_to_open_chats():
    times = [0.1 * i for i in range(20)]
    arrivals = chat_arrivals(times, seed=0, turns=3, open_chats=4)
    assert arrivals == chat_arrivals(times, seed=0, turns=3, open_chats=4) and [a.time_s for a in arrivals] == times
    firsts = [i for i, a in enumerate(arrivals) if a.after is None]
    assert firsts == [0, 1, 2, 3, 12, 13, 14, 15]  # 4 chats of 3 turns, then 4 more
    assert all(arrivals[i].after == i - 4 for i in range(20) if i not in firsts)
    assert all(len("".join(arrivals[i].prompt.split())) == 112 for i in firsts)  # a tiny-task prompt
    assert all(len(arrivals[i].prompt) == 16 for i in range(20) if i not in firsts)  # a new puzzle


def write(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_is_sorted_and_cut(tmp_path):
    path = write(tmp_path, [json.dumps({"timestamp": 2.5, "prompt": "late", "max_tokens": 16}), "",
                            json.dumps({"timestamp": 0, "prompt": "first"}),
                            json.dumps({"timestamp": 1, "prompt": "middle", "max_tokens": 32, "other": 1})])
    arrivals = load_trace(path)
    assert [(a.time_s, a.prompt, a.max_tokens) for a in arrivals] == [
        (0.0, "first", None), (1.0, "middle", 32), (2.5, "late", 16)]
    assert [a.prompt for a in load_trace(path, duration_s=2)] == ["first", "middle"]
    assert [a.prompt for a in load_trace(path, count=1)] == ["first"]
    assert [a.prompt for a in load_trace(path, max_count=2)] == ["first", "middle"]


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    ('{"prompt": "x"}', "line 2: 'timestamp' must be a number"),
    ('{"timestamp": -1, "prompt": "x"}', "line 2: 'timestamp' must be a number of seconds >= 0"),
    ('{"timestamp": true, "prompt": "x"}', "line 2: 'timestamp'"),
    ('{"timestamp": 1}', "line 2: 'prompt' must be a non-empty string"),
    ('{"timestamp": 1, "prompt": ""}', "line 2: 'prompt'"),
    ('{"timestamp": 1, "prompt": "x", "max_tokens": 0}', "line 2: 'max_tokens' must be a positive integer"),
    ('{"timestamp": 1, "prompt": "x", "max_tokens": 1.5}', "line 2: 'max_tokens'"),
])
def test_bad_trace_lines_are_named(tmp_path, line, message):
    path = write(tmp_path, ['{"timestamp": 0, "prompt": "ok"}', line])
    with pytest.raises(LoadgenError, match=message) as info:
        load_trace(path)
    assert str(path) in str(info.value)


def test_missing_or_empty_trace(tmp_path):
    with pytest.raises(LoadgenError, match="cannot read trace"):
        load_trace(tmp_path / "absent.jsonl")
    with pytest.raises(LoadgenError, match="no requests"):
        load_trace(write(tmp_path, [""]))
    with pytest.raises(LoadgenError, match="no requests"):
        load_trace(write(tmp_path, ['{"timestamp": 9, "prompt": "x"}']), duration_s=1)
