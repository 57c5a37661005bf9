"""Rendered RayServices validate against KubeRay's CRD schemas, and their serveConfigV2
against Ray's own ServeDeploySchema; the committed examples are what `render` writes now."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import load_config
from cluster.render import RenderOptions, render_k8s
from kuberay_schema import SHARED_CRDS, crd_errors, crd_text

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"cpu": "deploy/config.cpu.yaml", "gpu": "deploy/config.gpu.yaml"}
# the GPU example shows the API key from a Secret; the CPU one (kind, minikube) runs without a key
EXAMPLE_OPTIONS = {"cpu": RenderOptions(), "gpu": RenderOptions(api_key_secret="dllm-api-keys")}
KINDS = ["RayService", "Service", "Service", "NetworkPolicy"]


def documents_of(text: str) -> list[dict]:
    documents = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in documents] in (KINDS, KINDS[:-1])
    return documents


def rayservice_of(text: str) -> dict:
    return documents_of(text)[0]


def fresh(variant: str, options: RenderOptions | None = None, **overrides) -> str:
    options = EXAMPLE_OPTIONS[variant] if options is None else options
    return render_k8s(load_config(ROOT / EXAMPLES[variant], overrides), EXAMPLES[variant], options)


def render_command(variant: str) -> list[str]:
    return ["render", "k8s", "--config", EXAMPLES[variant], *EXAMPLE_OPTIONS[variant].flags().split()]


@pytest.mark.parametrize("variant", EXAMPLES)
def test_committed_example_is_a_fresh_render(variant):
    assert (ROOT / f"deploy/rayservice.{variant}.yaml").read_text() == fresh(variant), (
        f"re-render: dllm-serve {' '.join(render_command(variant))} -o deploy/rayservice.{variant}.yaml")


@pytest.mark.parametrize("variant", EXAMPLES)
def test_render_cli_writes_the_committed_example(variant, tmp_path):
    out = tmp_path / "rs.yaml"
    subprocess.run([sys.executable, "-m", "tools.cli", *render_command(variant), "-o", str(out)],
                   cwd=ROOT, check=True, timeout=120)
    assert out.read_text() == (ROOT / f"deploy/rayservice.{variant}.yaml").read_text()


MANIFESTS = {
    "committed cpu": lambda: (ROOT / "deploy/rayservice.cpu.yaml").read_text(),
    "committed gpu": lambda: (ROOT / "deploy/rayservice.gpu.yaml").read_text(),
    "fresh fixed replicas, namespace": lambda: fresh("gpu", **{
        "autoscaling.max_replicas": 1, "kubernetes.namespace": "serving", "ray_metrics_port": 9090}),
    "fresh cpu, fill timeout": lambda: fresh("cpu", **{"replica.mode": "fixed_fill", "replica.fill_timeout_s": 0.05}),
    "fresh cpu, API key Secret with its own key": lambda: fresh(
        "cpu", RenderOptions(api_key_secret="serving.keys", api_key_secret_key="dllm_keys")),
    "fresh gpu, no NetworkPolicy": lambda: fresh("gpu", RenderOptions(network_policy=False)),
}


@pytest.mark.parametrize("name", MANIFESTS)
def test_rayservice_matches_kuberay_crd_and_serve_schema(name):
    service = rayservice_of(MANIFESTS[name]())
    assert crd_errors(service) == []
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)  # raises on anything Ray would refuse
    cluster = service["spec"]["rayClusterConfig"]
    ports = {p["name"]: p["containerPort"] for p in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert str(ports["metrics"]) == cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"]


def test_gpu_workers_request_gpus():
    worker = rayservice_of(MANIFESTS["committed gpu"]())["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and worker["maxReplicas"] == 4


def test_crd_validation_catches_mistakes():
    service = rayservice_of(MANIFESTS["committed cpu"]())
    misspelt, wrong_type = copy.deepcopy(service), copy.deepcopy(service)
    misspelt["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 1
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "one"
    assert any("replica" in e for e in crd_errors(misspelt))
    assert any("replicas" in e for e in crd_errors(wrong_type))


def test_serve_config_builds_the_app_up_runs(monkeypatch):
    """import_path and args of serveConfigV2 build the same two deployments as `dllm-serve up`."""
    import cluster.app

    started = []
    monkeypatch.setattr(cluster.app, "start_metrics_actor", started.append)
    application = yaml.safe_load(rayservice_of(MANIFESTS["committed cpu"]())["spec"]["serveConfigV2"])["applications"][0]
    module, _, name = application["import_path"].partition(":")
    app = getattr(__import__(module, fromlist=[name]), name)(application["args"])
    assert started and started[0].host == "0.0.0.0"
    assert app._bound_deployment.name == "Ingress"
    assert [d["name"] for d in application["deployments"]] == ["EngineReplica", "Ingress"]


@pytest.mark.parametrize("args, message", [
    (["--config", "/nonexistent.yaml"], "cannot read config file"),
    (["--config", EXAMPLES["cpu"], "--set", "api_key=secret"], "not a setting"),
    (["--config", EXAMPLES["gpu"], "--set", "kubernetes.worker_gpus=0"], "worker_gpus"),
    (["--config", EXAMPLES["cpu"], "--set", "replica.num_cpus=8"], "cannot hold"),
    (["--config", EXAMPLES["cpu"], "--set", "api_key=secret", "--api-key-secret", "keys"], "not a setting"),
    (["--config", EXAMPLES["cpu"], "--api-key-secret", "API_Keys"], "not a Secret name"),
    (["--config", EXAMPLES["cpu"], "--api-key-secret", "keys", "--api-key-secret-key", "a/b"], "not a Secret key"),
    (["--config", EXAMPLES["cpu"], "--api-key-secret-key", "api-key"], "needs --api-key-secret"),
])
def test_render_refuses_bad_input(args, message, capsys):
    from tools.cli import main

    assert main(["render", "k8s", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not SHARED_CRDS.is_dir(), reason="no ../shared/kuberay-crds next to this checkout")
def test_vendored_crd_is_the_shared_one():
    assert crd_text("RayService") == (SHARED_CRDS / "ray.io_rayservices.yaml").read_text()


@pytest.mark.parametrize("path, haproxy, throughput", [(None, "1", "1"), ("throughput", "0", "1"),
                                                        ("proxy", "0", "0")])
def test_every_ray_container_runs_the_configured_request_path(path, haproxy, throughput):
    """Serve reads its request-path options when its processes start: each Ray container
    carries them, so the pods run the front end the config names (HAProxy by default)."""
    overrides = {} if path is None else {"request_path": path}
    spec = rayservice_of(fresh("cpu", **overrides))["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (env["RAY_SERVE_ENABLE_HA_PROXY"], env["RAY_SERVE_THROUGHPUT_OPTIMIZED"]) == (haproxy, throughput)
