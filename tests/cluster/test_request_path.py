"""The request path's settings for one local `up`, without starting anything."""

import os

from cluster.request_path import FALLBACK_PORT_ENVS, HAPROXY_STATS_PORT_ENV, LocalRequestPath, serve_environment


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


def test_the_kubernetes_render_keeps_serves_ports():
    """One cluster per pod: the render sets the path, not ports."""
    assert not set(FALLBACK_PORT_ENVS) & set(serve_environment("haproxy"))
