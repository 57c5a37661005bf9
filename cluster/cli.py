"""The cluster's commands of the `dllm-serve` command line (``tools.cli`` gathers them
with the other packages'): generate, up, status and render."""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import logging
import math
import os
import signal
import sys
import time
import types
from pathlib import Path
from typing import Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ByteSize

from replicas.engine_config import EngineConfig


log = logging.getLogger(__name__)

ENGINE_DEST = "engine."  # `generate`'s engine flags land at engine.<field>
REPLICA_DEST = "replica."  # `up`'s replica flags land at their config key, replica.<field>
RAY_TOKEN_FILE = Path.home() / ".ray" / "auth_token"  # Ray's token of the clusters started on this machine


def _yaml_mapping(text: str) -> dict:
    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a YAML mapping such as '{{key: value}}', got {text!r}")
    return value


def _setting_flags(parser: argparse.ArgumentParser, settings: type[BaseModel], dest_prefix: str,
                   choices: dict[str, list[str]]) -> None:
    """One option per field of ``settings`` (``--max-batch`` for max_batch), its help the
    field's description: enums and Literals give choices, a bool ``--x/--no-x``, numbers
    their type, a dict a YAML mapping. A given value lands at ``dest_prefix + name``; an
    option not given sets nothing, so the settings' own default applies."""
    for name, field in settings.model_fields.items():
        if name == "lora":
            parser.add_argument("--lora", dest=dest_prefix + name, action="append", metavar="[NAME=]DIR",
                                default=argparse.SUPPRESS, help=(field.description + _LORA_NAMED_HELP).replace("%", "%%"))
            continue
        kind = field.annotation
        if get_origin(kind) in (Union, types.UnionType):
            kind = next(arg for arg in get_args(kind) if arg is not type(None))
        options: dict = {"dest": dest_prefix + name, "default": argparse.SUPPRESS}
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            options["choices"] = [member.value for member in kind]
        elif get_origin(kind) is Literal:
            options["choices"] = list(get_args(kind))
        elif kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif kind in (int, float):
            options.update(type=kind, metavar=name.upper())
        elif get_origin(kind) is dict:
            options.update(type=_yaml_mapping, metavar="YAML")
        elif kind is ByteSize:
            options["metavar"] = "BYTES"  # a number, or with a unit: 512MiB, 8GiB
        else:
            options["metavar"] = name.upper()
        if name in choices:
            options.update(choices=choices[name], metavar=None)
        default = field.get_default(call_default_factory=True)
        default = default.value if isinstance(default, enum.Enum) else default
        shown = f" (default {default})" if default not in (None, {}) else ""
        help_text = (field.description or "") + shown
        parser.add_argument("--" + name.replace("_", "-"), help=help_text.replace("%", "%%"), **options)


_LORA_NAMED_HELP = ("; NAME=DIR instead serves the adapter unmerged under the model name NAME beside the base "
                    "model (repeatable: several adapters, the rows of each in the same steps; sets adapters)")


def _given(args, dest_prefix: str) -> dict:
    """The setting flags given on the command line, by dest; ``--lora`` split into the
    merged adapter (``lora``) and the named ones (``adapters``)."""
    given = {dest: value for dest, value in vars(args).items() if dest.startswith(dest_prefix)}
    items = given.pop(dest_prefix + "lora", None) or []
    merged = [item for item in items if not _named_adapter(item)]
    if len(merged) > 1:
        raise SystemExit("dllm-serve: --lora DIR merges one adapter into the weights; serve several unmerged "
                         "as --lora NAME=DIR each")
    if merged:
        given[dest_prefix + "lora"] = merged[0]
    named = dict(item.split("=", 1) for item in items if _named_adapter(item))
    if named:
        given[dest_prefix + "adapters"] = {**given.get(dest_prefix + "adapters", {}), **named}
    return given


def _named_adapter(item: str) -> bool:
    """``NAME=DIR`` (a name has no slash; a directory may hold an '=')."""
    name, sep, _ = item.partition("=")
    return bool(sep) and bool(name) and "/" not in name


