"""A real `dllm-serve up` scraped by a real Prometheus (Debian's package), under load."""

import subprocess
import time

import httpx
import pytest
import yaml

from observability import RULES, binary

import live_up as cluster_helpers


def _prometheus_config(dllm_target: str, ray_target: str) -> dict:
    """Jobs named as in deploy/prometheus (dllm, ray), the committed rules, 1 s scrapes."""
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "dllm", "static_configs": [{"targets": [dllm_target]}]},
                           {"job_name": "ray", "static_configs": [{"targets": [ray_target]}]}],
    }


@pytest.fixture(scope="package")
def observed(cluster, tmp_path_factory):
    """(cluster, Prometheus base URL): the session's shared cluster, its metrics and Ray's
    scraped every second."""
    tmp = tmp_path_factory.mktemp("observed")
    ray_port = cluster.config["ray_metrics_port"]
    prometheus = None
    try:
        dllm_target = cluster.metrics_url.removeprefix("http://").removesuffix("/metrics")
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(_prometheus_config(dllm_target, f"127.0.0.1:{ray_port}")))
        prom_port = cluster_helpers.free_port()
        prometheus = subprocess.Popen(
            [binary("prometheus"), f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=open(tmp / "prometheus.log", "w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{prom_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert prometheus.poll() is None and time.monotonic() < deadline, (tmp / "prometheus.log").read_text()
            time.sleep(0.5)
        yield cluster, url
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
