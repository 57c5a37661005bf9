"""The metrics actor's parts that make its restart harmless: its scrape server rebinds a port
left in TIME_WAIT, and a replica's pushes neither pile up nor stop while it is away. (Its
kill under load: test_kills_live.py.)"""

import socket
import threading
import time
import types

import httpx
import ray

from cluster.metrics import MetricsActor, MetricsExporter, serve_metrics
from reliability_cluster import free_port, wait_for



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