def _engine_config(args) -> EngineConfig:
    return EngineConfig(**{dest.removeprefix(ENGINE_DEST): value for dest, value in _given(args, ENGINE_DEST).items()})


def _algorithm_params(args) -> dict:
    params = {}
    for item in args.param or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"dllm-serve: --param expects KEY=VALUE, got {item!r}")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    if args.threshold is not None:
        params["threshold"] = args.threshold
    return params


def cmd_generate(args) -> int:
    from replicas.async_engine import AsyncEngine
    from replicas.engine import Engine
    from replicas.messages import SamplingParams

    engine = Engine.from_pretrained(args.model, _engine_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, stop=tuple(args.stop or ()),
                            algorithm_params=_algorithm_params(args))  # on top of the engine's --algorithm
    engine.make_request(args.prompt, params)  # validate before starting the loop

    async def run() -> None:
        runner = AsyncEngine(engine)
        text = []
        try:
            async for chunk in runner.generate(args.prompt, params):
                text.append(chunk.text)
                if args.stream:
                    print(chunk.text, end="\n" if chunk.finished else " | ", flush=True)
                if chunk.finished:
                    if not args.stream:
                        print("".join(text))
                    print(f"[{chunk.finish_reason}; {chunk.completion_tokens} tokens, "
                          f"{chunk.steps} steps, steps per block {chunk.block_steps}]", file=sys.stderr)
        finally:
            runner.shutdown()

    asyncio.run(run())
    return 0


_UP_SHORTCUTS = {  # flag dest -> config key, besides the replica.* flags
    "model": "model", "port": "port", "metrics_port": "metrics_port", "host": "host",
    "min_replicas": "autoscaling.min_replicas", "max_replicas": "autoscaling.max_replicas", "api_key_file": "api_key_file",
    "drain_timeout": "drain_timeout_s",
}


def _parse_set(items: list[str] | None) -> dict:
    overrides = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"dllm-serve: --set expects KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


def up_config(args):
    from cluster.config import load_config

    overrides = _parse_set(args.set)
    if args.replicas is not None:
        overrides["autoscaling.min_replicas"] = overrides["autoscaling.max_replicas"] = args.replicas
    for dest, key in _UP_SHORTCUTS.items():
        value = getattr(args, dest)
        if value is not None:
            overrides[key] = value
    overrides.update(_given(args, REPLICA_DEST))
    return load_config(args.config, overrides)


# a 4x4 Sudoku on the tiny model's canvas (docs/models.md); any text works for other models
_EXAMPLE_PROMPT = "1.3. ..2. 4... .1.4 " + " ".join(["----"] * 24)


def _check_model_default_algorithm(config, spec) -> None:
    """``replica.algorithm_params`` without ``replica.algorithm`` apply to the model's own
    default; a default that decodes several blocks at once needs a model that can (D2F)."""
    from algorithms import AlgorithmError, get_algorithm
    from cluster.config import ConfigError
    from replicas import block_pipeline
    from replicas.engine_config import ServingShape, resolve_algorithm

    name, params = resolve_algorithm(config.replica, spec)
    if config.replica.algorithm is None:
        try:
            get_algorithm(name).make_params(params)
        except AlgorithmError as exc:
            raise ConfigError(f"replica.algorithm_params (for the model's default {name}): {exc}") from None
    try:
        pipelined = get_algorithm(name).pipelined
    except AlgorithmError as exc:
        raise ConfigError(f"replica.algorithm: {exc}") from None
    if pipelined:
        problem = block_pipeline.refusal(name, spec, ServingShape.of(config.replica, spec), False, False)
        if problem:
            raise ConfigError(f"replica.algorithm: {problem}")


