import pytest
import torch

from live_up import free_port, start_cluster, stop_cluster

# One intra-op thread: the tiny model's matrices are small, and the cluster tests run
# replica processes beside this one, where competing OpenMP thread pools slow every
# forward down by orders of magnitude.
torch.set_num_threads(1)


LIVE_FIXTURES = {"cluster", "observed", "llada"}
# the modules whose clusters are their own (the other live tests share the session's)
OWN_CLUSTERS = {"test_kills_live", "test_up_lifecycle_live", "test_overload_live", "test_checkpoint_live",
                "test_pool_live", "test_pool_refusal_live"}
# of those, the ones that may run beside the rest in the other worker once it has run
# every test of no cluster (their checks do not depend on timing): that worker is free
# a minute or two before the one with the other live tests
ALONGSIDE = {"test_pool_live", "test_pool_refusal_live"}
SHARED_API_KEY = "test-key"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """Mark ``live`` the tests of a real cluster: those of a ``*_live.py`` module and those
    that take a live cluster's fixture, and order the run: first the modules that start
    clusters of their own, then the users of the session's shared cluster, together (a
    cluster idling beside other tests slows them down), then the tests of no cluster, then
    the ``ALONGSIDE`` modules.

    Under pytest-xdist (``-n 2 --dist loadgroup --no-loadscope-reorder``, the default in
    pyproject.toml) each of those two live parts is one group: the first runs in one worker,
    in that order; the other worker runs the tests of no cluster and then the second."""
    def place(item) -> int:
        stem = item.path.stem
        if not (stem.endswith("_live") or LIVE_FIXTURES & set(getattr(item, "fixturenames", ()))):
            return 2
        item.add_marker(pytest.mark.live)
        if stem in ALONGSIDE:
            item.add_marker(pytest.mark.xdist_group("live-alongside"))
            return 3
        item.add_marker(pytest.mark.xdist_group("live"))
        return 0 if stem in OWN_CLUSTERS else 1

    items.sort(key=place)  # stable: each module keeps its tests' order


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The session's `dllm-serve up`, shared by the serving, load generator and dashboard
    tests: two tiny replicas (one torch thread each), an API key (``SHARED_API_KEY``),
    admission capacity small enough for a burst to be refused, stats every 0.25 s, and
    Ray's own metrics on a port of their own (``ray_metrics_port`` in ``cluster.config``).
    Its users leave it serving."""
    settings = {
        "replica": {"max_batch": 16, "torch_threads": 1},
        "autoscaling": {"min_replicas": 2, "max_replicas": 2},
        "admission": {"max_step_debt_per_replica": 2000},
        "stats_period_s": 0.25,
        "ray_metrics_port": free_port(),
    }
    running = start_cluster(tmp_path_factory.mktemp("cluster"), settings, api_keys=SHARED_API_KEY)
    yield running
    stop_cluster(running.process)
    assert running.process.returncode is not None


@pytest.fixture
def closed_url():
    """A 127.0.0.1 URL on a port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"
