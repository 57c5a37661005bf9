"""Live clusters for failure tests: deployed in this process (so a test can reach the
replicas' handles and the metrics actor), serving real HTTP on 127.0.0.1."""

import asyncio
import json
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import ray

from cluster.app import deploy, shutdown
from cluster.config import AppConfig
from cluster.metrics import ACTOR_NAME, ACTOR_NAMESPACE
from cluster.request_path import LocalRequestPath
from live_up import free_port


@dataclass
class LiveCluster:
    config: AppConfig
    base_url: str
    metrics_url: str

    def metrics_actor(self):
        return ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)

    def replicas(self, fresh_s: float = 5.0) -> dict[str, dict]:
        """The routing stats (pid and node included) of the replicas that reported in the
        last ``fresh_s`` seconds, by replica id (the metrics actor keeps a silent one's for
        ``replicas.telemetry.reports.stale_after_s``)."""
        views = ray.get(self.metrics_actor().cluster_view.remote(), timeout=30)
        return {replica: view for replica, view in views.items() if view["age_s"] <= fresh_s}

    def kill_replica(self, replica_id: str) -> None:
        """SIGKILL the worker process of one of this cluster's engine replicas."""
        os.kill(self.replicas()[replica_id]["pid"], signal.SIGKILL)

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on the metrics actor's /metrics."""
        total = 0.0
        for line in httpx.get(self.metrics_url, timeout=10).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextmanager
def live_cluster(settings: dict, address: str | None = None):
    config = AppConfig.model_validate({"port": free_port(), "metrics_port": free_port(), **settings})
    path = None if address else LocalRequestPath(config.request_path)
    try:
        metrics_url = deploy(config, address=address, request_path=path)
        yield LiveCluster(config, f"http://127.0.0.1:{config.port}", metrics_url)
    finally:
        shutdown(config, path)


def wait_for(condition, timeout_s: float, what: str, period_s: float = 0.2):
    """Poll ``condition()`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def stream_completion(client: httpx.AsyncClient, body: dict, on_chunk=None) -> dict:
    """One streamed completion: its text, finish reason, the replicas that served it, or
    the error event / HTTP status that ended it. ``on_chunk(replica, first)`` sees each
    chunk's replica, and whether it is the stream's first."""
    text, replicas, finish, error = [], [], None, None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "error": json.loads(await response.aread())}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                error = event["error"]
                break
            choice = event["choices"][0]
            text.append(choice["text"])
            replica = event["dllm"]["replica"]
            if not replicas or replicas[-1] != replica:
                replicas.append(replica)
            finish = choice["finish_reason"] or finish
            if on_chunk is not None:
                on_chunk(replica, len(text) == 1)
    return {"status": 200, "text": "".join(text), "finish_reason": finish, "replicas": replicas, "error": error}


def run(coroutine):
    return asyncio.run(coroutine)
