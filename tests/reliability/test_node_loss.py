"""A node that leaves under load costs no request: its replica's requests resume on the
surviving node's replica, and Serve places a replacement on a surviving node. Three Ray
nodes on this machine (``ray.cluster_utils.Cluster``): a head and two workers."""

import asyncio
import time

import httpx
import pytest
from ray.cluster_utils import Cluster

from reliability_cluster import live_cluster, run, stream_completion, wait_for

SETTINGS = {
    # the head's one CPU goes to the ingress, so the engines spread over the two workers
    "ingress": {"num_cpus": 1.0, "replicas": 1},
    "replica": {"max_batch": 16, "torch_threads": 1, "num_cpus": 0.5},
    "autoscaling": {"min_replicas": 2, "max_replicas": 2},
    "admission": {"enabled": False},
    "stats_period_s": 0.25,
}
BODY = {"model": "tiny", "max_tokens": 192, "ignore_eos": True}


@pytest.fixture
def ray_nodes():
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [nodes.add_node(num_cpus=1) for _ in range(2)]
    nodes.wait_for_nodes()
    yield nodes, workers
    nodes.shutdown()


def test_a_node_removed_under_load_costs_no_request(ray_nodes):
    nodes, workers = ray_nodes
    with live_cluster(SETTINGS, address=nodes.address) as cluster:
        views = wait_for(lambda: (v := cluster.replicas()) and len(v) == 2 and v, 180, "two replicas reporting")
        placed = {view["node"] for view in views.values()}
        assert len(placed) == 2, "the two replicas share a node"
        victim = next(w for w in workers if w.node_id in placed)
        survivors = {n for n in placed if n != victim.node_id} | {w.node_id for w in workers if w is not victim}
        removed = {}

        def on_chunk(replica):
            if not removed and views[replica]["node"] == victim.node_id:
                nodes.remove_node(victim, allow_graceful=False)
                removed["at"] = time.monotonic()

        async def load():
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client:
                return await asyncio.gather(*(stream_completion(client, {**BODY, "prompt": f"{i}.{i}..{i % 3}"},
                                                                on_chunk) for i in range(16)))

        results = run(load())
        done = time.monotonic()
        assert removed, "the load finished before the node could be removed"
        assert all(r["status"] == 200 and r["error"] is None and r["finish_reason"] == "length" for r in results), \
            [r["error"] for r in results if r["error"]]
        print(f"\n16/16 completed; last one {done - removed['at']:.1f} s after the node left")
        replaced = wait_for(lambda: (v := cluster.replicas()) and len(v) == 2
                            and all(view["node"] in survivors for view in v.values()), 180,
                            "a replacement replica on a surviving node")
        print(f"replacement reporting {time.monotonic() - removed['at']:.1f} s after the node left")
        assert replaced
