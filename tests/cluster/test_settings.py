"""One settings schema (replicas.engine_config) behind the engine, the cluster config and the CLI;
typed messages and shared checks between the ingress and a replica."""

import argparse
import asyncio
import pickle
import types

import pytest
from ray import cloudpickle

from cluster.app import build_app
from cli_help import command_parser
from cluster.cli import _engine_config, up_config
from tools.cli import build_parser
from cluster.config import ReplicaSettings, load_config
from cluster.errors import APIError
from replicas.deployment import EngineReplica
from replicas.messages import GenerateChunk, GenerateRequest, RequestError, SamplingParams, request_problem
from replicas.telemetry.reports import ReplicaStats
from replicas.engine_config import EngineConfig, resolve_algorithm


def command_options(command: str) -> dict[str, argparse.Action]:
    """The options of one `dllm-serve` command, by dest."""
    return {action.dest: action for action in command_parser(command)._actions}


def example_argv(action: argparse.Action) -> tuple[list[str], object]:
    """A non-default value for an option, and what it parses to."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [f"--no-{flag[2:]}"], False
    if action.choices:
        return [flag, action.choices[-1]], action.choices[-1]
    if action.type is int:
        return [flag, "3"], 3
    if action.type is float:  # a share too (memory_utilization)
        return [flag, "0.5"], 0.5
    if action.metavar == "BYTES":
        return [flag, "3MiB"], 3 << 20
    if flag == "--adapters":  # none: adapters exclude the lora and the ranks set here (test_adapters sets them)
        return [flag, "{}"], {}
    if action.metavar == "YAML":
        return [flag, "{threshold: 0.5}"], {"threshold": 0.5}
    return [flag, "x"], "x"


COMMANDS = {"up": ("replica.", ReplicaSettings), "generate": ("engine.", EngineConfig)}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_setting_is_a_flag_that_reaches_the_config(command):
    prefix, settings = COMMANDS[command]
    options = command_options(command)
    assert set(EngineConfig.model_fields) <= set(settings.model_fields)
    argv, expected = [command] + (["prompt"] if command == "generate" else []), {}
    for name, field in settings.model_fields.items():
        action = options[prefix + name]  # KeyError: a setting without a flag
        assert action.help.startswith(field.description)
        tokens, expected[name] = example_argv(action)
        argv += tokens
    args = build_parser().parse_args(argv)
    config = up_config(args).replica if command == "up" else _engine_config(args)
    assert {name: getattr(config, name) for name in expected} == expected


def test_mode_choices_are_the_scheduler_modes():
    from replicas.batching import MODES

    for command, (prefix, _) in COMMANDS.items():
        assert tuple(command_options(command)[prefix + "mode"].choices) == MODES


def test_unset_flags_leave_config_and_settings_defaults():
    args = build_parser().parse_args(["up", "--set", "replica.max_batch=4", "--set", "replica.kv_cache=none"])
    assert up_config(args).replica.max_batch == 4 and up_config(args).replica.kv_cache == "none"
    args = build_parser().parse_args(["up", "--set", "replica.max_batch=4", "--max-batch", "8"])
    assert up_config(args).replica.max_batch == 8  # flags win over --set
    assert _engine_config(build_parser().parse_args(["generate", "p"])) == EngineConfig()


def test_algorithm_section_is_short_for_the_replica_keys():
    short = load_config(None, {"algorithm.name": "fixed_steps", "algorithm.params": {"steps": 4}})
    long = load_config(None, {"replica.algorithm": "fixed_steps", "replica.algorithm_params": {"steps": 4}})
    assert short == long and short.replica.algorithm_params == {"steps": 4}
    flags = up_config(build_parser().parse_args(["up", "--algorithm", "fixed_steps", "--algorithm-params", "{steps: 4}"]))
    assert flags == long


def test_resolve_algorithm_layers_request_over_configured_over_model():
    spec = types.SimpleNamespace(default_algorithm="low_confidence", default_algorithm_params={"threshold": 0.9})
    model_default = EngineConfig(algorithm_params={"temperature": 0.5})
    assert resolve_algorithm(model_default, spec) == ("low_confidence", {"threshold": 0.9, "temperature": 0.5})
    assert resolve_algorithm(model_default, spec, None, {"threshold": 0.7}) == (
        "low_confidence", {"threshold": 0.7, "temperature": 0.5})
    assert resolve_algorithm(model_default, spec, "fixed_steps", {"steps": 4}) == ("fixed_steps", {"steps": 4})
    configured = EngineConfig(algorithm="fixed_steps", algorithm_params={"steps": 8})
    assert resolve_algorithm(configured, spec) == ("fixed_steps", {"steps": 8})
    assert resolve_algorithm(configured, spec, "fixed_steps", {}) == ("fixed_steps", {"steps": 8})
    assert resolve_algorithm(configured, spec, "low_confidence") == ("low_confidence", {})


@pytest.mark.parametrize("message", [
    GenerateRequest("r1", [1, 2, 3], SamplingParams(32, stop=("x",), algorithm="fixed_steps",
                                                    algorithm_params={"steps": 4}, ignore_eos=True), cost=12.0),
    GenerateChunk("ab", 2, True, "stop", prompt_tokens=3, completion_tokens=2, steps=5, block_steps=[3, 2],
                  replica="r", engine_s=0.5),
    GenerateChunk.refusal("the prompt is empty"),
])
def test_messages_round_trip(message):
    assert pickle.loads(pickle.dumps(message)) == message
    assert cloudpickle.loads(cloudpickle.dumps(message)) == message


# ---- one replica and the ingress's checks, without Ray -------------------------------------

@pytest.fixture(scope="module")
def replica():
    """The EngineReplica `up --set replica.fdfo_fill_hold=false` builds, its init arguments
    taken from the bound application."""
    args = build_parser().parse_args(["up", "--set", "replica.fdfo_fill_hold=false", "--max-batch", "4"])
    bound = build_app(up_config(args))._bound_deployment.init_args[0]._bound_deployment
    replica = EngineReplica(*bound.init_args, **{**bound.init_kwargs, "metrics_actor": None})
    yield replica
    replica._stop.set()
    replica.async_engine.shutdown(drain_timeout=5.0)


@pytest.fixture(scope="module")
def ingress():
    from cluster.ingress import Ingress

    plain = next(c for c in Ingress.__mro__ if "_complete" in vars(c))  # under serve.ingress's wrapper
    handle = types.SimpleNamespace(options=lambda **_: None)
    instance = plain.__new__(plain)
    plain.__init__(instance, handle, load_config().model_dump(mode="json"))
    return instance


def test_fdfo_fill_hold_set_on_the_cluster_reaches_the_engine(replica):
    assert replica.engine.config.fdfo_fill_hold is False and replica.engine.config.max_batch == 4


async def _chunks(replica, request: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in replica.generate(request)]


def test_replica_streams_chunks_and_refuses_with_the_shared_message(replica):
    spec = replica.engine.spec
    ok = asyncio.run(_chunks(replica, GenerateRequest("ok", replica.engine.encode("1.3. ..2."), SamplingParams(32))))
    assert all(isinstance(c, GenerateChunk) for c in ok) and ok[-1].finished and ok[-1].error is None
    assert ok[-1].completion_tokens == sum(len(c.token_ids) for c in ok) and ok[-1].replica == "local"
    bad = asyncio.run(_chunks(replica, GenerateRequest("bad", [1, spec.mask_token_id], SamplingParams(16))))
    expected = request_problem([1, spec.mask_token_id], 16, spec, replica.engine.shape.max_model_len).message
    assert bad == [GenerateChunk.refusal(expected)]


def test_the_replica_reports_its_kv_pool(replica):
    """Its stats carry the pool's pages and bytes (every layer's K and V, the scratch page's
    included) and the max_model_len in force."""
    engine, spec = replica.engine, replica.engine.spec
    stats = ReplicaStats.model_validate(asyncio.run(replica.record_routing_stats()))
    page_bytes = spec.block_length * spec.num_kv_heads * spec.head_dim * engine.runner.kv_cache.k[0].element_size()
    assert stats.kv_cache_bytes == 2 * spec.num_layers * engine.pool.num_pages * page_bytes
    assert (stats.total_pages, stats.max_model_len) == (engine.pool.capacity, engine.shape.max_model_len)


@pytest.mark.parametrize("prompt_ids,max_tokens", [
    ([], 16), ([10 ** 9], 16), ("mask", 16), ([5] * 600, 16), ([5], 10_000)], ids=[
    "empty", "outside the vocabulary", "mask id", "prompt too long", "output too long"])
def test_engine_refuses_what_the_shared_check_refuses_with_its_message(replica, prompt_ids, max_tokens):
    engine = replica.engine
    prompt_ids = [5, engine.spec.mask_token_id] if prompt_ids == "mask" else prompt_ids
    problem = request_problem(prompt_ids, max_tokens, engine.spec, engine.shape.max_model_len, engine.pool.capacity)
    with pytest.raises(RequestError) as refused:
        engine.make_request(prompt_ids, SamplingParams(max_tokens=max_tokens))
    assert problem is not None and str(refused.value) == problem.message


def test_shared_check_counts_the_pool_where_known():
    spec = types.SimpleNamespace(vocab_size=100, mask_token_id=99, block_length=16)
    assert request_problem([1] * 20, 16, spec, 512) is None
    assert request_problem([1] * 20, 16, spec, 512, pool_pages=2).message == \
        "the request needs 3 KV pages; the pool has 2"


@pytest.mark.parametrize("prompt,max_tokens", [("", 16), ("1" * 600, 16), ("1" * 200, 400)])
def test_ingress_and_engine_refuse_a_prompt_with_the_same_message(ingress, replica, prompt, max_tokens):
    from cluster.protocol import CompletionRequest

    body = CompletionRequest(model="tiny", prompt=prompt, max_tokens=max_tokens)
    with pytest.raises(APIError) as at_ingress:
        ingress.preprocess.prepare(body, prompt)
    with pytest.raises(RequestError) as at_engine:
        replica.engine.make_request(prompt, SamplingParams(max_tokens=max_tokens))
    assert at_ingress.value.body()["error"]["message"] == str(at_engine.value)


def test_ingress_builds_the_request_the_replica_takes(ingress, replica):
    from cluster.protocol import CompletionRequest

    body = CompletionRequest(model="tiny", prompt="1.3.", max_tokens=32, threshold=0.5, stop=["x"])
    request = ingress.preprocess.prepare(body, body.prompt)
    assert isinstance(request, GenerateRequest) and request.params.stop == ("x",)
    assert ingress.preprocess.prepare(CompletionRequest(model="tiny", prompt="1.3."), "1.3.").params.stop == ()
    params = request.params  # greedy: no seed, nothing drawn
    assert (params.algorithm, params.algorithm_params) == resolve_algorithm(
        ingress.config.replica, ingress.spec, None, {"threshold": 0.5})
    assert request.cost == replica.worst_case_cost(request.prompt_ids, params)
    made = replica.engine.make_request(request)  # taken as it comes: not unpacked and rebuilt
    assert (made.request_id, made.params) == (request.request_id, request.params)
    assert made.prompt_ids is request.prompt_ids
    sampled = ingress.preprocess.prepare(CompletionRequest(model="tiny", prompt="1.3.", temperature=0.5), "1.3.").params
    seed = sampled.algorithm_params["seed"]  # drawn for the request, so that a failover draws the same
    assert isinstance(seed, int) and 0 <= seed < 2 ** 63


def test_generate_runs_with_engine_flags_and_request_params(capsys):
    from tools.cli import main

    prompt = "1.3. ..2. 4... .1.4 " + " ".join(["----"] * 6)
    assert main(["generate", prompt, "--max-tokens", "16", "--algorithm", "fixed_steps", "--param", "steps=2",
                 "--max-batch", "2", "--no-fdfo-fill-hold"]) == 0
    assert "2 steps, steps per block [2]" in capsys.readouterr().err  # fixed_steps: the 2nd step fills and commits
