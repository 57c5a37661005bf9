"""Failures under load on one live cluster of three Ray nodes on this machine
(``ray.cluster_utils.Cluster``: a head and two workers, one CPU each) with two engine
replicas, each followed by its recovery. The node loss comes first after the deadlines,
while Serve's first placement holds (one engine a node); the kills run on what is left:

* a request past its deadline ends with what it committed (``finish_reason`` "timeout"),
  or where it committed nothing with a timeout error (504, or an error event in a stream),
  and its pages and admission charge are freed; no request is lost;
* a node that leaves costs no request: its replica's requests resume on the surviving
  node's replica, and Serve places a replacement on a surviving node;
* the metrics actor can die without disturbing serving: requests keep succeeding while it
  is killed and restarted, its Prometheus endpoint is back on the same port within 10 s,
  and the replicas and the ingress fill it again;
* a replica that dies, or whose steps fail, costs no request: the ingress resumes each of
  its requests on the other replica from the blocks already committed, and the client gets
  the same text a fault-free run gives (greedy decoding)."""

import asyncio
import os
import signal
import time
from collections import Counter

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from reliability_cluster import live_cluster, run, stream_completion, wait_for

import cluster.app as cluster_app
from tests.replicas.step_spies import faulty_replica_class

REPLICAS = 2
SETTINGS = {
    # one CPU a node: the ingress fills one node, so the two engines land on the other two
    "ingress": {"num_cpus": 1.0, "replicas": 1},
    "replica": {"max_batch": 16, "torch_threads": 1, "num_cpus": 0.5},
    "autoscaling": {"min_replicas": REPLICAS, "max_replicas": REPLICAS},
    "admission": {"enabled": False},  # it still charges every request (and frees the charges)
    "stats_period_s": 0.25,
}
PROMPTS = [f"{i}.{i % 7}..{(3 * i) % 10}.{i % 4}" for i in range(16)]
BODY = {"model": "tiny", "max_tokens": 96, "ignore_eos": True}
KILL_BODY = {"model": "tiny", "prompt": "1.3. ..2. 4... .1.4", "max_tokens": 48}
CLIENTS = 4
BACK_WITHIN_S = 10.0
LOAD_AFTER_BACK_S = 3.0
MAX_LOAD_S = 60.0  # the load stops by then whatever happens
MAX_REQUESTS = 2000
# 28 blocks x 16 steps (448 forwards): 0.3 s or more for a request alone even on a fast
# machine, so eight together outlive a deadline of 1.5 s
DEADLINE_S = 1.5
DEADLINE_BODY = {"model": "tiny", "prompt": "1.2..3", "max_tokens": 448, "ignore_eos": True,
                 "algorithm": "fixed_steps", "algorithm_params": {"steps": 16}, "deadline_s": DEADLINE_S}
NODE_LOSS_REQUESTS = 32


@pytest.fixture(scope="module")
def ray_nodes():
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [nodes.add_node(num_cpus=1) for _ in range(2)]
    nodes.wait_for_nodes()
    yield nodes, workers
    nodes.shutdown()


@pytest.fixture(scope="module")
def cluster(ray_nodes):
    nodes, _ = ray_nodes
    # the engine replicas take faults on demand (``_inject``)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cluster_app, "EngineReplica", faulty_replica_class())
        with live_cluster(SETTINGS, address=nodes.address) as running:
            wait_for(lambda: len(running.replicas()) == REPLICAS, 180, "both replicas reporting")
            yield running


async def _burst(base_url: str) -> tuple[list[httpx.Response], dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        plain = [client.post("/v1/completions", json=DEADLINE_BODY) for _ in range(7)]
        return await asyncio.gather(asyncio.gather(*plain), stream_completion(client, DEADLINE_BODY))


def test_requests_past_their_deadline_time_out_and_free_everything(cluster):
    responses, streamed = run(_burst(cluster.base_url))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 504}, [r.text for r in responses]
    answers = [r.json() for r in responses if r.status_code == 200]
    cut = [a["usage"]["completion_tokens"] for a in answers if a["choices"][0]["finish_reason"] == "timeout"]
    timed_out = [r.json()["error"] for r in responses if r.status_code == 504]  # before a token was committed
    assert cut or timed_out, f"no request outlived the {DEADLINE_S:g} s deadline"
    assert all(a["choices"][0]["finish_reason"] in ("length", "timeout") for a in answers)
    assert all(tokens % 16 == 0 and tokens < DEADLINE_BODY["max_tokens"] for tokens in cut)  # committed blocks
    assert all(e["type"] == "timeout_error" and e["code"] == "request_timeout" for e in timed_out)
    assert all(f"deadline of {DEADLINE_S:g} s" in e["message"] for e in timed_out)
    assert streamed["status"] == 200
    assert streamed["finish_reason"] in ("length", "timeout") or streamed["error"]["code"] == "request_timeout"

    def everything_free():
        return all(view["free_pages"] == view["total_pages"] and view["live_requests"] == 0
                   and view["running"] == 0 and view["waiting"] == 0
                   for view in cluster.replicas().values()) and cluster.metric("dllm_admission_outstanding") == 0
    try:
        wait_for(everything_free, 60, "pages, requests and admission charges to be freed")
    except AssertionError as exc:  # say what is still held
        held = {replica: {key: view[key] for key in ("free_pages", "total_pages", "live_requests", "running", "waiting")}
                for replica, view in cluster.replicas().items()}
        raise AssertionError(f"{exc}: {held}, admission {cluster.metric('dllm_admission_outstanding')}") from None
    print(f"\n{len(answers) - len(cut)} completed, {len(cut)} cut by the deadline, {len(timed_out)} timed out "
          f"before a token, stream: "
          f"{streamed['finish_reason'] or streamed['error']['code']}")



