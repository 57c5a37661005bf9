"""Graceful stop: SIGTERM to `dllm-serve up` stops admitting (503 ``server_draining`` with
Retry-After), lets the requests in flight finish with their whole output, then exits 0."""

import asyncio
import json
import os
import signal
import time
import types

import httpx

from cluster.config import load_config
from cluster.errors import APIError
from cluster.metrics import MetricsExporter
from live_up import start_cluster, stop_cluster
from reliability_cluster import stream_completion
from replica_stand_in import Replicas

DRAIN_TIMEOUT_S = 60.0
EXIT_MARGIN_S = 90.0  # Serve and Ray take a while to stop on a busy machine
SETTINGS = {
    "replica": {"max_batch": 8, "torch_threads": 1},
    "ingress": {"replicas": 1},
    "admission": {"enabled": False},
    "stats_period_s": 0.25,
    "drain_timeout_s": DRAIN_TIMEOUT_S,
}
STREAMS = 16  # twice max_batch: at SIGTERM some stream, others wait in the replica's queue
BODY = {"model": "tiny", "max_tokens": 192, "ignore_eos": True}
PROMPTS = [f"{i}.{i % 7}..{(3 * i) % 10}.{i % 4}" for i in range(STREAMS)]
BLOCK = 16  # the tiny model's block length: one streamed event per block


# ---- the ingress and the metrics actor, without Ray -----------------------------------------
class _MetricsActor:
    """Answers ``ingress_sync`` as the exporter does, draining once told to."""

    def __init__(self):
        self.exporter = MetricsExporter()
        self.ingress_sync = types.SimpleNamespace(remote=self._sync)

    async def _sync(self, ingress_id, report):
        return self.exporter.ingress_sync(ingress_id, report)


def _ingress():
    from cluster.ingress import Ingress

    plain = next(c for c in Ingress.__mro__ if "_prepare" in vars(c))  # under serve.ingress's wrapper
    instance = plain.__new__(plain)
    config = load_config(overrides={"stats_period_s": 0.05}).model_dump(mode="json")
    plain.__init__(instance, types.SimpleNamespace(options=lambda **_: Replicas()), config)
    instance._metrics = _MetricsActor()  # never ray.get_actor
    return plain, instance


def _request(body: dict):
    from starlette.requests import Request

    data = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
                    "query_string": b""}, receive)


def _progress(status: dict) -> dict:
    return {k: v for k, v in status.items() if k != "age_s"}


def test_the_ingress_refuses_with_503_once_the_metrics_actor_says_drain():
    plain, ingress = _ingress()
    exporter = ingress._metrics.exporter
    body = {"model": "tiny", "prompt": "1.3. ..2. 4... .1.4", "max_tokens": 16}

    async def scenario():
        first = await plain.completions(ingress, _request(body))  # starts the sync task
        assert first.status_code == 200
        await asyncio.sleep(0.2)
        assert _progress(exporter.drain()) == {"ingresses": 1, "stopped": 0, "in_flight": 0, "outstanding": 0.0}
        await asyncio.sleep(0.3)  # the order comes back with a sync, the next report acknowledges it
        try:
            await plain.completions(ingress, _request(body))
        except APIError as exc:
            return exc
        raise AssertionError("a request was admitted while draining")

    refused = asyncio.run(scenario())
    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
    assert refused.body()["error"]["type"] == "server_error" and refused.body()["error"]["code"] == "server_draining"
    assert ingress.draining and ingress.in_flight == 0 and ingress.admitted == 1
    assert _progress(exporter.drain()) == {"ingresses": 1, "stopped": 1, "in_flight": 0, "outstanding": 0.0}


def test_drain_status_sums_the_live_ingress_replicas():
    exporter = MetricsExporter()
    report = {"admitted": 3, "rejected": {}, "failovers": 0, "outstanding": 12.0, "cpu_s": 1.0}
    exporter.push_ingress("a", report | {"in_flight": 2, "draining": True})
    exporter.push_ingress("b", report | {"outstanding": 0.0})  # an older ingress: no in_flight, not draining
    assert not exporter.ingress_sync("b", report | {"outstanding": 0.0})["draining"]
    status = exporter.drain()
    assert _progress(status) == {"ingresses": 2, "stopped": 1, "in_flight": 2, "outstanding": 12.0}
    assert 0 <= status["age_s"] < 60
    answer = exporter.ingress_sync("b", report | {"outstanding": 0.0})
    assert answer == {"replicas": {}, "draining": True, "ingresses": 2}


