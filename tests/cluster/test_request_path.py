"""The request path's settings for one local `up`, without starting anything."""

import os

import pytest

from cluster.request_path import (DIRECT_INGRESS_ENV, FALLBACK_PORT_ENVS, GRPC_ENV, HAPROXY_ENV, HAPROXY_STATS_PORT_ENV,
                                  LOG_TO_STDERR_ENV, OWN_HTTP_ENV, THROUGHPUT_ENV, LocalRequestPath, on_kubernetes,
                                  serve_environment)


def test_two_local_clusters_share_no_port():
    """HAProxy's stats and metrics listeners and the Serve proxy it falls back to (fixed at
    8500 and 9500 by Serve) get ports of their own, so that one cluster's HAProxy can never
    send requests to another cluster's proxy."""
    first, second = LocalRequestPath("haproxy"), LocalRequestPath("haproxy")
    try:
        if first.path != "haproxy":  # no HAProxy binary here: nothing of it to set
            return
        names = (HAPROXY_STATS_PORT_ENV, *FALLBACK_PORT_ENVS)
        ports = [{int(run.environment[name]) for name in names} for run in (first, second)]
        assert all(len(p) == len(names) for p in ports) and not ports[0] & ports[1]
        assert not {8500, 9500} & (ports[0] | ports[1])
    finally:
        for run in (first, second):
            run.stop()
    assert not os.path.exists(first.run_dir or "/nonexistent")


@pytest.mark.parametrize("path", ["ingress", "haproxy", "throughput", "proxy"])
def test_every_path_keeps_the_replicas_stderr(path):
    """The throughput bundle would send it into a log buffer flushed every 1,000 records."""
    assert serve_environment(path)[LOG_TO_STDERR_ENV] == "1"


@pytest.mark.parametrize("path", ["ingress", "haproxy", "throughput", "proxy"])
def test_every_path_calls_between_deployments_by_actor_calls(path):
    """Over Serve's gRPC transport the ingress process kept native memory per request."""
    assert serve_environment(path)[GRPC_ENV] == "0"


def test_the_kubernetes_render_keeps_serves_ports():
    """One cluster per pod: the render sets the path, not ports."""
    assert not set(FALLBACK_PORT_ENVS) & set(serve_environment("haproxy"))


def test_the_ingress_path_runs_no_proxy_and_no_replica_http_server_of_serves():
    env = serve_environment("ingress")
    assert env[OWN_HTTP_ENV] == "1" and env[DIRECT_INGRESS_ENV] == "0"
    assert env[HAPROXY_ENV] == "0" and env[THROUGHPUT_ENV] == "1"
    assert OWN_HTTP_ENV not in serve_environment("haproxy")  # the pods' environment stays as it was
    assert on_kubernetes("ingress") == "haproxy" and on_kubernetes("proxy") == "proxy"
    assert LocalRequestPath("ingress").run_dir is None  # nothing of HAProxy's to start or clean up