def test_a_node_removed_under_load_costs_no_request(ray_nodes, cluster):
    nodes, workers = ray_nodes
    views = wait_for(lambda: (v := cluster.replicas()) and len(v) == 2 and v, 180, "two replicas reporting")
    placed = {view["node"] for view in views.values()}
    assert len(placed) == 2, "the two replicas share a node"
    workers_by_node = {w.node_id: w for w in workers}
    removed = {}

    def on_chunk(replica, first):
        # Serve may place one engine on the head, and the router may send a burst to one
        # replica: the first chunk from a replica on a worker node takes that node away
        node = views[replica]["node"]
        if not removed and node in workers_by_node:
            nodes.remove_node(workers_by_node[node], allow_graceful=False)
            # a lost machine takes its processes at once; on this one the node's workers
            # would linger until they notice their raylet is gone
            os.kill(views[replica]["pid"], signal.SIGKILL)
            removed.update(node=node, at=time.monotonic())

    async def load():
        """Streams started four at a time until a worker node has left (at most NODE_LOSS_REQUESTS)."""
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client:
            streams = []
            while not removed and len(streams) < NODE_LOSS_REQUESTS:
                for i in range(len(streams), len(streams) + 4):
                    body = {**BODY, "prompt": f"{i}.{i}..{i % 3}"}
                    streams.append(asyncio.create_task(stream_completion(client, body, on_chunk)))
                await asyncio.wait(streams, timeout=0.25)
            return await asyncio.gather(*streams)

    results = run(load())
    done = time.monotonic()
    assert removed, f"no replica on a worker node streamed in {NODE_LOSS_REQUESTS} requests"
    survivors = (placed | set(workers_by_node)) - {removed["node"]}
    assert all(r["status"] == 200 and r["error"] is None and r["finish_reason"] == "length" for r in results), \
        [r["error"] for r in results if r["error"]]
    # the node left at its replica's first chunk, so that stream finished elsewhere
    assert any(len(r["replicas"]) > 1 for r in results), [r["replicas"] for r in results]
    print(f"\n{len(results)}/{len(results)} completed; last one {done - removed['at']:.1f} s after the node left")
    replaced = wait_for(lambda: (v := cluster.replicas()) and len(v) == 2
                        and all(view["node"] in survivors for view in v.values()), 180,
                        "a replacement replica on a surviving node")
    print(f"replacement reporting {time.monotonic() - removed['at']:.1f} s after the node left")
    assert replaced