# ---- a real `dllm-serve up` ---------------------------------------------------------------
async def wait_for_async(read, done, timeout_s: float, what: str):
    """Poll ``await read()`` until ``done(value)``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await read()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what} (last: {value})"
        await asyncio.sleep(0.1)


async def _streams(client: httpx.AsyncClient) -> list[dict]:
    async def one(prompt: str) -> dict:
        result = await stream_completion(client, {**BODY, "prompt": prompt})
        return result | {"done_at": time.monotonic()}

    return await asyncio.gather(*(one(p) for p in PROMPTS))


async def _admitted(client: httpx.AsyncClient, metrics_url: str) -> float:
    page = (await client.get(metrics_url)).text
    return sum(float(line.split()[-1]) for line in page.splitlines() if line.startswith("dllm_admitted_total "))


async def _drain_scenario(process, base_url: str, metrics_url: str) -> dict:
    out: dict = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        reference = await _streams(client)  # what a run nobody stops gives (greedy decoding)
        assert all(r["status"] == 200 and r["error"] is None for r in reference), reference
        admitted = await wait_for_async(lambda: _admitted(client, metrics_url), lambda n: n >= STREAMS, 30,
                                        "the reference requests counted")
        streams = asyncio.create_task(_streams(client))
        # SIGTERM once the ingress has admitted every stream (its report says so)
        await wait_for_async(lambda: _admitted(client, metrics_url), lambda n: n >= admitted + STREAMS, 60,
                             "the streams admitted")
        os.kill(process.pid, signal.SIGTERM)
        out["term_at"] = time.monotonic()
        deadline = out["term_at"] + 30
        while not (await client.get("/health")).json().get("draining"):
            assert time.monotonic() < deadline, "the ingress never reported draining"
            await asyncio.sleep(0.1)
        late = await client.post("/v1/completions", json={**BODY, "prompt": PROMPTS[0]})
        out["late"] = (late.status_code, dict(late.headers), late.json())
        out["results"] = await asyncio.wait_for(streams, DRAIN_TIMEOUT_S)
        out["streams_done_s"] = time.monotonic() - out["term_at"]
        # the admission charges come back to 0 (while the metrics actor is still up)
        outstanding = []
        async with httpx.AsyncClient(timeout=2) as scraper:
            for _ in range(50):
                try:
                    page = (await scraper.get(metrics_url)).text
                except httpx.HTTPError:
                    break  # already stopped
                outstanding = [float(line.split()[-1]) for line in page.splitlines()
                               if line.startswith("dllm_admission_outstanding ")]
                if outstanding == [0.0]:
                    break
                await asyncio.sleep(0.1)
        out["outstanding"] = outstanding
    out["reference"] = reference
    return out


def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path):
    cluster = start_cluster(tmp_path, SETTINGS, timeout_s=240)
    process = cluster.process
    try:
        run = asyncio.run(_drain_scenario(process, cluster.base_url, cluster.metrics_url))
        process.wait(timeout=DRAIN_TIMEOUT_S + EXIT_MARGIN_S)
        exit_s = time.monotonic() - run["term_at"]
    finally:
        stop_cluster(process)
    log = open(cluster.log_path).read()
    results, reference = run["results"], run["reference"]
    completed = [r for r in results if r["status"] == 200 and r["error"] is None and r["finish_reason"] == "length"]
    in_flight = [r for r in results if r["done_at"] > run["term_at"]]
    drained = next((line for line in log.splitlines() if line.startswith("drained in")), None)
    print(f"\n{len(completed)} of {STREAMS} streams completed, {len(in_flight)} of them in flight at SIGTERM "
          f"(the last done {run['streams_done_s']:.1f} s after it); late request: {run['late'][0]}; {drained}; "
          f"exit code {process.returncode} {exit_s:.1f} s after SIGTERM")
    assert len(completed) == STREAMS, results
    assert in_flight, "every stream had finished before SIGTERM: nothing was drained"
    assert [r["text"] for r in results] == [r["text"] for r in reference]  # whole outputs
    status, headers, body = run["late"]
    assert status == 503 and int(headers["retry-after"]) >= 1, run["late"]
    assert body["error"]["code"] == "server_draining" and body["error"]["type"] == "server_error"
    assert process.returncode == 0, log
    assert exit_s <= DRAIN_TIMEOUT_S + EXIT_MARGIN_S
    assert drained is not None, log  # every ingress stopped, nothing in flight or outstanding
    assert run["outstanding"] in ([], [0.0]), run["outstanding"]
