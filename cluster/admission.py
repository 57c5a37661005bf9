"""Step-aware admission: admit a request when the cluster is predicted to finish it within
the SLO, refuse it at once (429, ``Retry-After``) otherwise.

API used by the ingress (cluster/ingress.py):
* ``quick_refusal(blocks=1) -> Decision | None``: cheap, called BEFORE the body is parsed
  or tokenized; a Decision (admitted=False, retry_after_s) when even a request of
  ``blocks`` answer blocks (default 1: the cheapest) would be refused now, else None
  (go on). It charges nothing.
* ``cost(max_tokens, block_length, worst_case_steps_per_block)`` then
  ``try_admit(cost) -> Decision`` (charges on admission), ``Charge(controller, cost)``
  with ``.progress(steps)`` / ``.close()`` releasing it (``.answered()``: it ended with
  its answer, which teaches ``prediction_bias``), ``release(amount)``,
  ``outstanding`` (row-steps admitted here and not yet released), ``update_view(view)``,
  ``slo_latency_s`` (the SLO in force: configured, or derived from the replicas' reports).

How a request is decided:

* Its cost, in row-steps (one row advanced by one step): its most blocks x steps per
  block, the mean (or ``admission.cost_quantile``) of the steps per block the replicas
  measured (a replica reports its warm-up's until its first real block commits), at most
  the algorithm's worst case (the worst case until a replica reports). It is
  also the number of steps the request itself takes, one after another. Plus its
  prompt's pages that no replica is likely to hold cached (the ingress remembers the
  prefixes it sent), each at what a replica measured a prompt page to cost, in row-steps
  (``prompt_cost``): a prompt found in a prefix cache is charged nothing for it.
* The work ahead of it, D: the step debt the replicas reported (what they received and
  have not done yet: the source of truth) plus what this ingress admitted after those
  reports were taken (admissions newer than the oldest report's ``stats_time``; replicas
  and ingress read the same wall clock). Before any replica has reported: ``outstanding``.
* Each replica's ``DrainModel`` (``replicas.cost_model``): a step of b rows takes
  c0 + c1·b seconds, so it drains r(b) = b / (c0 + c1·b) row-steps per second, more at
  a larger batch. The queue runs at b = rows in flight (reported live requests + admitted
  since, or, where more, the requests this ingress admitted and are not done, times the
  ingress replicas; + this one) per replica, at most max_batch and at most the largest
  batch the fit has measured (never extrapolated); R = the sum of the replicas' r(b). A replica that
  has not measured a step drains ``admission.initial_row_steps_per_s``.
* Predicted completion = (D + cost) / R + cost x (c0 + c1·b): the queue ahead and the
  request drain at R, and the request cannot be faster than its own steps one after
  another (the sum is on the safe side).
* Admitted iff the prediction <= ``admission.slo_headroom`` x the SLO
  (``SLOSettings.latency_for``; 0.8 by default: the prediction is a mean, and a queue
  filled to the SLO itself finishes about half its requests late); an idle cluster
  (D = 0) always admits, so a request longer than the SLO still runs. A refusal's
  ``Retry-After`` is the excess, prediction - headroom x SLO, rounded up, at least 1 s:
  the time the work ahead needs to drain that much.

Admission learns how far its predictions run from what admitted requests took
(``prediction_bias``): each request that ends with its answer, and that was predicted to
wait behind a queue (at least a quarter of the target), moves a running mean of
log(took / predicted) a little (its exponent stays within 0.5 to 2). Where answers take
longer than predicted (a fit that runs fast, a machine that slows down, costs the
step-cost model does not see), the predictions are lengthened by it, so the admitted
latency comes back under the target within seconds of answers; where they take less, the
predictions stand: a queue that drains early only ends sooner than the SLO allows.

``admission.max_step_debt_per_replica`` replaces the prediction with a fixed bound: admit
while D + cost <= bound x replicas; ``Retry-After`` = excess / R.

Several ingress replicas (n, from the metrics actor): each adds to the reported debt its
own admissions since the reports, counted n times, as if every other ingress had admitted
as much (Serve's proxy spreads requests evenly over them); so they agree as soon as a
report counts a request, and between two reports together they fill the headroom about
once instead of n times. When the reports lag (a busy metrics actor), D is at least n x
this ingress's own outstanding charges, which it knows live.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from cluster.config import AdmissionSettings, SLOSettings
from cluster.errors import APIError
from replicas.cost_model import DrainModel, mean_steps
from replicas.request_cost import request_cost, steps_quantile
from replicas.telemetry.reports import MIN_STALE_S, ReplicaView

log = logging.getLogger(__name__)

REFUSAL_LOG_EVERY_S = 10.0  # the refusal warning's least interval
BIAS_WEIGHT = 0.02  # how far one answer moves the prediction bias's running mean (of log took / predicted)
BIAS_SAMPLE_LIMIT = math.log(2.0)  # one answer counts as at most 2x slower or faster than predicted
BIAS_LIMIT = math.log(2.0)  # the learned bias stays within 0.5x to 2x
BIAS_MIN_SHARE = 0.25  # learn from answers predicted to take at least this share of the target (a queue)



@dataclass(frozen=True)
class Decision:
    admitted: bool
    retry_after_s: int = 0
    charge: "Charge | None" = None  # an admission's charge, to release as the request progresses
    predicted_s: float | None = None  # the prediction before its ``correction``, where one was made


class Refusals:
    """Admission's refusals turned into the API's 429, counted by reason for the metrics actor."""

    def __init__(self):
        self.counts: Counter[str] = Counter()

    def raise_if_refused(self, decision: Decision | None) -> None:
        """429 with Retry-After where ``decision`` refuses; nothing otherwise."""
        if decision is None or decision.admitted:
            return
        self.counts["step_capacity"] += 1
        raise APIError(429, f"the cluster is at its step capacity; retry in {decision.retry_after_s} s",
                       type_="rate_limit_error", code="step_capacity_exceeded",
                       headers={"Retry-After": str(decision.retry_after_s)})


class AdmissionController:
    def __init__(self, settings: AdmissionSettings, slo_latency_s: float | None, min_replicas: int,
                 clock: Callable[[], float] = time.time, stale_after_s: float = MIN_STALE_S):
        """``slo_latency_s``: None derives it from the replicas' reports; ``clock``: the wall
        clock the replicas' ``stats_time`` is on; reports older than ``stale_after_s``
        (``replicas.telemetry.reports.stale_after_s``) are ignored."""
        self.settings = settings
        self.stale_after_s = stale_after_s
        self.slo = SLOSettings(latency_s=slo_latency_s)
        self.min_replicas = min_replicas
        self.clock = clock
        self.outstanding = 0.0
        self.view: dict[str, ReplicaView] = {}
        self._prior = DrainModel(1 / settings.initial_row_steps_per_s, 0.0, 1, 1)
        self._reported_at: float | None = None  # stats_time of the oldest live report
        # charges admitted after the reports (weakly: a dropped charge closes itself)
        self._since_report: weakref.WeakSet[Charge] = weakref.WeakSet()
        self._open: weakref.WeakSet[Charge] = weakref.WeakSet()  # admitted here, not closed yet
        # releases, after the reports, of charges the reports count: (time, amount)
        self._released_since_report: deque[tuple[float, float]] = deque()
        self._released_since_report_total = 0.0
        self.ingress_replicas = 1  # live ingress replicas, this one included (set by the ingress)
        self._measured_steps: float | None = None
        self._slo_s = self.slo.latency_for(())
        self._refusals_unlogged = 0  # refusals since the last refusal warning
        self._refusal_logged_at: float | None = None
        self._log_bias = 0.0  # running mean of log(took / predicted), see ``observe_answer``

    # ---- the replicas' reports -----------------------------------------------------------
    def update_view(self, view: Mapping[str, Mapping]) -> None:
        """Latest routing stats per replica (``cluster_view`` of the metrics actor)."""
        views = {r: ReplicaView.model_validate(v) for r, v in view.items()}
        self.view = {r: v for r, v in views.items() if v.age_s <= self.stale_after_s}
        self._reported_at = min((v.stats_time for v in self.view.values() if v.stats_time is not None), default=None)
        if self._reported_at is not None:
            for charge in [c for c in self._since_report if c.admitted_at <= self._reported_at]:
                self._since_report.discard(charge)
            released = self._released_since_report
            while released and released[0][0] <= self._reported_at:
                self._released_since_report_total -= released.popleft()[1]
            if not released:  # no float drift
                self._released_since_report_total = 0.0
        merged: Counter = Counter()
        for stats in self.view.values():
            merged.update(stats.steps_per_block)
        quantile = self.settings.cost_quantile
        self._measured_steps = mean_steps(merged) if quantile is None else steps_quantile(merged, quantile)
        self._slo_s = self.slo.latency_for(v.longest_request_s for v in self.view.values()
                                           if v.longest_request_s is not None)

    @property
    def slo_latency_s(self) -> float:
        """The SLO in force: configured, or derived from the replicas' last reports."""
        return self._slo_s

    # ---- costs ---------------------------------------------------------------------------
    def steps_per_block(self, worst_case: float) -> float:
        measured = self._measured_steps
        return worst_case if measured is None else min(measured, worst_case)

    def cost(self, max_tokens: int, block_length: int, worst_case_steps_per_block: int,
             max_cost: int | None = None) -> int:
        """Blocks x steps per block (see the module docstring), at most ``max_cost``
        (``replicas.request_cost.max_request_cost``: what one replica row holds)."""
        return request_cost(max_tokens, block_length, self.steps_per_block(worst_case_steps_per_block), max_cost)

    # ---- the prediction ------------------------------------------------------------------
    def work_ahead(self) -> float:
        """Row-steps the cluster owes before a request admitted now (D in the docstring):
        the replicas' reported debt, less what this ingress saw them do since, plus what
        was admitted since; or, when that is less (reports late, or none), this ingress's
        own outstanding charges, live, times the ingress replicas."""
        own = self.ingress_replicas * self.outstanding
        if not self.view:
            return own
        reported = sum(v.step_debt for v in self.view.values()) - self._released_since_report_total
        since = sum(charge.remaining for charge in self._since_report)
        return max(max(reported, 0.0) + self.ingress_replicas * since, own)

    def _queue(self) -> tuple[list[DrainModel], int]:
        """The replicas' drain models and the batch the queue will run at on each."""
        if self.view:
            models = [DrainModel.from_stats(v) or self._prior for v in self.view.values()]
            # as in ``work_ahead``: requests admitted here count where the reports do not show them yet
            rows = max(sum(v.live_requests for v in self.view.values()) + len(self._since_report),
                       self.ingress_replicas * len(self._open)) + 1
        else:
            models, rows = [self._prior] * self.min_replicas, 1
        return models, -(-rows // len(models))

    def _drain(self) -> tuple[float, float]:
        """(R, step seconds at the batch the queue will run at), see the module docstring."""
        models, batch = self._queue()
        return sum(m.rate(batch) for m in models), max(m.step_s(batch) for m in models)

    def prompt_cost(self, pages: int) -> float:
        """Row-steps that computing ``pages`` prompt pages costs: their seconds (the replicas'
        measured ``c2`` per page) at the drain rate of the batch the queue runs at, averaged
        over the replicas; 0 before a replica has measured it."""
        if pages <= 0:
            return 0.0
        models, batch = self._queue()
        return pages * sum(m.page_row_steps(batch) for m in models) / len(models)

    def predicted_s(self, cost: float) -> float:
        """Seconds until a request of ``cost`` row-steps admitted now completes, before its
        ``correction``."""
        rate, step_s = self._drain()
        return (self.work_ahead() + cost) / rate + cost * step_s

    @property
    def prediction_bias(self) -> float:
        """How much longer than predicted admitted requests have taken lately (1: as predicted)."""
        return math.exp(self._log_bias)

    @property
    def correction(self) -> float:
        """What the predictions are multiplied by: the bias where answers ran late, else 1."""
        return max(1.0, self.prediction_bias)

    def observe_answer(self, predicted_s: float, took_s: float) -> None:
        """An admitted request ended with its answer ``took_s`` after admission, predicted at
        ``predicted_s`` (uncorrected): learn from it where a queue was predicted."""
        if took_s <= 0 or predicted_s < BIAS_MIN_SHARE * self._slo_s * self.settings.slo_headroom:
            return
        sample = min(max(math.log(took_s / predicted_s), -BIAS_SAMPLE_LIMIT), BIAS_SAMPLE_LIMIT)
        self._log_bias = min(max(self._log_bias + BIAS_WEIGHT * (sample - self._log_bias), -BIAS_LIMIT), BIAS_LIMIT)

    def _decide(self, cost: float, slo_s: float | None = None) -> Decision:
        ahead = self.work_ahead()
        if not self.settings.enabled or ahead <= 0:
            return Decision(True)
        bound = self.settings.max_step_debt_per_replica
        headroom = self.settings.slo_headroom
        predicted = None
        if bound is None:
            slo = self._slo_s if slo_s is None else min(slo_s, self._slo_s)
            predicted = self.predicted_s(cost)
            excess_s = predicted * self.correction - slo * headroom
            limit = f"{headroom:g} x the SLO {slo:g} s"
        else:  # a fixed bound replaces the SLO, not the request's own deadline
            excess_s = (ahead + cost - bound * (len(self.view) or self.min_replicas)) / self._drain()[0]
            limit = f"the step-debt bound of {bound:g} row-steps a replica"
            if slo_s is not None:
                predicted = self.predicted_s(cost)
                excess_s = max(excess_s, predicted * self.correction - slo_s * headroom)
                limit += f" or {headroom:g} x the deadline {slo_s:g} s"
        if excess_s <= 0:
            return Decision(True, predicted_s=predicted)
        self._log_refusal(cost, excess_s, limit)
        return Decision(False, max(1, math.ceil(excess_s)))

    def _log_refusal(self, cost: float, excess_s: float, limit: str) -> None:
        """A warning with the prediction's parts at the first refusal, then at most one every
        ``REFUSAL_LOG_EVERY_S`` with the refusals since (overload refuses hundreds a second)."""
        self._refusals_unlogged += 1
        now, last = self.clock(), self._refusal_logged_at
        if last is not None and now - last < REFUSAL_LOG_EVERY_S:
            return
        since = "" if last is None else f" ({self._refusals_unlogged} in the last {now - last:.0f} s)"
        log.warning("refusing%s: %s", since, self._explain(cost, excess_s, limit))
        self._refusal_logged_at, self._refusals_unlogged = now, 0

    def _explain(self, cost: float, excess_s: float, limit: str) -> str:
        """The parts of a refusal's prediction, for the log."""
        models, batch = self._queue()
        rate = sum(m.rate(batch) for m in models)
        fits = ", ".join(f"c0 {m.c0 * 1e3:.2f} ms c1 {m.c1 * 1e3:.3f} ms" for m in models)
        source = f"{len(self.view)} replica report(s)" if self.view else "no replica report yet (the prior)"
        correction = self.correction
        return (f"predicted {self.predicted_s(cost) * correction:.2f} s (x {correction:.2f}; answers took "
                f"{self.prediction_bias:.2f} x their predictions), {excess_s:.2f} s over {limit}; "
                f"work ahead {self.work_ahead():.0f} + this request {cost:.0f} row-steps, "
                f"drained at {rate:.0f} row-steps/s ({batch} rows in flight a replica; {fits}; from {source}), "
                f"{self.ingress_replicas} ingress replica(s), {self.outstanding:.0f} row-steps outstanding here")

    # ---- decisions and charges -------------------------------------------------------------
    def quick_refusal(self, blocks: int = 1, slo_s: float | None = None) -> Decision | None:
        """The refusal a request of ``blocks`` answer blocks would get now, else None."""
        decision = self._decide(blocks * (self._measured_steps or 1.0), slo_s)
        return None if decision.admitted else decision

    def try_admit(self, cost: float, slo_s: float | None = None) -> Decision:
        """Admit a request of ``cost`` row-steps if it is predicted to finish within the SLO
        (or ``slo_s``, where tighter); an admission carries its ``Charge``."""
        decision = self._decide(cost, slo_s)
        if not decision.admitted:
            return decision
        self.outstanding += cost
        charge = Charge(self, cost, decision.predicted_s)
        self._open.add(charge)
        if self.view:  # without reports, ``outstanding`` is the work ahead
            self._since_report.add(charge)
        return replace(decision, charge=charge)

    def closed(self, charge: "Charge") -> None:
        """``charge``'s request ended: it is no longer in flight here."""
        self._open.discard(charge)

    def release(self, amount: float, charge: "Charge | None" = None) -> None:
        """``amount`` row-steps of ``charge`` done: they stop counting at once, whether
        the replicas' reports counted the charge already or not."""
        remaining = self.outstanding - amount
        # charges are released in fractional pieces: snap float residue (costs are >= 1) to 0
        self.outstanding = remaining if remaining > 1e-6 else 0.0
        counted = self._reported_at is not None and charge is not None and charge.admitted_at <= self._reported_at
        if counted and charge not in self._since_report:
            self._released_since_report.append((self.clock(), amount))
            self._released_since_report_total += amount


class Charge:
    """One admitted request's cost: released as its steps are taken and in full when it
    ends. ``close`` is idempotent and also runs when the charge is garbage collected, so
    a response that is never streamed (client gone before the first byte) cannot leak it."""

    def __init__(self, controller: AdmissionController, cost: float, predicted_s: float | None = None):
        self.controller = controller
        self.cost = cost
        self.predicted_s = predicted_s  # uncorrected, where admission predicted
        self.released = 0.0
        self.admitted_at = controller.clock()

    @property
    def remaining(self) -> float:
        return self.cost - self.released

    def progress(self, steps: int) -> None:
        amount = min(self.cost, steps) - self.released
        if amount > 0:
            self.released += amount
            self.controller.release(amount, self)

    def close(self) -> None:
        self.progress(math.inf)
        self.controller.closed(self)

    def answered(self) -> None:
        """The request ended with its answer: its time against its prediction goes to the
        controller (``observe_answer``), and the charge closes."""
        if self.predicted_s is not None:
            self.controller.observe_answer(self.predicted_s, self.controller.clock() - self.admitted_at)
        self.close()

    __del__ = close
