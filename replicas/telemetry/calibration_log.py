"""What the capacity simulator needs from live replicas, kept with wall-clock times.

A replica records, per step, its rows, prompt units, busy period (wall time since the
previous step when the engine went straight on to this one, so it includes what the
engine thread lost to other threads and processes; None after a wait) and the steps of
the blocks it committed; per request, when it started and how many blocks it had when it
finished. The replica's monitor hands new records over with each metrics report; the
metrics actor keeps a log per replica and summarizes any recent window of it.
"""

from __future__ import annotations

from collections import Counter, deque


class CalibrationLog:
    MAX_STEPS = 16384
    MAX_REQUESTS = 4096

    def __init__(self):
        self.steps: deque[tuple] = deque(maxlen=self.MAX_STEPS)  # (t, rows, units, period, block steps)
        self.starts: deque[float] = deque(maxlen=self.MAX_REQUESTS)
        self.ends: deque[tuple[float, int]] = deque(maxlen=self.MAX_REQUESTS)  # (t, blocks)

    def extend(self, records: dict) -> None:
        """Add records as ``take_new`` of another log hands them out."""
        self.steps.extend(tuple(s) for s in records["steps"])
        self.starts.extend(records["starts"])
        self.ends.extend(tuple(e) for e in records["ends"])

    def take_new(self) -> dict:
        """All records as plain lists, and empty the log (a replica's hand-over)."""
        records = {"steps": list(self.steps), "starts": list(self.starts), "ends": list(self.ends)}
        self.steps.clear()
        self.starts.clear()
        self.ends.clear()
        return records

    def summary(self, since: float) -> dict:
        """Since wall time ``since``: busy step periods as (rows, prompt units, seconds),
        steps per block, blocks per finished request, prompt units computed, requests started."""
        steps = [s for s in self.steps if s[0] >= since]
        return {"step_periods": [(rows, units, period) for _, rows, units, period, _ in steps if period is not None],
                "steps_per_block": dict(Counter(n for *_, block_steps in steps for n in block_steps)),
                "blocks_per_request": dict(Counter(blocks for t, blocks in self.ends if t >= since)),
                "prefix_units": sum(s[2] for s in steps),
                "requests_started": sum(1 for t in self.starts if t >= since)}
