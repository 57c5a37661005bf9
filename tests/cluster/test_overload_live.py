"""Overload against a real `dllm-serve up` (1 engine replica, one torch thread, slo.latency_s=5,
two ingress replicas that admit against one capacity): a short closed loop measures the
capacity, then Poisson arrivals at 3x it for 7 s.

While the load runs, a thread scrapes the :9400 metrics every 0.2 s and keeps the replica's
reported predicted drain time (step debt / drain rate); after it, the test waits (generously)
until the replica is idle, its pages are free and admission's outstanding row-steps are 0.
"""

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from loadgen.arrivals import poisson_times, tiny_prompts, with_prompts
from loadgen.records import ERROR, OK, REFUSED, Record
from loadgen.loops import run_closed_loop, run_open_loop
from loadgen.stats import summarize
from replicas.tiny.task import MAX_TOKENS as TINY_MAX_TOKENS
from test_serving import series, total

import live_up as helpers


pytestmark = pytest.mark.timeout(900)  # a cluster started, loaded and stopped by the first test

SLO_S, STATS_PERIOD_S = 5.0, 0.25
CLOSED_CLIENTS, CLOSED_S = 12, 4.0
OVERLOAD, OVERLOAD_S = 3.0, 7.0
# every request runs 14 blocks (no early stop): capacity is then about 20 req/s here, and a
# client sharing this machine with the cluster (and the suite) can still send 3x that
ANSWER = {"max_tokens": 2 * TINY_MAX_TOKENS, "ignore_eos": True}
SCRAPE_PERIOD_S = 0.2
IDLE_TIMEOUT_S = 120.0


@dataclass
class Run:
    """What one cluster showed under overload."""

    capacity_rps: float = 0.0
    answers: list[httpx.Response | Exception] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)  # per scrape during the load
    overload_from: float = float("inf")  # time.monotonic() when the Poisson arrivals began
    idle: dict | None = None  # the first scrape after the load with the replica idle, or what was last seen
    drained: bool = False

    @property
    def peak_drain_s(self) -> float:
        """The largest step debt / full-batch drain rate the replica reported under the
        Poisson overload: the admitted work in seconds. (Not during the closed loop before
        it, where the first requests are charged the worst case, before a block is measured.)"""
        return max((s["drain_s"] for s in self.samples if s["at"] >= self.overload_from), default=0.0)


