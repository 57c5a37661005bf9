"""A real `dllm-serve up` (Ray Serve, HTTP on 127.0.0.1) shared by the cluster tests."""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest
import yaml


API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Cluster:
    base_url: str
    metrics_url: str
    model: str
    process: subprocess.Popen
    log_path: str

    def metrics_text(self) -> str:
        return httpx.get(self.metrics_url, timeout=10).text


def start_cluster(tmp_path, settings: dict, timeout_s: float = 180) -> Cluster:
    port, metrics_port = free_port(), free_port()
    config = {"port": port, "metrics_port": metrics_port, **settings}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = str(tmp_path / "up.log")
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, "-m", "cluster.cli", "up", "--config", str(path)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = open(log_path).read()
        if "ready; Ctrl-C stops" in text:
            break
        if process.poll() is not None:
            raise RuntimeError(f"dllm-serve up exited early:\n{text}")
        time.sleep(0.5)
    else:
        stop_cluster(process)
        raise RuntimeError(f"dllm-serve up did not become ready:\n{open(log_path).read()}")
    return Cluster(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics",
                   "tiny", process, log_path)


def stop_cluster(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    """Two replicas of the tiny model; admission capacity small enough to test refusals."""
    settings = {
        "replica": {"max_batch": 16, "torch_threads": 1},
        "autoscaling": {"min_replicas": 2, "max_replicas": 2},
        "admission": {"max_step_debt_per_replica": 5000},
        "stats_period_s": 0.25,
        "api_key": API_KEY,
    }
    running = start_cluster(tmp_path_factory.mktemp("cluster"), settings)
    yield running
    stop_cluster(running.process)
    assert running.process.returncode is not None
