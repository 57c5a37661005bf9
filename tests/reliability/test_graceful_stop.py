"""Graceful stop without Ray: the ingress refuses with 503 ``server_draining`` once the
metrics actor says drain, and the actor sums the live ingress replicas' progress. (SIGTERM
to a real `dllm-serve up`: test_up_lifecycle_live.py.)"""

import asyncio
import json
import os
import signal
import time
import types


from cluster.cli import StopSignals
from cluster.config import load_config
from cluster.errors import APIError
from cluster.metrics import MetricsExporter
from replica_stand_in import Replicas

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

    plain = next(c for c in Ingress.__mro__ if "_complete" in vars(c))  # under serve.ingress's wrapper
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
    assert ingress.draining and ingress.in_flight == 0 and ingress.dispatch.admitted == 1
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


def test_up_hears_signals_that_arrive_together_and_repeated():
    """`up`'s handlers only set flags: signals arriving at once (Ctrl-C pressed twice,
    ``pkill`` and ``timeout`` passing SIGINT on) once deadlocked it inside Event.set."""
    signals = StopSignals()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signals.on_sigint)
    signal.signal(signal.SIGTERM, signals.on_sigterm)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        signals.wait()
        assert signals.graceful and not signals.interrupted  # SIGTERM drains first
        for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM, signal.SIGINT):
            os.kill(os.getpid(), sig)
        deadline = time.monotonic() + 30
        while not signals.interrupted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert signals.interrupted
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
