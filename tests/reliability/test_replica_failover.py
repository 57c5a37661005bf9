"""A replica that dies, or whose steps fail, costs no request: the ingress resumes each of
its requests on the other replica from the blocks already committed, and the client gets
the same text a fault-free run gives (greedy decoding)."""

import asyncio
import time
from collections import Counter

import httpx
import pytest
from ray import serve

from reliability_cluster import live_cluster, run, stream_completion, wait_for

SETTINGS = {
    "replica": {"max_batch": 16, "torch_threads": 1},
    "autoscaling": {"min_replicas": 2, "max_replicas": 2},
    "admission": {"enabled": False},
    "stats_period_s": 0.25,
}
PROMPTS = [f"{i}.{i % 7}..{(3 * i) % 10}.{i % 4}" for i in range(16)]
BODY = {"model": "tiny", "max_tokens": 192, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster():
    with live_cluster(SETTINGS) as running:
        wait_for(lambda: len(running.replicas()) == 2, 120, "two replicas reporting")
        yield running


async def _streams(cluster, on_chunk=None) -> list[dict]:
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
        return await asyncio.gather(*(stream_completion(client, {**BODY, "prompt": p}, on_chunk) for p in PROMPTS))


@pytest.fixture(scope="module")
def fault_free(cluster) -> list[str]:
    results = run(_streams(cluster))
    assert all(r["status"] == 200 and r["error"] is None and r["finish_reason"] == "length" for r in results), \
        [r for r in results if r["status"] != 200 or r["error"] is not None or r["finish_reason"] != "length"]
    return [r["text"] for r in results]


def test_sigkill_of_a_replica_during_16_streams_loses_nothing(cluster, fault_free):
    failovers_before = cluster.metric("dllm_failovers_total")
    in_flight: Counter[str] = Counter()
    killed = {}

    def on_chunk(replica):
        in_flight[replica] += 1
        if not killed and sum(in_flight.values()) >= 8:  # streams under way on both replicas
            victim = in_flight.most_common(1)[0][0]
            cluster.kill_replica(victim)
            killed.update(replica=victim, at=time.monotonic())

    results = run(_streams(cluster, on_chunk))
    done = time.monotonic()
    assert killed, "the streams finished before a replica could be killed"
    errors = [r for r in results if r["status"] != 200 or r["error"]]
    assert not errors, errors
    assert [r["text"] for r in results] == fault_free
    resumed = [r for r in results if killed["replica"] in r["replicas"][:-1]]
    assert resumed, "no stream moved off the killed replica"
    print(f"\n16/16 completed; {len(resumed)} resumed on the other replica; "
          f"last stream done {done - killed['at']:.2f} s after the kill")
    wait_for(lambda: cluster.metric("dllm_failovers_total") >= failovers_before + len(resumed), 30,
             "the failovers counted on /metrics")
    replaced = wait_for(lambda: len(cluster.replicas()) == 2 and killed["replica"] not in cluster.replicas(),
                        120, "Serve to replace the killed replica")
    print(f"replacement replica reporting {time.monotonic() - killed['at']:.1f} s after the kill")
    assert replaced


def _inject(steps: int) -> str:
    handle = serve.get_deployment_handle("EngineReplica", app_name="dllm")
    return handle.inject_faults.remote(steps).result(timeout_s=30)


def test_one_failing_step_fails_only_its_rows_and_they_resume(cluster, fault_free):
    replicas_before = set(cluster.replicas())
    failovers_before = cluster.metric("dllm_failovers_total")
    faulty = _inject(1)
    results = run(_streams(cluster))
    assert all(r["status"] == 200 and r["error"] is None for r in results)
    assert [r["text"] for r in results] == fault_free
    failovers = wait_for(lambda: cluster.metric("dllm_failovers_total") - failovers_before, 30,
                         "the failed step's rows counted as failovers on /metrics")
    assert failovers <= SETTINGS["replica"]["max_batch"]  # the rows of one step, not every request
    assert set(cluster.replicas()) == replicas_before  # nobody was replaced
    assert cluster.replicas()[faulty]["failing_steps"] == 0


def test_a_replica_whose_steps_always_fail_is_replaced_and_its_requests_complete(cluster, fault_free):
    faulty = _inject(-1)
    start = time.monotonic()
    rounds = []

    def faulty_failed() -> bool:
        """One round of streams, until the faulty replica has failed some (the ingress ranks a
        replica that failed a request last for a while: the previous test's may get none at first)."""
        rounds.append(run(_streams(cluster)))
        replicas = cluster.replicas()
        return faulty not in replicas or replicas[faulty]["failing_steps"] > 0

    wait_for(faulty_failed, 120, "the faulty replica to fail the requests it was sent", period_s=0)
    for results in rounds:
        assert all(r["status"] == 200 and r["error"] is None for r in results), results
        assert [r["text"] for r in results] == fault_free
        assert all(faulty not in r["replicas"] or r["replicas"][-1] != faulty for r in results)
    wait_for(lambda: faulty not in cluster.replicas() and len(cluster.replicas()) == 2, 120,
             "Serve to replace the failing replica")
    print(f"\nfailing replica replaced {time.monotonic() - start:.1f} s after its steps began to fail")
