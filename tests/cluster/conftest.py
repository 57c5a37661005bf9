"""A real `dllm-serve up` (Ray Serve, HTTP on 127.0.0.1) shared by the cluster tests."""

import pytest

from live_up import start_cluster, stop_cluster

API_KEY = "test-key"


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    """Two replicas of the tiny model; admission capacity small enough to test refusals."""
    settings = {
        "replica": {"max_batch": 16, "torch_threads": 1},
        "autoscaling": {"min_replicas": 2, "max_replicas": 2},
        "admission": {"max_step_debt_per_replica": 2000},
        "stats_period_s": 0.25,
    }
    running = start_cluster(tmp_path_factory.mktemp("cluster"), settings, api_keys=API_KEY)
    yield running
    stop_cluster(running.process)
    assert running.process.returncode is not None
