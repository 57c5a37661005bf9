"""`render k8s`: the API key from a Secret (never in the manifest) and the NetworkPolicy that
keeps Ray's own ports inside the RayService's pods, checked against the networking.k8s.io/v1
schema of the `kubernetes` client (k8s_schema) and by evaluating the policy's rules."""

import copy

import kubernetes.client
import pytest
import yaml

from cluster.config import API_KEYS_ENV
from cluster.render import CLIENT_PORT, DASHBOARD_PORT, GCS_PORT, KUBERAY_OPERATOR_LABELS, RenderOptions
from k8s_schema import k8s_errors, model_errors, type_errors
from test_kuberay_manifests import KINDS, MANIFESTS, documents_of, fresh, rayservice_of

RAYLET_AGENT_PORT = 52365  # the dashboard agent on every Ray pod


def ray_containers(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [container for group in groups for container in group["template"]["spec"]["containers"]]


def pod_templates(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    return [group["template"] for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]]


# ---- the API key from a Secret -------------------------------------------------------------

def test_committed_gpu_example_reads_the_keys_from_a_secret():
    text = MANIFESTS["committed gpu"]()
    service = rayservice_of(text)
    assert "--api-key-secret dllm-api-keys" in text.splitlines()[0]
    for container in ray_containers(service):
        assert container["env"][0] == {"name": API_KEYS_ENV, "valueFrom": {
            "secretKeyRef": {"name": "dllm-api-keys", "key": "api-key"}}}
        assert all(e["name"].startswith("RAY_SERVE_") for e in container["env"][1:])  # the request path's


@pytest.mark.parametrize("name", MANIFESTS)
def test_serve_config_holds_no_key_and_pod_templates_are_valid_pods(name):
    service = rayservice_of(MANIFESTS[name]())
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "api_key" not in args and API_KEYS_ENV not in service["spec"]["serveConfigV2"]
    for template in pod_templates(service):
        assert model_errors(template, kubernetes.client.V1PodTemplateSpec) == []


def test_secret_name_and_key_are_the_options_and_only_a_secret_brings_a_key():
    custom = rayservice_of(fresh("cpu", RenderOptions(api_key_secret="serving.keys", api_key_secret_key="dllm_keys")))
    for container in ray_containers(custom):
        assert container["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "serving.keys", "key": "dllm_keys"}
    for container in ray_containers(rayservice_of(MANIFESTS["committed cpu"]())):
        assert all("valueFrom" not in e and e["name"] != API_KEYS_ENV for e in container["env"])


def test_a_key_in_the_config_is_refused_and_never_printed(capsys):
    from tools.cli import main

    assert main(["render", "k8s", "--config", "deploy/config.gpu.yaml", "--set", "api_key=sk-do-not-print",
                 "--api-key-secret", "dllm-api-keys"]) == 2
    out, err = capsys.readouterr()
    assert "not a setting" in err and "sk-do-not-print" not in out + err


def test_render_help_names_the_environment_variable(capsys):
    from tools.cli import main

    with pytest.raises(SystemExit):
        main(["render", "--help"])
    assert API_KEYS_ENV in capsys.readouterr().out


# ---- the NetworkPolicy ---------------------------------------------------------------------

def network_policy_of(text: str) -> dict:
    documents = documents_of(text)
    assert [d["kind"] for d in documents] == KINDS
    return documents[-1]


@pytest.mark.parametrize("name", [name for name in MANIFESTS if "no NetworkPolicy" not in name])
def test_built_in_objects_match_the_kubernetes_schema(name):
    documents = documents_of(MANIFESTS[name]())
    assert documents[-1]["kind"] == "NetworkPolicy"
    for document in documents[1:]:
        assert k8s_errors(document) == [], document["kind"]


def test_no_network_policy_on_request():
    text = MANIFESTS["fresh gpu, no NetworkPolicy"]()
    assert "--no-network-policy" in text.splitlines()[0]
    assert [d["kind"] for d in documents_of(text)] == KINDS[:-1]


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "the evaluator knows matchLabels only"
    return selector.get("matchLabels", {}).items() <= labels.items()


def admits(policy: dict, policy_namespace: str, pod: dict, source: dict, port: int) -> bool:
    """NetworkPolicy semantics for ingress to ``pod`` ({"labels", "namespace"}) from ``source``
    ({"labels", "namespace", "namespace_labels"}) on a TCP port: a pod the policy does not
    select is not isolated; a selected one admits what some rule admits (a rule without
    `from` admits every source, without `ports` every port; a peer with a podSelector alone
    means pods in the policy's namespace)."""
    spec = policy["spec"]
    if pod["namespace"] != policy_namespace or not _selects(spec["podSelector"], pod["labels"]):
        return True
    assert spec["policyTypes"] == ["Ingress"]

    def peer_matches(peer: dict) -> bool:
        assert set(peer) <= {"podSelector", "namespaceSelector"}
        if "namespaceSelector" in peer:
            namespace_ok = _selects(peer["namespaceSelector"], source["namespace_labels"])
        else:
            namespace_ok = source["namespace"] == policy_namespace
        return namespace_ok and _selects(peer.get("podSelector", {}), source["labels"])

    for rule in spec.get("ingress", []):
        from_ok = not rule.get("from") or any(peer_matches(peer) for peer in rule["from"])
        ports_ok = not rule.get("ports") or any(
            p.get("protocol", "TCP") == "TCP" and p["port"] == port for p in rule["ports"])
        if from_ok and ports_ok:
            return True
    return False


def kuberay_pod(template: dict, node_type: str) -> dict:
    """A pod as KubeRay makes it from a template: its labels plus KubeRay's own (the RayCluster's
    name is generated from the RayService's)."""
    labels = template["metadata"]["labels"] | {"ray.io/cluster": "dllm-x7k2p", "ray.io/node-type": node_type,
                                               "app.kubernetes.io/created-by": "kuberay-operator"}
    return {"labels": labels, "namespace": "default"}


def source(labels: dict, namespace: str = "default") -> dict:
    return {"labels": labels, "namespace": namespace, "namespace_labels": {"kubernetes.io/metadata.name": namespace}}


@pytest.mark.parametrize("name", ["committed cpu", "committed gpu", "fresh fixed replicas, namespace"])
def test_ray_ports_stay_inside_serve_is_open_and_metrics_only_to_monitoring(name):
    text = MANIFESTS[name]()
    service, policy = rayservice_of(text), network_policy_of(text)
    namespace = service["metadata"].get("namespace", "default")
    head_template, worker_template = pod_templates(service)
    head, worker = kuberay_pod(head_template, "head"), kuberay_pod(worker_template, "worker")
    head["namespace"] = worker["namespace"] = namespace
    head_ports = {p["name"]: p["containerPort"] for p in head_template["spec"]["containers"][0]["ports"]}
    serve = head_ports["serve"]
    metrics = {head_ports["metrics"], head_ports["dllm-metrics"]}
    internal = {GCS_PORT, DASHBOARD_PORT, CLIENT_PORT, RAYLET_AGENT_PORT, 20000}  # 20000: a Ray worker port
    assert {head_ports["gcs-server"], head_ports["dashboard"], head_ports["client"]} <= internal

    peer = source(worker["labels"], namespace)  # pods of the same RayService, either group
    stranger = source({"app": "client"}, namespace)  # any other pod of the namespace
    lookalike = source(worker["labels"], "other")  # the same labels in another namespace
    operator = source(KUBERAY_OPERATOR_LABELS | {"app.kubernetes.io/instance": "kuberay-operator"}, "ray-system")
    prometheus = source({"app.kubernetes.io/name": "prometheus"}, "monitoring")  # any pod of that namespace
    for pod in (head, worker):
        for port in {serve} | metrics | internal:
            assert admits(policy, namespace, pod, peer, port)
            assert admits(policy, namespace, pod, stranger, port) == (port == serve), port
            assert admits(policy, namespace, pod, lookalike, port) == (port == serve), port
            assert admits(policy, namespace, pod, prometheus, port) == (port in metrics | {serve}), port
        assert admits(policy, namespace, pod, operator, DASHBOARD_PORT)
        assert not admits(policy, namespace, pod, operator, GCS_PORT)
        assert not admits(policy, namespace, pod, operator, CLIENT_PORT)
    assert admits(policy, namespace, head, source({"app": "client"}, "other"), serve)


def test_open_ports_and_the_monitoring_namespace_follow_the_config():
    policy = network_policy_of(fresh("cpu", **{"port": 8001, "metrics_port": 9401, "ray_metrics_port": 9090,
                                                "kubernetes.monitoring_namespace_labels": {"team": "observability"}}))
    opened = [rule for rule in policy["spec"]["ingress"] if "from" not in rule]
    assert [[p["port"] for p in rule["ports"]] for rule in opened] == [[8001]]
    scrapes = policy["spec"]["ingress"][-1]
    assert scrapes["from"] == [{"namespaceSelector": {"matchLabels": {"team": "observability"}}}]
    assert [p["port"] for p in scrapes["ports"]] == [9401, 9090]


# ---- the validator itself ------------------------------------------------------------------

@pytest.fixture
def policy() -> dict:
    return copy.deepcopy(network_policy_of(MANIFESTS["committed cpu"]()))


def test_validator_refuses_unknown_fields(policy):
    policy["spec"]["ingress"][0]["form"] = policy["spec"]["ingress"][0].pop("from")
    policy["spec"]["podSelector"]["matchLabel"] = {"a": "b"}
    policy["metadata"]["label"] = {}
    errors = k8s_errors(policy)
    assert len(errors) == 3
    assert any(e.startswith("spec.ingress.0: unknown field 'form'") for e in errors)
    assert any(e.startswith("spec.podSelector: unknown field 'matchLabel'") for e in errors)
    assert any(e.startswith("metadata: unknown field 'label'") for e in errors)


def test_validator_refuses_python_names_for_json_fields(policy):
    policy["spec"]["pod_selector"] = policy["spec"].pop("podSelector")
    assert any("unknown field 'pod_selector'" in e for e in k8s_errors(policy))


@pytest.mark.parametrize("path, value, expected", [
    (("spec", "ingress", 2, "ports", 0, "port"), 1.5, "spec.ingress.2.ports.0.port: float 1.5, expected int or str"),
    (("spec", "ingress", 2, "ports", 0, "port"), True, "spec.ingress.2.ports.0.port: bool True, expected int or str"),
    (("spec", "ingress", 2, "ports", 0, "endPort"), "9000", "spec.ingress.2.ports.0.endPort: str '9000', expected int"),
    (("spec", "podSelector", "matchLabels", "app.kubernetes.io/name"), 1,
     "spec.podSelector.matchLabels.app.kubernetes.io/name: int 1, expected str"),
    (("spec", "policyTypes"), "Ingress", "spec.policyTypes: str, expected a list"),
    (("spec", "ingress", 0, "from", 0), ["podSelector"], "spec.ingress.0.from.0: list, expected a V1NetworkPolicyPeer mapping"),
    (("spec", "ingress"), {"from": []}, "spec.ingress: dict, expected a list"),
])
def test_validator_refuses_wrong_types(policy, path, value, expected):
    node = policy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert k8s_errors(policy) == [expected]


def test_validator_accepts_named_ports_and_refuses_missing_required_fields(policy):
    policy["spec"]["ingress"][2]["ports"][0]["port"] = "serve"
    assert k8s_errors(policy) == []
    policy["spec"]["podSelector"]["matchExpressions"] = [{"operator": "Exists"}]
    assert k8s_errors(policy) == ["spec.podSelector.matchExpressions.0.key: required"]
    template = pod_templates(rayservice_of(MANIFESTS["committed gpu"]()))[0]
    del template["spec"]["containers"][0]["name"]
    template["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["optional"] = "no"
    assert model_errors(template, kubernetes.client.V1PodTemplateSpec) == [
        "spec.containers.0.env.0.valueFrom.secretKeyRef.optional: str 'no', expected bool",
        "spec.containers.0.name: required"]


def test_validator_knows_only_the_clients_kinds():
    with pytest.raises(KeyError):
        k8s_errors({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicie"})
    assert type_errors({"a": 1}, "Dict[str, int]") == [] and type_errors({"a": True}, "Dict[str, int]") != []
