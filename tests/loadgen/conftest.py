"""A real `dllm-serve up` for the loadgen integration test (tests/live_up.py)."""


import pytest

import live_up as cluster_helpers


@pytest.fixture(scope="module", params=[1, 2], ids=["1-replica", "2-replicas"])
def tiny_cluster(request, tmp_path_factory):
    """The tiny model on ``request.param`` fixed replicas, one torch thread each; stopped after the module."""
    tmp_path = tmp_path_factory.mktemp(f"cluster{request.param}")
    settings = {
        "replica": {"max_batch": 16, "torch_threads": 1},
        "autoscaling": {"min_replicas": request.param, "max_replicas": request.param},
        "stats_period_s": 0.25,
    }
    running = cluster_helpers.start_cluster(tmp_path, settings)
    yield running
    cluster_helpers.stop_cluster(running.process)


@pytest.fixture
def closed_url():
    """A 127.0.0.1 URL on a port nothing listens on."""
    return f"http://127.0.0.1:{cluster_helpers.free_port()}"
