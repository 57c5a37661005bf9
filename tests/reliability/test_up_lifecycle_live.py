"""`dllm-serve up` with its defaults and API keys, as a new user starts it: no proxy in front,
admission right from the first request, keys checked before the body is read, limited per
key and never shown, a stop that frees every port for the next `up` at once, and a graceful
stop on SIGTERM.

One cluster, fresh, on the default request path (the ingress replica holds the port, no
proxy runs): a client sends 50 requests back to back, then 12 concurrent clients send for
a few seconds; no request is refused. Then the keys are checked. Then `up` stops (Ctrl-C)
and starts again at once on the same ports, with HAProxy in front this time, and serves.
Then SIGTERM: it stops admitting (503 ``server_draining`` with Retry-After), lets the
requests in flight finish with their whole output, and exits 0, its HAProxy ended.
"""

import asyncio
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from cluster.request_path import processes_mentioning
from live_up import start_cluster, stop_cluster
from loadgen.arrivals import tiny_prompts
from loadgen.overload import cluster_cpu, is_haproxy, listening_process, serving_raylet
from reliability_cluster import stream_completion

pytestmark = pytest.mark.timeout(900)

BACK_TO_BACK = 50
CONCURRENT_CLIENTS, CONCURRENT_S = 12, 5.0
FILE_KEY, ENV_KEY = "file-key-0001", "env-key-0002"
SETTINGS = {"replica": {"torch_threads": 1}}  # everything else as `up` ships it
DRAIN_TIMEOUT_S = 60.0
EXIT_MARGIN_S = 90.0  # Serve and Ray take a while to stop on a busy machine
# the restarted cluster's: max_batch 8, so that at SIGTERM some streams run and others wait
DRAIN_SETTINGS = {"replica": {"max_batch": 8, "torch_threads": 1}, "ingress": {"replicas": 1},
                  "admission": {"enabled": False}, "stats_period_s": 0.25, "drain_timeout_s": DRAIN_TIMEOUT_S}
STREAMS = 16  # twice max_batch
BODY = {"model": "tiny", "max_tokens": 96, "ignore_eos": True}
PROMPTS = [f"{i}.{i % 7}..{(3 * i) % 10}.{i % 4}" for i in range(STREAMS)]
LONG = {"model": "tiny", "prompt": "1.2..3", "max_tokens": 96, "ignore_eos": True,
        "algorithm": "fixed_steps", "algorithm_params": {"steps": 16}}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def completion(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt}  # the server's default max_tokens, as a user sends


async def concurrent_clients(base_url: str, prompts: list[str]) -> list[int]:
    """``CONCURRENT_CLIENTS`` clients, each sending its next request when its last one ended,
    for ``CONCURRENT_S`` seconds; the status of every answer."""
    statuses = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120, headers=bearer(ENV_KEY)) as http:
        async def one_client(offset: int) -> None:
            end, sent = time.monotonic() + CONCURRENT_S, 0
            while time.monotonic() < end:
                answer = await http.post("/v1/completions", json=completion(prompts[(offset + sent) % len(prompts)]))
                statuses.append(answer.status_code)
                sent += 1

        await asyncio.gather(*(one_client(i * 7) for i in range(CONCURRENT_CLIENTS)))
    return statuses


def haproxy_of(port: int) -> tuple[int, str] | None:
    listener = listening_process(port)
    return listener if listener is not None and is_haproxy(listener[1]) else None


def raw_status(port: int, headers: str) -> tuple[int, float]:
    """Send a POST's headers announcing a 20 MB body, never the body; the status line that
    comes back (so the server answered without reading the body) and how long it took."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 20000000\r\n{headers}\r\n").encode())
        status_line = sock.makefile("rb").readline().decode()
    return int(status_line.split()[1]), time.monotonic() - start


async def limited_key_in_flight(base_url: str) -> tuple[int, dict, int, int]:
    """While a long stream holds the file key's only place: a second request with it, and
    one with the other key."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True},
                                 headers=bearer(FILE_KEY)) as first:
            assert first.status_code == 200
            lines = first.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass  # its first block has arrived: the request is in flight
            second = await client.post("/v1/completions", json=LONG | {"max_tokens": 16}, headers=bearer(FILE_KEY))
            other = await client.post("/v1/completions", json=LONG | {"max_tokens": 16}, headers=bearer(ENV_KEY))
            async for _ in lines:
                pass
        again = await client.post("/v1/completions", json=LONG | {"max_tokens": 16}, headers=bearer(FILE_KEY))
        return second.status_code, second.json(), other.status_code, again.status_code


def _check_keys(cluster) -> None:
    base, port = cluster.base_url, int(cluster.base_url.rsplit(":", 1)[1])
    for path in ("/v1/models", "/docs", "/openapi.json"):
        assert httpx.get(base + path, timeout=30).status_code == 401, path
        assert httpx.get(base + path, headers=bearer("wrong-key-000"), timeout=30).status_code == 401, path
        assert httpx.get(base + path, headers=bearer(ENV_KEY), timeout=30).status_code == 200, path
    assert "/v1/completions" in httpx.get(base + "/openapi.json", headers=bearer(FILE_KEY), timeout=30).json()["paths"]

    status, took = raw_status(port, "")
    assert status == 401
    status_with_key, took_with_key = raw_status(port, f"Authorization: Bearer {ENV_KEY}\r\n")
    assert status_with_key == 413
    print(f"\n401 without a key in {took * 1000:.0f} ms, 413 with one in {took_with_key * 1000:.0f} ms "
          f"(20 MB announced, never sent)")

    second, body, other, again = asyncio.run(limited_key_in_flight(base))
    assert second == 429 and body["error"]["code"] == "key_concurrency_exceeded"
    assert other == 200 and again == 200

    shown = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=30).stdout
    log = open(cluster.log_path).read()
    assert "ready; Ctrl-C stops" in log and "2 API key(s) required" in log
    for key in (FILE_KEY, ENV_KEY):
        assert key not in shown and key not in log