def scrape(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    outstanding = series(text, "dllm_admission_outstanding")
    return {
        "at": time.monotonic(),
        "step_debt": total(text, "dllm_step_debt"),
        "drain_s": max(series(text, "dllm_predicted_drain_seconds").values(), default=0.0),
        "running": total(text, "dllm_running_requests"),
        "waiting": total(text, "dllm_step_queue_length"),
        "free_pages": total(text, "dllm_free_pages"),
        "total_pages": total(text, "dllm_total_pages"),
        "reporting": len(series(text, "dllm_total_pages")),
        "outstanding": sum(outstanding.values()) if outstanding else None,  # None: not exported
        "prediction_bias": max(series(text, "dllm_admission_prediction_bias").values(), default=None),
    }


class Sampler(threading.Thread):
    def __init__(self, metrics_url: str, into: list):
        super().__init__(daemon=True)
        self.metrics_url, self.into, self.stop = metrics_url, into, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(SCRAPE_PERIOD_S):
            try:
                self.into.append(scrape(self.metrics_url))
            except httpx.HTTPError:
                pass


async def overload(base_url: str, run: Run) -> None:
    """The closed loop, then Poisson arrivals at OVERLOAD x its throughput; every answer kept."""
    prompts = tiny_prompts(500, seed=5)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, trust_env=False,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as http:
        async def send(index, arrival, start) -> Record:
            loop = asyncio.get_running_loop()
            sent = loop.time()
            record = Record(index=index, planned_s=arrival.time_s, sent_s=sent - start)
            try:
                response = await http.post("/v1/completions", json={
                    "model": "tiny", "prompt": arrival.prompt, **ANSWER})
                record.http_status = response.status_code
                record.status = {200: OK, 429: REFUSED}.get(response.status_code, ERROR)
            except httpx.HTTPError as exc:
                response = exc
            run.answers.append(response)
            record.latency_s = loop.time() - sent
            return record

        closed = await run_closed_loop(prompts, send, CLOSED_CLIENTS, CLOSED_S)
        run.capacity_rps = summarize(closed, None)["throughput_rps"]
        assert run.capacity_rps > 0, "the closed loop completed nothing"
        arrivals = with_prompts(poisson_times(OVERLOAD * run.capacity_rps, seed=5, duration_s=OVERLOAD_S), prompts)
        run.overload_from = time.monotonic()
        await run_open_loop(arrivals, send)


def wait_idle(metrics_url: str, run: Run) -> None:
    """Until the replica reports no live request, all pages free and admission nothing outstanding."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        time.sleep(1.0)
        run.idle = scrape(metrics_url)
        idle = run.idle
        if (idle["reporting"] and idle["running"] + idle["waiting"] == 0 and idle["step_debt"] == 0
                and idle["free_pages"] == idle["total_pages"] and idle["outstanding"] is not None
                and idle["outstanding"] == 0):
            run.drained = True
            return


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    settings = {
        "replica": {"torch_threads": 1},
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "slo": {"latency_s": SLO_S},
        "ingress": {"replicas": 2},
        "stats_period_s": STATS_PERIOD_S,
    }
    cluster = helpers.start_cluster(tmp_path_factory.mktemp("overload"), settings)
    run = Run()
    try:
        sampler = Sampler(cluster.metrics_url, run.samples)
        sampler.start()
        try:
            asyncio.run(overload(cluster.base_url, run))
        finally:
            sampler.stop.set()
            sampler.join(timeout=30)
        wait_idle(cluster.metrics_url, run)
    finally:
        helpers.stop_cluster(cluster.process)
    return run


def test_overload_is_answered_with_200_or_429(run):
    """Every answer is a 200 or a 429; a 429 carries Retry-After and an OpenAI error body."""
    failures = [a for a in run.answers if isinstance(a, Exception)]
    assert not failures, failures[:3]
    codes = [a.status_code for a in run.answers]
    assert set(codes) <= {200, 429}, {c: codes.count(c) for c in set(codes)}
    assert codes.count(429) > 0, "3x capacity was all admitted"
    for answer in run.answers:
        if answer.status_code == 429:
            assert int(answer.headers["Retry-After"]) >= 1, answer.headers
            error = answer.json()["error"]
            assert error["type"] == "rate_limit_error" and error["message"], error


def test_every_admitted_request_completes(run):
    admitted = [a.json() for a in run.answers if not isinstance(a, Exception) and a.status_code == 200]
    assert admitted
    assert all(a["choices"][0]["finish_reason"] == "length"
               and a["usage"]["completion_tokens"] == ANSWER["max_tokens"] for a in admitted)


def test_pages_and_admission_are_released_afterwards(run):
    """Within IDLE_TIMEOUT_S of the load: no live request, every page free, step debt 0 and
    dllm_admission_outstanding (summed over ingress replicas) 0."""
    assert run.idle is not None and run.idle["outstanding"] is not None, \
        "dllm_admission_outstanding is not exported on the metrics port"
    assert run.idle["prediction_bias"] is not None and 0.5 <= run.idle["prediction_bias"] <= 2.0, run.idle
    assert run.drained, f"not idle {IDLE_TIMEOUT_S:g} s after the load: {run.idle}"


def test_two_ingress_replicas_admit_no_more_than_one_stats_period_beyond_capacity(run):
    """The admitted work is the replica's own step debt (admission cost minus steps taken, of
    every live request); divided by its drain rate at full batch (dllm_predicted_drain_seconds)
    it is the work admitted, in seconds, and admission's capacity is the SLO's worth of it.
    Two ingress replicas that each admitted up to the capacity on their own would double it
    (a peak near 2 x SLO); consistent ones may exceed it only by what the other admitted since
    the last report reached it (through the metrics actor: two stats periods), with 25 % for
    the noise of the drain-rate fit (charged costs are a mean, the drain rate a fit): well
    below a doubled peak. Measured in five runs: two ingress replicas 3.76 to 4.11 s, one
    3.79 and 4.79 s (the same run with one ingress replica, dropped to save a cluster start),
    bound 6.75 s. (Over the closed loop before the overload, cold-start charges read up to
    68 s: see ``Run.peak_drain_s``.)"""
    assert run.samples
    bound = 1.25 * SLO_S + 2 * STATS_PERIOD_S
    print(f"prediction bias {[s['prediction_bias'] for s in run.samples][::10]}")
    print(f"peak admitted work (s of drain): {run.peak_drain_s:.2f}; bound {bound:.2f}; "
          f"capacity {run.capacity_rps:.2f} req/s")
    assert run.peak_drain_s <= bound, (
        f"two ingress replicas: peak admitted work {run.peak_drain_s:.2f} s of drain, bound {bound:.2f} s "
        f"(capacity {run.capacity_rps:.2f} req/s)")
