"""`dllm-serve up` with its defaults, as a new user starts it: HAProxy in front, admission
right from the first request, and a stop that frees every port for the next `up` at once.

One cluster, fresh: a client sends 50 requests back to back, then 12 concurrent clients
send for a few seconds; no request is refused. Then `up` stops (Ctrl-C) and starts again
on the same ports, and serves.
"""

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest

from cluster.request_path import processes_mentioning
from live_up import start_cluster, stop_cluster
from loadgen.arrivals import tiny_prompts
from loadgen.overload import is_haproxy, listening_process

pytestmark = pytest.mark.timeout(900)

BACK_TO_BACK = 50
CONCURRENT_CLIENTS, CONCURRENT_S = 12, 5.0
SETTINGS = {"replica": {"torch_threads": 1}}  # everything else as `up` ships it


def completion(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt}  # the server's default max_tokens, as a user sends


async def concurrent_clients(base_url: str, prompts: list[str]) -> list[int]:
    """``CONCURRENT_CLIENTS`` clients, each sending its next request when its last one ended,
    for ``CONCURRENT_S`` seconds; the status of every answer."""
    statuses = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
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


def test_fresh_cluster_serves_back_to_back_and_concurrent_clients_then_restarts_on_its_ports(tmp_path):
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    cluster = start_cluster(tmp_path / "first", SETTINGS)
    port = int(cluster.base_url.rsplit(":", 1)[1])
    prompts = tiny_prompts(100, seed=3)
    try:
        health = httpx.get(cluster.base_url + "/health", timeout=10).json()
        assert health["request_path"] == "haproxy"  # the ingress replicas run Serve with HAProxy on
        assert health["replicas_reporting"] == 1  # `up` said ready once admission had a report
        listener = haproxy_of(port)
        assert listener is not None, listening_process(port)  # and HAProxy, not Serve's proxy, holds the port
        config_file = Path(listener[1].split(" -f ", 1)[1].split()[0])  # <run dir>/<node id>/haproxy.cfg
        run_dir = str(config_file.parents[1])
        assert Path(run_dir).name.startswith("dllm-haproxy-")  # this `up`'s own directory
        # HAProxy's backup server is this cluster's own Serve proxy, not one on Serve's fixed 8500
        backup = re.search(r"server SERVE_PROXY_ACTOR-fallback\S* 127\.0\.0\.1:(\d+)", config_file.read_text())
        assert backup is not None and int(backup.group(1)) != 8500, config_file.read_text()[-800:]

        with httpx.Client(base_url=cluster.base_url, timeout=120) as http:
            statuses = [http.post("/v1/completions", json=completion(prompts[i])).status_code
                        for i in range(BACK_TO_BACK)]
        assert statuses == [200] * BACK_TO_BACK, statuses
        statuses = asyncio.run(concurrent_clients(cluster.base_url, prompts))
        assert len(statuses) >= CONCURRENT_CLIENTS and set(statuses) == {200}, statuses
    finally:
        stop_cluster(cluster.process)
    assert cluster.process.returncode == 0
    assert listening_process(port) is None  # nothing holds the API port
    assert not processes_mentioning(run_dir) and not Path(run_dir).exists()  # its HAProxy ended, its files gone

    # the same ports at once: the first run left nothing bound
    again = start_cluster(tmp_path / "again", {**SETTINGS, "port": port,
                                                "metrics_port": int(cluster.metrics_url.split(":")[2].split("/")[0])})
    try:
        assert again.base_url == cluster.base_url and haproxy_of(port) is not None
        answer = httpx.post(again.base_url + "/v1/completions", json=completion(prompts[0]), timeout=120)
        assert answer.status_code == 200, answer.text
    finally:
        stop_cluster(again.process)
