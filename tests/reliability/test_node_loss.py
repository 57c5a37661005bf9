"""A node that leaves under load costs no request: its replica's requests resume on the
surviving node's replica, and Serve places a replacement on a surviving node. Three Ray
nodes on this machine (``ray.cluster_utils.Cluster``): a head and two workers."""

import asyncio
import os
import signal
import time

import httpx
import pytest
from ray.cluster_utils import Cluster

from reliability_cluster import live_cluster, run, stream_completion, wait_for

SETTINGS = {
    # one CPU a node: the ingress fills one node, so the two engines land on the other two
    "ingress": {"num_cpus": 1.0, "replicas": 1},
    "replica": {"max_batch": 16, "torch_threads": 1, "num_cpus": 0.5},
    "autoscaling": {"min_replicas": 2, "max_replicas": 2},
    "admission": {"enabled": False},
    "stats_period_s": 0.25,
}
MAX_REQUESTS = 32
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
        workers_by_node = {w.node_id: w for w in workers}
        removed = {}

        def on_chunk(replica):
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
            """Streams started four at a time until a worker node has left (at most MAX_REQUESTS)."""
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client:
                streams = []
                while not removed and len(streams) < MAX_REQUESTS:
                    for i in range(len(streams), len(streams) + 4):
                        body = {**BODY, "prompt": f"{i}.{i}..{i % 3}"}
                        streams.append(asyncio.create_task(stream_completion(client, body, on_chunk)))
                    await asyncio.wait(streams, timeout=0.25)
                return await asyncio.gather(*streams)

        results = run(load())
        done = time.monotonic()
        assert removed, f"no replica on a worker node streamed in {MAX_REQUESTS} requests"
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