def _check_fresh_cluster(cluster, prompts: list[str]) -> None:
    """The ingress replica holds the port itself, with no proxy of Serve's or HAProxy, and
    admission refuses nothing from a cold start."""
    port = int(cluster.base_url.rsplit(":", 1)[1])
    health = httpx.get(cluster.base_url + "/health", timeout=10).json()
    assert health["request_path"] == "ingress"  # the default
    assert health["replica_stderr_kept"]  # the project's warnings reach the replicas' logs
    assert health["replicas_reporting"] == 1  # `up` said ready once admission had a report
    listener = listening_process(port)
    assert listener is not None and "ServeReplica:dllm:Ingress" in listener[1], listener
    roles = {role for role, _ in cluster_cpu(serving_raylet(port)).values()}  # this cluster's processes
    assert {"ingress", "engine", "controller"} <= roles and not roles & {"proxy", "haproxy_manager", "haproxy"}, roles

    with httpx.Client(base_url=cluster.base_url, timeout=120, headers=bearer(ENV_KEY)) as http:
        statuses = [http.post("/v1/completions", json=completion(prompts[i])).status_code
                    for i in range(BACK_TO_BACK)]
    assert statuses == [200] * BACK_TO_BACK, statuses
    statuses = asyncio.run(concurrent_clients(cluster.base_url, prompts))
    assert len(statuses) >= CONCURRENT_CLIENTS and set(statuses) == {200}, statuses


def _check_haproxy(port: int) -> str:
    """HAProxy holds the port, run from this `up`'s own directory (returned), its backup
    server this cluster's own Serve proxy, not one on Serve's fixed 8500."""
    listener = haproxy_of(port)
    assert listener is not None, listening_process(port)  # HAProxy, not Serve's proxy, holds the port
    config_file = Path(listener[1].split(" -f ", 1)[1].split()[0])  # <run dir>/<node id>/haproxy.cfg
    run_dir = str(config_file.parents[1])
    assert Path(run_dir).name.startswith("dllm-haproxy-")
    backup = re.search(r"server SERVE_PROXY_ACTOR-fallback\S* 127\.0\.0\.1:(\d+)", config_file.read_text())
    assert backup is not None and int(backup.group(1)) != 8500, config_file.read_text()[-800:]
    return run_dir


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
    async with httpx.AsyncClient(base_url=base_url, timeout=120, headers=bearer(ENV_KEY)) as client:
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
    out["reference"] = reference
    return out


def _check_graceful_stop(cluster) -> None:
    process = cluster.process
    run = asyncio.run(_drain_scenario(process, cluster.base_url, cluster.metrics_url))
    process.wait(timeout=DRAIN_TIMEOUT_S + EXIT_MARGIN_S)
    exit_s = time.monotonic() - run["term_at"]
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
    # every ingress stopped, with nothing in flight and no admission charge outstanding (as
    # they reported it: a scrape of /metrics races the stop, one stats period behind)
    assert drained is not None, log


def test_fresh_cluster_serves_clients_checks_keys_restarts_at_once_on_its_ports_and_drains_on_sigterm(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# one client, one request at a time\n{FILE_KEY} 1\n")
    settings = SETTINGS | {"api_key_file": str(key_file)}
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    cluster = start_cluster(tmp_path / "first", settings, api_keys=ENV_KEY)
    ports = {"port": int(cluster.base_url.rsplit(":", 1)[1]),
             "metrics_port": int(cluster.metrics_url.split(":")[2].split("/")[0])}
    prompts = tiny_prompts(100, seed=3)
    try:
        _check_fresh_cluster(cluster, prompts)
        _check_keys(cluster)
        assert "dllm_" in cluster.metrics_text()  # a scrape just before the stop leaves TIME_WAIT behind
    finally:
        stop_cluster(cluster.process)
    assert cluster.process.returncode == 0
    assert listening_process(ports["port"]) is None  # nothing holds the API port

    # the same ports at once, HAProxy in front: the first run left nothing bound; then SIGTERM drains it
    again = start_cluster(tmp_path / "again", settings | DRAIN_SETTINGS | ports | {"request_path": "haproxy"},
                          api_keys=ENV_KEY, timeout_s=240)
    run_dir = None
    try:
        assert again.base_url == cluster.base_url
        run_dir = _check_haproxy(ports["port"])
        assert "dllm_" in again.metrics_text()
        answer = httpx.post(again.base_url + "/v1/completions", json=completion(prompts[0]), headers=bearer(FILE_KEY),
                            timeout=120)
        assert answer.status_code == 200, answer.text
        _check_graceful_stop(again)
    finally:
        stop_cluster(again.process)
    assert run_dir is not None and not processes_mentioning(run_dir)  # its HAProxy ended
    assert not Path(run_dir).exists()  # and its files are gone
