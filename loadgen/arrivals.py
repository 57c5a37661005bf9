"""Arrival schedules: seeded Poisson processes and JSONL trace replay."""

from __future__ import annotations

import json
import random
from pathlib import Path

from loadgen.records import Arrival, LoadgenError

MAX_REQUESTS = 10000  # default hard cap on the requests of one run


def poisson_times(rate: float, seed: int, duration_s: float | None = None, count: int | None = None,
                  max_count: int = MAX_REQUESTS) -> list[float]:
    """Send times (seconds from the start) of a Poisson process of ``rate`` per second.

    Gaps are exponential with mean 1/rate, drawn from ``random.Random(seed)``; the schedule
    ends after ``count`` arrivals, at ``duration_s``, or at ``max_count``, whichever is first.
    """
    if not rate > 0:
        raise LoadgenError(f"the rate must be positive, got {rate}")
    if duration_s is None and count is None:
        raise LoadgenError("give a bound: --duration SECONDS or --requests N")
    rng = random.Random(seed)
    limit = max_count if count is None else min(count, max_count)
    times, t = [], 0.0
    while len(times) < limit:
        t += rng.expovariate(rate)
        if duration_s is not None and t > duration_s:
            break
        times.append(t)
    return times


def tiny_prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts of the tiny model's Sudoku task, drawn like its held-out set (seeded)."""
    from replicas.tiny import task

    return [request.prompt for request in task.make_requests(n, seed)]


def shared_prefix_prompts(n: int, seed: int, shared: int = 4, groups: int = 1) -> list[str]:
    """``n`` prompts of the tiny task that begin with the same ``shared`` puzzles (as
    requests that share a system prompt or few-shot examples) and end with 1 or 2 of their
    own: a workload for the prefix cache (seeded). With ``groups`` > 1, prompt i begins
    with group i % groups's puzzles (many documents, each asked several questions)."""
    from replicas.tiny import task

    firsts = [tuple(p for request in task.make_requests(shared, seed + 1_000_003 + g) for p in request.puzzles)[:shared]
              for g in range(groups)]
    own = task.make_requests(n, seed)
    return [task.format_prompt(firsts[i % groups] + request.puzzles[:1 + i % 2]) for i, request in enumerate(own)]


WORKLOADS = {"tiny": tiny_prompts, "shared-prefix": shared_prefix_prompts}
CHAT_WORKLOAD = "chat"  # arrivals, not prompts: see ``chat_arrivals``


def chat_arrivals(times: list[float], seed: int, turns: int = 3, open_chats: int = 8) -> list[Arrival]:
    """Multi-turn chats for the prefix cache (seeded): each prompt holds the chat so far
    (the earlier turns' messages and answers) and a new message. The arrivals are dealt
    to ``open_chats`` chats at a time, one turn each in turn, so a chat's next turn comes
    ``open_chats`` arrivals after its previous one (``Arrival.after``), and a chat ends
    after ``turns`` turns. A first message is a tiny-task prompt, a later one a new
    puzzle's 16 cells (with the tiny model's 512 positions, 3 turns fit)."""
    from replicas.tiny import task

    firsts = tiny_prompts(len(times), seed)
    news = task.make_requests(len(times), seed + 1_000_003)
    arrivals = []
    for i, time_s in enumerate(times):
        turn = i % (turns * open_chats) // open_chats
        arrivals.append(Arrival(time_s, news[i].puzzles[0], after=i - open_chats) if turn
                        else Arrival(time_s, firsts[i]))
    return arrivals


def with_prompts(times: list[float], prompts: list[str]) -> list[Arrival]:
    """Pair send times with prompts, cycling through the prompts."""
    return [Arrival(t, prompts[i % len(prompts)]) for i, t in enumerate(times)]


def _trace_line(number: int, line: str) -> Arrival:
    where = f"line {number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise LoadgenError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise LoadgenError(f"{where}: expected a JSON object with timestamp, prompt and max_tokens")
    timestamp, prompt, max_tokens = item.get("timestamp"), item.get("prompt"), item.get("max_tokens")
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or timestamp < 0:
        raise LoadgenError(f"{where}: 'timestamp' must be a number of seconds >= 0, got {timestamp!r}")
    if not isinstance(prompt, str) or not prompt:
        raise LoadgenError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise LoadgenError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    return Arrival(float(timestamp), prompt, max_tokens)


def load_trace(path: str | Path, duration_s: float | None = None, count: int | None = None,
               max_count: int = MAX_REQUESTS) -> list[Arrival]:
    """Arrivals from a JSONL file, one ``{"timestamp", "prompt", "max_tokens"}`` object per line.

    Blank lines are skipped; the arrivals are sorted by timestamp and cut at ``duration_s``,
    ``count`` and ``max_count``. A bad line raises ``LoadgenError`` naming the line.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise LoadgenError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    try:
        arrivals = [_trace_line(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    except LoadgenError as exc:
        raise LoadgenError(f"trace {path}, {exc}") from None
    arrivals.sort(key=lambda a: a.time_s)
    if duration_s is not None:
        arrivals = [a for a in arrivals if a.time_s <= duration_s]
    arrivals = arrivals[:max_count if count is None else min(count, max_count)]
    if not arrivals:
        raise LoadgenError(f"trace {path} holds no requests (within the bounds given)")
    return arrivals
