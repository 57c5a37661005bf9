"""API keys on a real `dllm-serve up`: read from a file and the environment, never shown;
checked before the body is read; limited per key; the API description behind them too.
And `up` starts again at once on the ports it just left."""

import asyncio
import socket
import subprocess
import time

import httpx

from live_up import start_cluster, stop_cluster

FILE_KEY, ENV_KEY = "file-key-0001", "env-key-0002"
SETTINGS = {"replica": {"max_batch": 4, "torch_threads": 1}, "ingress": {"max_body_bytes": 4096},
            "admission": {"enabled": False}}
LONG = {"model": "tiny", "prompt": "1.2..3", "max_tokens": 192, "ignore_eos": True,
        "algorithm": "fixed_steps", "algorithm_params": {"steps": 16}}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


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


def test_keys_are_enforced_and_never_shown_and_up_restarts_at_once_on_its_ports(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# one client, one request at a time\n{FILE_KEY} 1\n")
    settings = SETTINGS | {"api_key_file": str(key_file)}
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = start_cluster(tmp_path / "first", settings, api_keys=ENV_KEY)
    ports = {"port": int(first.base_url.rsplit(":", 1)[1]),
             "metrics_port": int(first.metrics_url.split(":")[2].split("/")[0])}
    try:
        _check_keys(first)
        assert "dllm_" in first.metrics_text()  # a scrape just before the stop leaves TIME_WAIT behind
    finally:
        stop_cluster(first.process)
    second = start_cluster(tmp_path / "second", settings | ports, api_keys=ENV_KEY)  # at once, the same ports
    try:
        assert "dllm_" in second.metrics_text()
        answer = httpx.post(second.base_url + "/v1/completions", json=LONG | {"max_tokens": 16}, headers=bearer(FILE_KEY),
                            timeout=60)
        assert answer.status_code == 200
    finally:
        stop_cluster(second.process)
