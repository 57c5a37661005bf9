"""`dllm-serve up` as a subprocess (Ray Serve, HTTP on 127.0.0.1), for every test folder
that needs a real one: ``from live_up import start_cluster, stop_cluster``."""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import yaml

from cluster.auth import API_KEYS_ENV


# below Linux's ephemeral ports (32768-60999) and above Ray's worker ports (10002-19999):
# a port picked here is never handed by the kernel to a socket bound to port 0 (Ray's
# services bind dozens) between the moment it is picked and the moment a test binds it
TEST_PORTS = range(20000, 32000)
_pick = random.SystemRandom()  # not the global generator, which hypothesis seeds


def free_port() -> int:
    """A port of ``TEST_PORTS`` free on 127.0.0.1 now."""
    for _ in range(1000):
        port = _pick.choice(TEST_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")


@dataclass
class Cluster:
    base_url: str
    metrics_url: str
    model: str
    process: subprocess.Popen
    log_path: str
    ray_address: str  # its Ray cluster's, for `dllm-serve status --address`
    config: dict  # what it was started with (the ports included)
    api_key: str | None = None  # one of its keys, when it has any

    def metrics_text(self) -> str:
        return httpx.get(self.metrics_url, timeout=10).text


def start_cluster(tmp_path, settings: dict, timeout_s: float = 180, api_keys: str | None = None) -> Cluster:
    """`dllm-serve up` with ``settings``; ``api_keys`` reach it in DLLM_API_KEYS, never on its command line."""
    port, metrics_port = free_port(), free_port()
    config = {"port": port, "metrics_port": metrics_port, **settings}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = str(tmp_path / "up.log")
    log = open(log_path, "w")
    env = {k: v for k, v in os.environ.items() if k != API_KEYS_ENV}
    if api_keys is not None:
        env[API_KEYS_ENV] = api_keys
    process = subprocess.Popen([sys.executable, "-m", "tools.cli", "up", "--config", str(path)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
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
    key = api_keys.split(",")[0].split()[0] if api_keys else None
    ray_address = text.split("dllm-serve status --address ", 1)[1].split()[0]
    return Cluster(f"http://127.0.0.1:{config['port']}", f"http://127.0.0.1:{config['metrics_port']}/metrics",
                   "tiny", process, log_path, ray_address, config, key)


def stop_cluster(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
