"""Per-step statistics of the engine and their running totals."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)  # made every step, after its clock stopped: slots make it cheap
class StepStats:
    batch_size: int  # rows in the forward (idle baseline rows included)
    active_rows: int  # rows the algorithm advanced
    num_tokens: int  # new tokens in the forward
    forward_s: float
    step_s: float  # the whole engine step, scheduling and commit included
    waiting: int  # queue lengths after the step
    running: int
    blocks_committed: int
    block_steps: tuple[int, ...]  # steps taken by each block committed this step
    prefix_units: int = 0  # page-sized units besides the block units: prompt chunks and commit writes
    prompt_pages: int = 0  # of those, the prompt pages (prefill)
    forward_cpu_s: float = 0.0  # CPU time of the engine thread in the forward (its intra-op threads' not counted)
    step_cpu_s: float = 0.0  # CPU time of the engine thread in the whole step

    @property
    def overhead_s(self) -> float:
        return self.step_s - self.forward_s


@dataclass
class EngineTotals:
    """Running totals since the engine started (the metrics exporter reads these)."""

    steps: int = 0
    forward_s: float = 0.0
    step_s: float = 0.0
    output_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    requests_timed_out: int = 0

    def record(self, stats: StepStats) -> None:
        self.steps += 1
        self.forward_s += stats.forward_s
        self.step_s += stats.step_s

    @property
    def compute_ratio(self) -> float:
        return self.forward_s / self.step_s if self.step_s else 0.0
