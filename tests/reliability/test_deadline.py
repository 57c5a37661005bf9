"""A request past ``request_timeout_s`` ends with a timeout error (504, or an error event
in a stream), and its pages and admission charge are freed; no request is lost."""

import asyncio

import httpx

from reliability_cluster import live_cluster, run, stream_completion, wait_for

SETTINGS = {
    "replica": {"max_batch": 1, "torch_threads": 1},
    "slo": {"latency_s": 600},  # admission charges every request, refuses none
    "request_timeout_s": 1.5,
    "stats_period_s": 0.25,
}
# 28 blocks x 16 steps (448 forwards): 0.3 s or more for a request alone even on a fast
# machine, so the eight together need several times the 1.5 s deadline and queued ones
# outlive it (12 blocks x 8 steps finished all eight within it on a quiet machine)
BODY = {"model": "tiny", "prompt": "1.2..3", "max_tokens": 448, "ignore_eos": True,
        "algorithm": "fixed_steps", "algorithm_params": {"steps": 16}}


async def _burst(base_url: str) -> tuple[list[httpx.Response], dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        plain = [client.post("/v1/completions", json=BODY) for _ in range(7)]
        return await asyncio.gather(asyncio.gather(*plain), stream_completion(client, BODY))


def test_requests_past_their_deadline_time_out_and_free_everything():
    with live_cluster(SETTINGS) as cluster:
        wait_for(lambda: len(cluster.replicas()) == 1, 120, "the replica reporting")
        responses, streamed = run(_burst(cluster.base_url))
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 504}, [r.text for r in responses]
        timed_out = [r.json()["error"] for r in responses if r.status_code == 504]
        assert timed_out, "no request outlived the 1.5 s deadline"
        assert all(e["type"] == "timeout_error" and e["code"] == "request_timeout" for e in timed_out)
        assert all("deadline of 1.5 s" in e["message"] for e in timed_out)
        assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in responses if r.status_code == 200)
        assert streamed["status"] == 200
        assert streamed["finish_reason"] == "length" or streamed["error"]["code"] == "request_timeout"

        def everything_free():
            [view] = cluster.replicas().values()
            return (view["free_pages"] == view["total_pages"] and view["live_requests"] == 0
                    and view["running"] == 0 and view["waiting"] == 0
                    and cluster.metric("dllm_admission_outstanding") == 0)
        wait_for(everything_free, 30, "pages, requests and admission charges to be freed")
        print(f"\n{statuses.count(200)} completed, {len(timed_out)} timed out, stream: "
              f"{streamed['finish_reason'] or streamed['error']['code']}")