def sample_sum(text: str, name: str) -> float | None:
    """The sum of a metric's samples in a Prometheus text page; None when it has none."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + " ") or line.startswith(name + "{")]
    return sum(values) if values else None


async def _client(client: httpx.AsyncClient, n: int, stop: asyncio.Event, results: list) -> None:
    """Requests one after another until ``stop``: streamed and not, alternately."""
    i = 0
    while not stop.is_set() and len(results) < MAX_REQUESTS:
        body = {**KILL_BODY, "seed": n * 1000 + i}
        if i % 2:
            result = await stream_completion(client, body)
            ok = result["status"] == 200 and result["error"] is None and result["finish_reason"] is not None
            results.append((time.monotonic(), result["status"] if ok else result))
        else:
            response = await client.post("/v1/completions", json=body)
            ok = response.status_code == 200 and response.json()["choices"][0]["finish_reason"] is not None
            results.append((time.monotonic(), 200 if ok else (response.status_code, response.text)))
        i += 1


async def _scrape(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        response = await client.get(url, timeout=1.0)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


async def _kill_under_load(cluster) -> dict:
    stop = asyncio.Event()
    results: list = []
    timings: dict = {}
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as client, \
            httpx.AsyncClient() as scraper:
        clients = [asyncio.create_task(_client(client, n, stop, results)) for n in range(CLIENTS)]
        try:
            while len(results) < 2 * CLIENTS:  # the load is under way
                assert time.monotonic() - start < MAX_LOAD_S, "no requests completed"
                await asyncio.sleep(0.05)
            before = await _scrape(scraper, cluster.metrics_url)
            steps_before = sample_sum(before, "dllm_steps_total")
            actor = cluster.metrics_actor()
            killed = time.monotonic()
            ray.kill(actor, no_restart=False)
            timings["requests_before_kill"] = len(results)
            # back: the restarted actor answers (seen down first, or with counters that started afresh)
            down = False
            while True:
                text = await _scrape(scraper, cluster.metrics_url)
                if text is None:
                    down = True
                elif down or (sample_sum(text, "dllm_steps_total") or 0) < (steps_before or 0):
                    timings["back_s"] = time.monotonic() - killed
                    break
                assert time.monotonic() - killed < 3 * BACK_WITHIN_S, "/metrics did not come back"
                await asyncio.sleep(0.05)
            # filled again: the replica's step counters and its gauges, the ingress's totals
            while True:
                text = await _scrape(scraper, cluster.metrics_url) or ""
                admitted = sample_sum(text, "dllm_admitted_total") or 0
                if ((sample_sum(text, "dllm_steps_total") or 0) > 0 and sample_sum(text, "dllm_replicas") == REPLICAS
                        and admitted >= timings["requests_before_kill"]):
                    timings["refilled_s"] = time.monotonic() - killed
                    break
                assert time.monotonic() - killed < 3 * BACK_WITHIN_S + 30, f"/metrics not refilled:\n{text}"
                await asyncio.sleep(0.1)
            back_at = time.monotonic()
            while time.monotonic() - back_at < LOAD_AFTER_BACK_S and time.monotonic() - start < MAX_LOAD_S:
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 120)
    timings["killed_at"] = killed
    return {"results": results, **timings}


def test_killing_the_metrics_actor_disturbs_no_request(cluster):
    run = asyncio.run(_kill_under_load(cluster))
    results = run["results"]
    failed = [status for _, status in results if status != 200]
    during = [t for t, _ in results if t > run["killed_at"]]
    print(f"\n{len(results)} requests, {len(results) - len(failed)} succeeded ({len(during)} finished after the "
          f"kill); /metrics back {run['back_s']:.2f} s after the kill, replica and ingress metrics on it "
          f"{run['refilled_s']:.2f} s after")
    assert not failed, failed[:5]
    assert during, "no request completed while the metrics actor was down or restarting"
    assert run["back_s"] <= BACK_WITHIN_S
    # the restarted actor serves the cluster view again
    assert wait_for(lambda: len(cluster.replicas()) == REPLICAS, 30, "the replicas in the cluster view")


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

    def on_chunk(replica, first):
        in_flight[replica] += 1
        # once streams are under way, the replica of a stream that has just begun (its other
        # blocks still to compute: on a busy machine a replica may have finished its first
        # streams before the others were even sent)
        if not killed and first and sum(in_flight.values()) >= 8:
            cluster.kill_replica(replica)
            killed.update(replica=replica, at=time.monotonic())

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


def _inject(cluster, steps: int) -> str:
    """Faults into the next ``steps`` steps (-1: every one) of the replica the call reaches,
    once both replicas report (a test before may have left one being replaced)."""
    wait_for(lambda: len(cluster.replicas()) == REPLICAS, 120, "both replicas reporting")
    handle = serve.get_deployment_handle("EngineReplica", app_name="dllm")
    return handle.inject_faults.remote(steps).result(timeout_s=30)


def test_one_failing_step_fails_only_its_rows_and_they_resume(cluster, fault_free):
    failovers_before = cluster.metric("dllm_failovers_total")
    faulty = _inject(cluster, 1)
    replicas_before = set(cluster.replicas())
    results = run(_streams(cluster))
    assert all(r["status"] == 200 and r["error"] is None for r in results)
    assert [r["text"] for r in results] == fault_free
    failovers = wait_for(lambda: cluster.metric("dllm_failovers_total") - failovers_before, 30,
                         "the failed step's rows counted as failovers on /metrics")
    assert failovers <= SETTINGS["replica"]["max_batch"]  # the rows of one step, not every request
    assert set(cluster.replicas()) == replicas_before  # nobody was replaced
    # its next report (a stats period after the failed step) says its steps succeed again
    wait_for(lambda: cluster.replicas()[faulty]["failing_steps"] == 0, 30,
             "the faulty replica to report its steps succeed again")


def test_a_replica_whose_steps_always_fail_is_replaced_and_its_requests_complete(cluster, fault_free):
    faulty = _inject(cluster, -1)
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
