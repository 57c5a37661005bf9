import pytest
import torch

from live_up import free_port, start_cluster, stop_cluster

# One intra-op thread: the tiny model's matrices are small, and the cluster tests run
# replica processes beside this one, where competing OpenMP thread pools slow every
# forward down by orders of magnitude.
torch.set_num_threads(1)


LIVE_FIXTURES = {"one_replica", "cluster", "observed", "tiny_cluster", "llada"}


def pytest_collection_modifyitems(items):
    """Mark ``live`` the tests of a real cluster: those of a ``*_live.py`` module and those
    that take a live cluster's fixture."""
    for item in items:
        if item.path.stem.endswith("_live") or LIVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.live)


@pytest.fixture(scope="session")
def one_replica(tmp_path_factory):
    """`dllm-serve up` with one tiny replica (one torch thread), no API key, Ray's own
    metrics on a port of their own (``ray_metrics_port`` in ``cluster.config``), shared by
    the tests of the load generator and of the dashboards. Its users leave it serving."""
    settings = {"replica": {"max_batch": 16, "torch_threads": 1}, "stats_period_s": 0.25,
                "autoscaling": {"min_replicas": 1, "max_replicas": 1}, "ray_metrics_port": free_port()}
    running = start_cluster(tmp_path_factory.mktemp("one-replica"), settings)
    yield running
    stop_cluster(running.process)