def _check_pool_settings(replica, spec) -> None:
    """A KV pool that the settings fix (``num_pages``, ``kv_cache_memory``) and that cannot
    hold one request of ``max_model_len`` is refused before any process starts; one sized
    from measured memory is checked by each replica at its start (``replicas.memory``)."""
    from replicas.engine import torch_dtype
    from replicas.memory import settled_pool
    from replicas.engine_config import ServingShape

    settled_pool(replica, spec, ServingShape.of(replica, spec), torch_dtype(replica))


class StopSignals:
    """What SIGTERM and SIGINT have asked of `up`. Set from signal handlers, so plain flags
    that the main thread polls: a handler calling ``threading.Event.set`` deadlocked `up`
    when a second signal arrived inside the first one's ``set`` (its lock is not reentrant;
    seen with SIGINT sent twice at once, by ``pkill`` and by ``timeout`` passing it on)."""

    POLL_S = 0.1

    def __init__(self):
        self.graceful = False  # SIGTERM: drain, then stop
        self.interrupted = False  # SIGINT, or a second SIGTERM: stop at once

    def on_sigterm(self, *_) -> None:
        if self.graceful:
            self.interrupted = True
        self.graceful = True

    def on_sigint(self, *_) -> None:
        self.interrupted = True

    def wait(self) -> None:
        """Until either signal came."""
        while not (self.graceful or self.interrupted):
            time.sleep(self.POLL_S)


def drain(config, signals: StopSignals) -> str:
    """Stop admitting cluster-wide and wait until the requests in flight have finished, at
    most ``config.drain_timeout_s`` (or until ``signals.interrupted``); returns what happened.

    The order goes through the metrics actor (``MetricsExporter.drain``), re-sent every poll
    so that an actor restarted meanwhile has it too; each ingress replica gets it with its
    next sync and from then on answers 503. Drained: every live ingress has reported that it
    stopped admitting, with no request in flight and no admission charge outstanding, and
    at least two stats periods and a metrics timeout have passed since the order and since
    the metrics actor (re)started (an ingress that had not reported yet has reported by
    then). Every call is bounded by ``ingress.metrics_timeout_s``.
    """
    import ray

    from cluster.metrics import ACTOR_NAME, ACTOR_NAMESPACE

    start = time.monotonic()
    deadline = start + config.drain_timeout_s
    settle_s = 2 * config.stats_period_s + config.ingress.metrics_timeout_s
    status, shown = None, -math.inf
    while not signals.interrupted:
        now = time.monotonic()
        if now >= deadline:
            break
        try:
            actor = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
            status = ray.get(actor.drain.remote(), timeout=min(config.ingress.metrics_timeout_s, deadline - now))
        except (ValueError, ray.exceptions.RayError) as exc:  # not there, restarting or slow: ask again
            log.debug("drain: the metrics actor did not answer: %s", exc)
        else:
            idle = status["stopped"] == status["ingresses"] and status["in_flight"] == 0 and status["outstanding"] == 0
            if idle and now - start >= settle_s and status["age_s"] >= settle_s:
                return (f"drained in {time.monotonic() - start:.1f} s: {status['ingresses']} ingress replica(s) "
                        f"stopped admitting, no request in flight, no admission charge outstanding")
            if now - shown >= 5.0:
                shown = now
                print(f"draining: {status['in_flight']} request(s) in flight on {status['ingresses']} ingress "
                      f"replica(s), {status['stopped']} stopped admitting; waiting up to "
                      f"{deadline - now:.0f} s more", flush=True)
        time.sleep(0.2)
    if signals.interrupted:
        return f"drain interrupted after {time.monotonic() - start:.1f} s"
    left = "unknown" if status is None else status["in_flight"]
    return f"drain timeout after {config.drain_timeout_s:g} s, requests still in flight: {left}"


