"""Sizing from the node's cores, ingress replicas and Serve's queue in front of them."""

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.app import DEADLINE_END_S, build_app, ingress_deployment_options, size_for_node
from cluster.config import load_config
from cluster.render import rayservice, serve_config, sized_for_workers


@pytest.mark.parametrize("cores, engines, ingress, num_cpus, threads", [
    (1, 1, 1, 1.0, 1),    # nothing to spare: the engine still gets a whole CPU
    (2, 1, 1, 1.0, 1),    # this machine, one replica
    (2, 2, 1, 0.5, 1),
    (4, 1, 1, 3.0, 3),
    (8, 1, 2, 6.0, 6),
    (8, 4, 2, 1.0, 1),
    (16, 3, 2, 4.0, 4),   # 14 / 3: whole CPUs above one
    (5, 3, 2, 1.0, 1),
    (3, 3, 1, 0.66, 1),
])
def test_unset_settings_are_derived_from_the_cores(cores, engines, ingress, num_cpus, threads):
    sized = size_for_node(load_config(), cores, engines)
    assert sized.ingress.replicas == ingress
    assert sized.replica.num_cpus == num_cpus and sized.replica.torch_threads == threads


def test_explicit_settings_win():
    config = load_config(overrides={"ingress.replicas": 3, "replica.num_cpus": 2, "replica.torch_threads": 5})
    sized = size_for_node(config, 64, 8)
    assert (sized.ingress.replicas, sized.replica.num_cpus, sized.replica.torch_threads) == (3, 2, 5)
    threads_from_cpus = size_for_node(load_config(overrides={"replica.num_cpus": 3}), 2, 1)
    assert threads_from_cpus.replica.torch_threads == 3
    assert size_for_node(sized, 2, 1) == sized  # sizing a sized config changes nothing


def test_ingress_deployment_has_replicas_and_a_bounded_queue():
    config = size_for_node(load_config(overrides={"ingress.max_queued_requests": 32}), 8, 1)
    options = ingress_deployment_options(config)
    assert options["num_replicas"] == 2 and options["max_queued_requests"] == 32
    assert options["backpressure_config"] == {"status_code": 429, "retry_after_s": 1}
    assert options["ray_actor_options"] == {"num_cpus": 0.5}


@pytest.mark.parametrize("settings, wait_s", [
    ({}, 600 + DEADLINE_END_S),  # request_timeout_s: a rolling update cuts no stream before [DONE]
    ({"request_timeout_s": 60, "drain_timeout_s": 5}, 60 + DEADLINE_END_S),
    ({"request_timeout_s": 5}, 30),  # drain_timeout_s, where that is longer
    ({"request_timeout_s": None, "drain_timeout_s": 45}, 45),  # no deadline: drain_timeout_s
])
def test_a_stopping_ingress_replica_waits_as_long_as_its_requests_may_run(settings, wait_s):
    config = load_config(overrides=settings)
    assert ingress_deployment_options(config)["graceful_shutdown_timeout_s"] == wait_s
    serve = ServeDeploySchema.model_validate(yaml.safe_load(rayservice(config)["spec"]["serveConfigV2"]))
    ingress = next(d for d in serve.applications[0].deployments if d.name == "Ingress")
    assert ingress.graceful_shutdown_timeout_s == wait_s


def test_the_bound_app_is_sized_for_this_node():
    bound = build_app(load_config(overrides={"ingress.replicas": 2}))._bound_deployment
    assert bound._deployment_config.num_replicas == 2
    replica = bound.init_args[0]._bound_deployment
    assert replica.init_kwargs["torch_threads"] >= 1
    assert replica.ray_actor_options["num_cpus"] > 0


@pytest.mark.parametrize("access_log", [False, True])
def test_serves_access_log_is_off_unless_asked_in_the_app_and_the_kubernetes_render(access_log):
    """A line per request in every replica's log costs CPU on the request path: off by default."""
    config = load_config(overrides={} if not access_log else {"access_log": True})
    bound = build_app(config)._bound_deployment
    replica = bound.init_args[0]._bound_deployment
    for deployment in (bound, replica):
        assert deployment._deployment_config.logging_config["enable_access_log"] is access_log
    serve = yaml.safe_load(rayservice(config)["spec"]["serveConfigV2"])
    for deployment in ServeDeploySchema.model_validate(serve).applications[0].deployments:
        assert deployment.logging_config.enable_access_log is access_log


def test_render_sizes_for_the_worker_pod_and_passes_the_sizing_on():
    config = load_config(overrides={"kubernetes.worker_cpus": 8, "autoscaling.max_replicas": 3})
    service = rayservice(config)
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    application = serve["applications"][0]
    ingress = next(d for d in application["deployments"] if d["name"] == "Ingress")
    assert ingress["num_replicas"] == 2 and ingress["max_queued_requests"] == 256
    # the builder on the cluster gets the sized values, not this machine's
    assert application["args"]["ingress"]["replicas"] == 2
    assert application["args"]["replica"]["num_cpus"] == 6.0
    assert application["args"]["replica"]["torch_threads"] == 6
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert workers["maxReplicas"] == 3  # one 6-CPU engine per 8-CPU pod
    assert serve_config(sized_for_workers(config)) == serve


def test_ingress_replicas_count_against_the_worker_pod():
    config = load_config(overrides={"kubernetes.worker_cpus": 4, "replica.num_cpus": 1, "ingress.replicas": 4,
                                    "autoscaling.max_replicas": 2})
    workers = rayservice(config)["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert workers["maxReplicas"] == 1  # 4 CPUs - 4 x 0.5 for the ingress leave room for 2 engines


def test_a_tensor_parallel_replica_gets_one_bundle_a_rank_packed_in_one_gpu_pod():
    config = load_config(overrides={"replica.device": "cuda", "replica.num_gpus": 1, "replica.tensor_parallel_size": 2,
                                    "kubernetes.worker_cpus": 16, "kubernetes.worker_gpus": 8,
                                    "autoscaling.max_replicas": 6})
    service = rayservice(config)
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    engine = next(d for d in serve["applications"][0]["deployments"] if d["name"] == "EngineReplica")
    bundle = engine["placement_group_bundles"][0]
    assert len(engine["placement_group_bundles"]) == 2 and engine["placement_group_strategy"] == "STRICT_PACK"
    assert bundle["GPU"] == 1 and bundle["CPU"] == engine["ray_actor_options"]["num_cpus"]
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert workers["maxReplicas"] == 2  # four 2-GPU replicas a pod of 8 GPUs: 6 replicas, 2 pods
    assert "placement_group_bundles" not in serve_config(sized_for_workers(load_config()))["applications"][0][
        "deployments"][0]
