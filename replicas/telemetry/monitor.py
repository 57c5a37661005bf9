"""What a replica knows about its own load, for routing, autoscaling and metrics.

Step statistics arrive from the engine thread (``on_step``); request events from the
replica's event loop. ``report()`` hands out what accumulated since the last report
(the metrics actor adds it to its counters and histograms); ``routing_stats()`` and
``autoscaling_stats()`` are snapshots.

Step debt is the work the replica still owes, in row-steps (one row advanced by one
step): for every live request, its admission cost minus the steps it already took.
Routing stats also carry the replica's ``DrainModel`` (step cost c0 + c1·rows, max_batch,
the largest batch measured: keys c0, c1, max_batch, measured_rows, once a step was
measured), its drain rate at full batch (``drain_row_steps_per_s``; the prior before a
step was measured) and ``longest_request_s``, the seconds a request of the most blocks
``max_model_len`` allows takes at full batch (from which the default SLO is derived).
Debt / drain rate predicts when the replica drains (``predicted_drain_s``);
``row_steps_per_s`` is the rate measured at the current batch, for the dashboards.

Reports also carry the new records of a ``CalibrationLog`` (what the capacity simulator
needs; the metrics actor keeps them per replica).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

from replicas.telemetry.calibration_log import CalibrationLog
from replicas.cost_model import OnlineCostModel
from replicas.telemetry.step_stats import StepStats


class ReplicaMonitor:
    WINDOW_STEPS = 256  # steps in the drain-rate window

    def __init__(self, initial_row_steps_per_s: float, max_report_samples: int = 4096,
                 cost_model: OnlineCostModel | None = None, longest_blocks: int = 1):
        """``cost_model``: the engine's (its step cost fit and count of steps per committed
        block since start); ``longest_blocks``: the most answer blocks a request can have."""
        self.cost_model = cost_model
        self.longest_blocks = longest_blocks
        self.initial_rate = initial_row_steps_per_s
        self.max_samples = max_report_samples
        self._lock = threading.Lock()
        self._window: deque[tuple[int, float]] = deque(maxlen=self.WINDOW_STEPS)
        self._debt: dict[str, tuple[float, int]] = {}  # request id -> (cost, steps taken)
        self._gauges: dict[str, float] = {}  # queue lengths, pages and prefix-cache counts (``set_gauges``)
        self._calibration = CalibrationLog()  # records not yet reported
        self._forward_cpu_total_s = 0.0  # since start, for ``routing_stats``
        self._step_cpu_total_s = 0.0
        self._reported_cpu_s = 0.0  # this process's CPU time at the last report (the first counts the start-up)
        self._reset_report()

    def _reset_report(self) -> None:
        self._steps = 0
        self._forward_s = 0.0
        self._forward_cpu_s = 0.0
        self._step_cpu_s = 0.0
        self._step_s = 0.0
        self._tokens = 0
        self._blocks = 0
        self._overheads: list[float] = []
        self._batch_sizes: list[int] = []
        self._block_steps: list[int] = []
        self._latencies: list[float] = []
        self._ttfb: list[float] = []
        self._output_tokens = 0
        self._finished: Counter = Counter()
        self._degraded = 0  # requests started below the default quality

    # ---- inputs ---------------------------------------------------------------------
    def on_step(self, stats: StepStats, busy_period_s: float | None = None) -> None:
        """``busy_period_s``: wall time since the previous step when the engine went straight
        on to this one (see ``AsyncEngine``), else None."""
        with self._lock:
            self._calibration.steps.append((time.time(), stats.batch_size, stats.prefix_units, busy_period_s,
                                            stats.block_steps))
            self._window.append((stats.active_rows, stats.step_s))
            self._steps += 1
            self._forward_s += stats.forward_s
            self._forward_cpu_s += stats.forward_cpu_s
            self._forward_cpu_total_s += stats.forward_cpu_s
            self._step_cpu_s += stats.step_cpu_s
            self._step_cpu_total_s += stats.step_cpu_s
            self._step_s += stats.step_s
            self._tokens += stats.num_tokens
            self._blocks += stats.blocks_committed
            if len(self._overheads) < self.max_samples:
                self._overheads.append(stats.overhead_s)
                self._batch_sizes.append(stats.batch_size)
            self._block_steps.extend(stats.block_steps[: self.max_samples - len(self._block_steps)])

    def set_gauges(self, **gauges: float) -> None:
        """Current queue lengths, the KV pool's pages and size and prefix-cache counts, read
        from the engine by the replica (``replicas.telemetry.reports.ReplicaStats`` names them)."""
        with self._lock:
            self._gauges.update(gauges)

    def request_started(self, request_id: str, cost: float, quality_level: int = 0) -> None:
        """``quality_level``: the load knob's level it runs at (``replicas.quality``)."""
        with self._lock:
            self._debt[request_id] = (cost, 0)
            self._calibration.starts.append(time.time())
            self._degraded += quality_level > 0

    def request_progressed(self, request_id: str, steps: int) -> None:
        """May come from the engine's thread after the request has finished here (an abort
        not yet applied): then there is nothing left to count."""
        with self._lock:
            entry = self._debt.get(request_id)
            if entry is not None:
                self._debt[request_id] = (entry[0], steps)

    def request_finished(self, request_id: str, reason: str, latency_s: float,
                         time_to_first_block_s: float | None, output_tokens: int, blocks: int = 0) -> None:
        with self._lock:
            self._debt.pop(request_id, None)
            self._finished[reason] += 1
            self._output_tokens += output_tokens
            if blocks:
                self._calibration.ends.append((time.time(), blocks))
            if len(self._latencies) < self.max_samples:
                self._latencies.append(latency_s)
                if time_to_first_block_s is not None:
                    self._ttfb.append(time_to_first_block_s)

    # ---- outputs --------------------------------------------------------------------
    def _row_steps_per_s(self) -> float:
        rows = sum(r for r, _ in self._window)
        seconds = sum(s for _, s in self._window)
        return rows / seconds if rows and seconds else self.initial_rate

    def _step_debt(self) -> float:
        return sum(max(0.0, cost - steps) for cost, steps in self._debt.values())

    def _drain(self) -> dict:
        """The drain model's stats (see the module docstring); the engine's own lock."""
        model = self.cost_model.drain_model() if self.cost_model else None
        if model is None:
            return {"drain_row_steps_per_s": self.initial_rate}
        alone = self.cost_model.request_alone_s(self.longest_blocks)
        return {**model.as_stats(), "drain_row_steps_per_s": model.rate(),
                **({} if alone is None else {"longest_request_s": alone})}

    def predicted_drain_s(self) -> float:
        """Seconds until the replica drains what it owes, at its full-batch drain rate."""
        rate = self._drain()["drain_row_steps_per_s"]
        with self._lock:
            return self._step_debt() / rate

    def routing_stats(self) -> dict:
        drain = self._drain()
        steps_per_block = self.cost_model.steps_per_block_counts() if self.cost_model else {}
        with self._lock:
            debt = self._step_debt()
            return {
                "step_debt": debt,
                "row_steps_per_s": self._row_steps_per_s(),
                "predicted_drain_s": debt / drain["drain_row_steps_per_s"],
                "live_requests": len(self._debt),
                "forward_cpu_s": self._forward_cpu_total_s,
                "step_cpu_s": self._step_cpu_total_s,
                "steps_per_block": steps_per_block,
                "stats_time": time.time(),
                **drain,
                **self._gauges,
            }

    def autoscaling_stats(self) -> dict[str, float]:
        drain = self._drain()
        with self._lock:
            return {"step_debt": self._step_debt(), "row_steps_per_s": self._row_steps_per_s(),
                    **{k: drain[k] for k in ("drain_row_steps_per_s", "longest_request_s") if k in drain}}

    def report(self) -> dict:
        """Everything since the last report, plus current gauges and routing stats."""
        snapshot = self.routing_stats()
        with self._lock:
            cpu_s = time.process_time()
            out = {
                "cpu_s": cpu_s - self._reported_cpu_s,  # this process's CPU since the last report
                "steps": self._steps, "forward_s": self._forward_s, "forward_cpu_s": self._forward_cpu_s,
                "step_cpu_s": self._step_cpu_s, "step_s": self._step_s,
                "tokens": self._tokens, "blocks": self._blocks, "output_tokens": self._output_tokens,
                "overheads_s": self._overheads, "batch_sizes": self._batch_sizes,
                "block_steps": self._block_steps, "latencies_s": self._latencies,
                "time_to_first_block_s": self._ttfb, "finished": dict(self._finished), "degraded": self._degraded,
                "gauges": snapshot, "calibration": self._calibration.take_new(),
            }
            self._reported_cpu_s = cpu_s
            self._reset_report()
        return out
