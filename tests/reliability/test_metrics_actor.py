"""The metrics actor can die without disturbing serving: requests keep succeeding while it
is killed and restarted, its Prometheus endpoint is back on the same port within 10 s, and
the replicas and the ingress fill it again."""

import asyncio
import socket
import threading
import time
import types

import httpx
import ray

from cluster.metrics import MetricsActor, MetricsExporter, serve_metrics
from reliability_cluster import free_port, live_cluster, stream_completion, wait_for

SETTINGS = {
    "replica": {"max_batch": 8, "torch_threads": 1},
    "admission": {"enabled": False},
    "stats_period_s": 0.25,
}
BODY = {"model": "tiny", "prompt": "1.3. ..2. 4... .1.4", "max_tokens": 48}
CLIENTS = 4
BACK_WITHIN_S = 10.0
LOAD_AFTER_BACK_S = 3.0
MAX_LOAD_S = 60.0  # the load stops by then whatever happens
MAX_REQUESTS = 2000


def sample_sum(text: str, name: str) -> float | None:
    """The sum of a metric's samples in a Prometheus text page; None when it has none."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + " ") or line.startswith(name + "{")]
    return sum(values) if values else None


def test_scrape_server_rebinds_a_port_left_in_time_wait():
    """SO_REUSEADDR: right after a server that answered a scrape is gone (the connection it
    closed lingers in TIME_WAIT), a new one binds the same port at once; a plain socket cannot."""
    port = free_port()
    first = MetricsActor("127.0.0.1", port)
    assert first._server.socket.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
    assert httpx.get(first.address, timeout=10).status_code == 200
    first.close()
    second = serve_metrics(MetricsExporter().registry, "127.0.0.1", port, retry_s=0)  # no waiting for the port
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
    finally:
        second.shutdown()
        second.server_close()


class _Ref:
    def __init__(self):
        self.done, self.error = False, None


class _SlowActor:
    """A metrics actor handle whose pushes stay pending until ``answer()``; after
    ``answer(from_now_on=True)`` every push is answered at once."""

    def __init__(self):
        self.refs: list[_Ref] = []
        self.at_once = False
        self.push_replica = types.SimpleNamespace(remote=self._push)

    def _push(self, replica, report):
        self.refs.append(_Ref())
        self.refs[-1].done = self.at_once
        return self.refs[-1]

    def answer(self, error: Exception | None = None, from_now_on: bool = False) -> None:
        for ref in self.refs:
            if not ref.done:
                ref.done, ref.error = True, error
        self.at_once = from_now_on


def _fake_ray(monkeypatch, actor: _SlowActor) -> None:
    def wait(refs, timeout=None):
        return [r for r in refs if r.done], [r for r in refs if not r.done]

    def get(ref, timeout=None):
        if ref.error:
            raise ref.error
        return None

    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: actor)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)


def test_a_replica_keeps_one_push_in_flight_and_sends_what_piled_up_later(monkeypatch):
    """A metrics actor that does not answer costs a replica one pending push, not one per
    period; what the monitor gathered meanwhile goes with the next push."""
    from replicas import deployment
    from replicas.deployment import EngineReplica

    monkeypatch.setattr(deployment, "PUSH_TIMEOUT_S", 1.0)
    actor = _SlowActor()
    _fake_ray(monkeypatch, actor)
    reports = []
    replica = types.SimpleNamespace(
        _metrics_actor={"name": "m", "namespace": "n"}, _stop=threading.Event(), replica_id="r",
        _refresh_gauges=lambda: None, _identity=lambda: {},
        monitor=types.SimpleNamespace(report=lambda: reports.append(time.monotonic()) or {"gauges": {}}))
    period = 0.05
    thread = threading.Thread(target=EngineReplica._report_loop, args=(replica, period), daemon=True)
    thread.start()
    try:
        wait_for(lambda: actor.refs, 5, "the first push")
        time.sleep(10 * period)
        assert len(actor.refs) == 1 and len(reports) == 1  # nothing sent or taken while it is pending
        given_up = wait_for(lambda: len(actor.refs) == 2 and time.monotonic(), 5, "the unanswered push given up")
        assert given_up - reports[0] >= deployment.PUSH_TIMEOUT_S
        actor.answer(error=RuntimeError("the actor died"))  # lost with the actor: look it up again
        wait_for(lambda: len(actor.refs) == 3, 5, "a push after the failed one")
        actor.answer(from_now_on=True)
        start, sent = time.monotonic(), len(actor.refs)
        wait_for(lambda: len(actor.refs) >= sent + 5, 5, "a push per period once answered")
        assert time.monotonic() - start < deployment.PUSH_TIMEOUT_S  # not held back by a timeout
        # one monitor report per push (the loop may be between the two): nothing taken without being sent
        assert 0 <= len(reports) - len(actor.refs) <= 1
    finally:
        replica._stop.set()
        thread.join(5)


async def _client(client: httpx.AsyncClient, n: int, stop: asyncio.Event, results: list) -> None:
    """Requests one after another until ``stop``: streamed and not, alternately."""
    i = 0
    while not stop.is_set() and len(results) < MAX_REQUESTS:
        body = {**BODY, "seed": n * 1000 + i}
        if i % 2:
            result = await stream_completion(client, body)
            ok = result["status"] == 200 and result["error"] is None and result["finish_reason"] is not None
            results.append((time.monotonic(), result["status"] if ok else result))
        else:
            response = await client.post("/v1/completions", json=body)
            ok = response.status_code == 200 and response.json()["choices"][0]["finish_reason"] is not None
            results.append((time.monotonic(), 200 if ok else (response.status_code, response.text)))
        i += 1


async def _scrape(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        response = await client.get(url, timeout=1.0)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


async def _kill_under_load(cluster) -> dict:
    stop = asyncio.Event()
    results: list = []
    timings: dict = {}
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as client, \
            httpx.AsyncClient() as scraper:
        clients = [asyncio.create_task(_client(client, n, stop, results)) for n in range(CLIENTS)]
        try:
            while len(results) < 2 * CLIENTS:  # the load is under way
                assert time.monotonic() - start < MAX_LOAD_S, "no requests completed"
                await asyncio.sleep(0.05)
            before = await _scrape(scraper, cluster.metrics_url)
            steps_before = sample_sum(before, "dllm_steps_total")
            actor = cluster.metrics_actor()
            killed = time.monotonic()
            ray.kill(actor, no_restart=False)
            timings["requests_before_kill"] = len(results)
            # back: the restarted actor answers (seen down first, or with counters that started afresh)
            down = False
            while True:
                text = await _scrape(scraper, cluster.metrics_url)
                if text is None:
                    down = True
                elif down or (sample_sum(text, "dllm_steps_total") or 0) < (steps_before or 0):
                    timings["back_s"] = time.monotonic() - killed
                    break
                assert time.monotonic() - killed < 3 * BACK_WITHIN_S, "/metrics did not come back"
                await asyncio.sleep(0.05)
            # filled again: the replica's step counters and its gauges, the ingress's totals
            while True:
                text = await _scrape(scraper, cluster.metrics_url) or ""
                admitted = sample_sum(text, "dllm_admitted_total") or 0
                if ((sample_sum(text, "dllm_steps_total") or 0) > 0 and sample_sum(text, "dllm_replicas") == 1
                        and admitted >= timings["requests_before_kill"]):
                    timings["refilled_s"] = time.monotonic() - killed
                    break
                assert time.monotonic() - killed < 3 * BACK_WITHIN_S + 30, f"/metrics not refilled:\n{text}"
                await asyncio.sleep(0.1)
            back_at = time.monotonic()
            while time.monotonic() - back_at < LOAD_AFTER_BACK_S and time.monotonic() - start < MAX_LOAD_S:
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 120)
    timings["killed_at"] = killed
    return {"results": results, **timings}


def test_killing_the_metrics_actor_disturbs_no_request():
    with live_cluster(SETTINGS) as cluster:
        wait_for(lambda: len(cluster.replicas()) == 1, 120, "the replica reporting")
        run = asyncio.run(_kill_under_load(cluster))
        results = run["results"]
        failed = [status for _, status in results if status != 200]
        during = [t for t, _ in results if t > run["killed_at"]]
        print(f"\n{len(results)} requests, {len(results) - len(failed)} succeeded ({len(during)} finished after the "
              f"kill); /metrics back {run['back_s']:.2f} s after the kill, replica and ingress metrics on it "
              f"{run['refilled_s']:.2f} s after")
        assert not failed, failed[:5]
        assert during, "no request completed while the metrics actor was down or restarting"
        assert run["back_s"] <= BACK_WITHIN_S
        # the restarted actor serves the cluster view again
        assert wait_for(lambda: len(cluster.replicas()) == 1, 30, "the replica in the cluster view")