def cmd_up(args) -> int:
    from cluster.config import check_ports_free

    config = up_config(args)
    if args.address is None:  # a local cluster: its ports must be free (checked first: it is quick)
        check_ports_free(config)

    import ray

    from cluster.app import deploy, shutdown, start_failure, wait_until_admitting
    from cluster.auth import load_keys
    from cluster.request_path import LocalRequestPath
    from replicas.models import check_checkpoint

    replica = config.replica
    spec = check_checkpoint(config.model, replica.lora, replica.model_overrides, replica.tensor_parallel_size,
                            replica.expert_parallel_size, replica.adapters)  # before any process starts
    _check_model_default_algorithm(config, spec)
    _check_pool_settings(replica, spec)
    keys = load_keys(config.api_key_file)  # the ingress replicas read them again, each in its process
    signals = StopSignals()
    print(f"starting dllm-serve: model {config.model_name}, {config.autoscaling.min_replicas}"
          f"-{config.autoscaling.max_replicas} replica(s), mode {config.replica.mode.value}, "
          f"{f'{len(keys)} API key(s) required' if keys else 'no API key required'}", flush=True)
    path = None if args.address else LocalRequestPath(config.request_path)
    if path is not None and path.note:
        print(f"note: {path.note}", flush=True)
    try:
        try:
            metrics_url = deploy(config, args.address, path)
        except RuntimeError:  # Serve's "failed to deploy": say why in one line where it knows
            failure = start_failure(config)
            if failure is None:
                raise
            print(f"dllm-serve: error: {failure}", file=sys.stderr, flush=True)
            return 1
        print(wait_until_admitting(config), flush=True)
        # after ray.init, which installs handlers of its own: SIGTERM drains, then stops;
        # SIGINT (even when started in the background, where it arrives ignored) stops at once
        signal.signal(signal.SIGTERM, signals.on_sigterm)
        signal.signal(signal.SIGINT, signals.on_sigint)
        base = f"http://{config.host}:{config.port}"
        auth = " -H \"Authorization: Bearer $KEY\"" if keys else ""
        ray_address = ray.get_runtime_context().gcs_address  # what `status` needs when several clusters run here
        print(f"OpenAI API: {base}/v1\nmetrics:    {metrics_url}\nstatus:     dllm-serve status --address {ray_address}\n"
              f"try:\n"
              f"  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} "
              f"-d '{{\"model\": \"{config.model_name}\", \"prompt\": \"{_EXAMPLE_PROMPT}\", \"max_tokens\": 32}}'\n"
              f"ready; Ctrl-C stops (SIGTERM drains first: up to {config.drain_timeout_s:g} s)", flush=True)
        signals.wait()
        if signals.graceful and not signals.interrupted and config.drain_timeout_s > 0:
            print(f"SIGTERM: draining (new requests get 503; up to {config.drain_timeout_s:g} s for the "
                  f"requests in flight)", flush=True)
            print(drain(config, signals), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        shutdown(config, path)
    return 0


def cmd_status(args) -> int:
    if args.address != "auto" and "RAY_AUTH_MODE" not in os.environ and RAY_TOKEN_FILE.exists():
        # Ray authenticates with the local token only for the cluster it finds itself; a
        # local cluster named by its address (`up` prints it) needs it too. Ray reads the
        # mode once, when it is imported: set it first.
        os.environ["RAY_AUTH_MODE"] = "token"
    from cluster.app import cluster_status
    from replicas.telemetry.reports import ReplicaView

    status = cluster_status(args.address)
    views = {replica: ReplicaView.model_validate(raw) for replica, raw in sorted(status["replicas"].items())}
    if args.json:
        for replica, view in views.items():  # the KV pool's shares, which the stats hold as page counts
            status["replicas"][replica] |= {"kv_cache_usage": view.kv_cache_usage,
                                            "prefix_cache_share": view.prefix_cache_share}
        print(json.dumps(status, indent=2, default=str))
        return 0
    for name, app in status["applications"].items():
        print(f"application {name}: {app['status']} {app['message']}".rstrip())
        for deployment, info in app["deployments"].items():
            print(f"  {deployment}: {info['status']} replicas {info['replicas']}")
    if not status["applications"]:
        print("no Serve application is running")
    print(f"{'replica':<12}{'running':>8}{'waiting':>8}{'free pages':>12}{'step debt':>11}{'drain s':>9}{'row-steps/s':>13}"
          f"{'cached':>8}{'prefix hits':>13}")
    for replica, view in views.items():
        hits = f"{view.prefix_hit_rate:.0%}" if view.prefix_pages_looked_up else "-"
        print(f"{replica:<12}{view.running:>8}{view.waiting:>8}{view.free_pages:>7}/{view.total_pages:<4}"
              f"{view.step_debt:>11.0f}{view.predicted_drain_s:>9.2f}{view.row_steps_per_s:>13.0f}"
              f"{view.cached_pages:>8}{hits:>13}")
    print(f"{'KV pool':<12}{'pages':>8}{'size':>12}{'usage':>8}{'prefix cache':>14}{'max_model_len':>15}")
    for replica, view in views.items():
        print(f"{replica:<12}{view.total_pages:>8}{_size(view.kv_cache_bytes):>12}{view.kv_cache_usage:>8.1%}"
              f"{view.prefix_cache_share:>14.1%}{view.max_model_len:>15}")
    return 0


def _size(nbytes: int) -> str:
    """``nbytes`` in GiB from 1 GiB up, else in MiB."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def cmd_render(args) -> int:
    from cluster.config import ConfigError, load_config
    from cluster.render import RenderOptions, render_k8s, render_rules

    options = RenderOptions(api_key_secret=args.api_key_secret, api_key_secret_key=args.api_key_secret_key,
                            network_policy=args.network_policy).check()
    misplaced = options.flags() if args.target == "rules" else " --prometheus-rule" * args.prometheus_rule
    if misplaced:
        raise ConfigError(f"{misplaced.split()[0]} does not apply to `render {args.target}`")
    config = load_config(args.config, _parse_set(args.set))
    if args.target == "rules":
        text = render_rules(config, args.config, args.prometheus_rule)
    else:
        text = render_k8s(config, args.config, options)
    if args.output:
        with open(args.output, "w") as out:
            out.write(text)
    else:
        sys.stdout.write(text)
    return 0


def register(commands, benches, client_only: bool) -> None:
    """Add the cluster's commands to ``commands`` (argparse subparsers): generate, up,
    status and render, which run (or render) the engine; none is a client command, so
    ``client_only`` adds nothing. The cluster has no bench (``benches`` is unused)."""
    if not client_only:
        _add_engine_commands(commands)


def _add_engine_commands(commands) -> None:
    from algorithms import available_algorithms

    algorithm_choices = {"algorithm": available_algorithms()}

    gen = commands.add_parser("generate", help="generate offline with the engine (no cluster)")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--model", default="tiny",
                     help="checkpoint directory, or 'tiny' for the embedded model (default)")
    gen.add_argument("--threshold", type=float, default=None, help="confidence threshold of the algorithm")
    gen.add_argument("--param", action="append", metavar="KEY=VALUE",
                     help="another algorithm parameter (repeatable), e.g. --param temperature=0.7")
    gen.add_argument("--max-tokens", type=int, default=128, help="output token limit (default 128)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--stream", action="store_true", help="print each block as it commits")
    _setting_flags(gen.add_argument_group("engine settings"), EngineConfig, ENGINE_DEST, algorithm_choices)
    gen.set_defaults(func=cmd_generate)

    from cluster.config import ReplicaSettings, describe_fields

    up = commands.add_parser(
        "up", help="start a local Ray cluster serving the model over an OpenAI API",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start Ray (local, or --address), the metrics actor and the Serve application.\n"
                    "Stopping: Ctrl-C (SIGINT) stops everything at once. SIGTERM stops gracefully: new\n"
                    "requests get 503 (code server_draining, Retry-After), the requests in flight finish\n"
                    "(at most drain_timeout_s, --drain-timeout), then everything stops and the exit code\n"
                    "is 0; a second SIGTERM or a Ctrl-C cuts the drain short.\n"
                    "Settings come from defaults, then --config, then --set, then the shortcut flags.",
        epilog="settings (YAML keys for --config, dotted keys for --set):\n" + "\n".join(describe_fields())
               + "\n  algorithm.name, algorithm.params: short for replica.algorithm, replica.algorithm_params")
    up.add_argument("--config", help="YAML file with settings")
    up.add_argument("--set", action="append", metavar="KEY=VALUE", help="one setting, e.g. --set slo.latency_s=10")
    up.add_argument("--address", help="connect to an existing Ray cluster instead of starting one")
    up.add_argument("--model", help="checkpoint directory or 'tiny'")
    up.add_argument("--replicas", type=int, help="fixed number of replicas (sets min and max)")
    up.add_argument("--min-replicas", type=int)
    up.add_argument("--max-replicas", type=int)
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--metrics-port", type=int)
    up.add_argument("--api-key-file", metavar="FILE",
                    help="require API keys, listed in FILE (one per line, optionally followed by the most requests "
                         "in flight that key may have); keys may also come from the environment variable "
                         "DLLM_API_KEYS (comma-separated); never pass a key on the command line")
    up.add_argument("--drain-timeout", type=float, metavar="S",
                    help="seconds SIGTERM waits for the requests in flight (drain_timeout_s, default 30)")
    _setting_flags(up.add_argument_group("replica settings (replica.* keys)"), ReplicaSettings, REPLICA_DEST,
                   algorithm_choices)
    up.set_defaults(func=cmd_up)

    status = commands.add_parser("status", help="replicas of a running cluster and their stats")
    status.add_argument("--address", default="auto",
                        help="Ray address, as `up` prints it (default: the local cluster Ray finds, the latest started)")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    render = commands.add_parser(
        "render", help="write deployment manifests from a config (k8s: a KubeRay RayService; rules: alert rules)",
        description="k8s: render the KubeRay RayService for the settings of `dllm-serve up --config FILE`: "
                    "serveConfigV2 (the same app builder, deployment options and autoscaling), a head group "
                    "and a worker group (nvidia.com/gpu when kubernetes.worker_gpus > 0), probes, resources "
                    "and metrics ports; headless Services for Prometheus and a NetworkPolicy. The kubernetes.* "
                    "settings (see `dllm-serve up --help`) choose the image and pod sizes; deploy/README.md has "
                    "the steps to apply it. rules: the Prometheus alert rules for the same settings (latency "
                    "thresholds from slo.latency_s).")
    render.add_argument("target", choices=["k8s", "rules"],
                        help="what to render (k8s: a ray.io/v1 RayService; rules: a Prometheus rule file)")
    render.add_argument("--config", required=True, help="YAML file with settings, as for `dllm-serve up`")
    render.add_argument("--set", action="append", metavar="KEY=VALUE", help="one setting, e.g. --set kubernetes.image=X")
    render.add_argument("-o", "--output", metavar="FILE", help="write here instead of standard output")
    render.add_argument(
        "--api-key-secret", metavar="NAME",
        help="require an API key, read from this Secret: the Ray pods get DLLM_API_KEYS (keys separated by "
             "commas) from its key --api-key-secret-key; no key is written into the manifest, and the pods "
             "do not start until the Secret exists")
    render.add_argument("--api-key-secret-key", metavar="KEY",
                        help="the key inside the --api-key-secret Secret (default: api-key)")
    render.add_argument(
        "--no-network-policy", dest="network_policy", action="store_false",
        help="leave out the NetworkPolicy that admits only the Serve port from outside the RayService's pods, "
             "and the metrics ports from the monitoring namespace (kubernetes.monitoring_namespace_labels); GCS, "
             "Ray client and dashboard stay inside, the operator excepted")
    render.add_argument("--prometheus-rule", action="store_true",
                        help="rules: a PrometheusRule resource (the Prometheus Operator) instead of a rule file")
    render.set_defaults(func=cmd_render)
