"""Every Grafana query returns data and every alert expression evaluates, on a real
Prometheus scraping `dllm-serve up` (our metrics and Ray's) under load."""

import math
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.cli import _EXAMPLE_PROMPT
from observability import alert_exprs, dashboard_targets, dashboard_variable_queries, fill_variables

pytestmark = pytest.mark.timeout(420)

BURST = 8
MAX_BURSTS = 150  # bounds the load: at most 1200 requests, all to 127.0.0.1


class Load(threading.Thread):
    """Bursts of concurrent requests (half streamed) until stopped: some admitted, and a
    quarter with a deadline of 10 ms, which admission refuses while others are in flight."""

    def __init__(self, base_url: str, api_key: str):
        super().__init__(daemon=True)
        self.base_url, self.stop, self.codes = base_url, threading.Event(), Counter()
        self.headers = {"Authorization": f"Bearer {api_key}"}

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60, headers=self.headers) as client, \
                ThreadPoolExecutor(BURST) as pool:
            def send(i: int) -> int:
                body = {"model": "tiny", "prompt": _EXAMPLE_PROMPT, "stream": i % 2 == 0}
                if i % 4 == 3:
                    body["deadline_s"] = 0.01
                return client.post("/v1/completions", json=body).status_code

            for _ in range(MAX_BURSTS):
                if self.stop.is_set():
                    return
                self.codes.update(pool.map(send, range(BURST)))


def query(prometheus: str, expr: str) -> dict:
    return httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()


def has_number(answer: dict) -> bool:
    result = answer.get("data", {}).get("result", []) if answer["status"] == "success" else []
    return any(math.isfinite(float(series["value"][1])) for series in result)


def test_every_dashboard_query_returns_data_under_load(observed):
    cluster, prometheus = observed
    load = Load(cluster.base_url, cluster.api_key)
    load.start()
    try:
        deadline = time.monotonic() + 150
        while True:
            missing = [(title, expr) for title, expr in dashboard_targets()
                       if not has_number(query(prometheus, fill_variables(expr)))]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(2)
    finally:
        load.stop.set()
        load.join(timeout=120)
    assert not missing, f"dashboard queries without data: {missing}; load got {dict(load.codes)}"
    assert load.codes[200] and load.codes[429], f"load got {dict(load.codes)}: both admissions and refusals needed"
    usage = query(prometheus, "max(max_over_time(dllm_kv_cache_usage[5m]))")["data"]["result"]
    assert usage and 0 < float(usage[0]["value"][1]) <= 1, f"KV cache usage under load: {usage}"
    for expr in dashboard_variable_queries():
        assert query(prometheus, expr)["data"]["result"], f"variable query {expr} lists nothing"


def test_every_alert_expression_evaluates(observed):
    _, prometheus = observed
    for name, expr in alert_exprs():
        answer = query(prometheus, expr)
        assert answer["status"] == "success", f"{name}: {answer.get('error')}"
    deadline = time.monotonic() + 30
    while True:  # Prometheus loaded rules.yaml itself; wait for an evaluation of each rule
        rules = [rule for group in httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
                 for rule in group["rules"]]
        if all(rule["lastEvaluation"] > "2000" for rule in rules) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert sorted(rule["name"] for rule in rules) == sorted(name for name, _ in alert_exprs())
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]
