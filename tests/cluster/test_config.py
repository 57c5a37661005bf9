"""The app config: YAML, overrides, clear errors, and the CLI's handling of them."""

import socket
import subprocess
import sys

import pytest

from cluster.config import AppConfig, ConfigError, load_config


def test_defaults_are_valid():
    config = load_config()
    assert config.model == "tiny" and config.port == 8000 and config.metrics_port == 9400
    assert config.model_name == "tiny"


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("replica:\n  max_batch: 8\nslo:\n  latency_s: 5\nautoscaling:\n  max_replicas: 3\n")
    config = load_config(path, {"replica.max_batch": 4, "api_key_file": "/keys"})
    assert config.replica.max_batch == 4 and config.slo.latency_s == 5
    assert config.autoscaling.max_replicas == 3 and config.target_drain_s == 2.5
    assert config.api_key_file == "/keys"


def test_a_key_in_the_config_is_refused_without_echoing_it():
    with pytest.raises(ConfigError, match="api_key is not a setting") as refused:
        load_config(overrides={"api_key": "sk-secret-value"})
    assert "sk-secret-value" not in str(refused.value)


@pytest.mark.parametrize("content,overrides,message", [
    ("replica: [1, 2]\n", {}, "replica"),
    ("", {"replica.max_batch": 0}, "replica.max_batch"),
    ("", {"nonsense": 1}, "nonsense"),
    ("", {"autoscaling.min_replicas": 3, "autoscaling.max_replicas": 2}, "max_replicas"),
    ("", {"algorithm.name": "nope"}, "unknown algorithm"),
    ("", {"algorithm.name": "low_confidence", "algorithm.params": {"threshold": 7}}, "threshold"),
    ("", {"port": 9400}, "differ"),
    ("a: [", {}, "not valid YAML"),
    ("- 1\n", {}, "mapping"),
])
def test_invalid_config_gives_a_clear_message(tmp_path, content, overrides, message):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_config(path, overrides)


def test_missing_file():
    with pytest.raises(ConfigError, match="cannot read"):
        load_config("/nonexistent/dllm.yaml")


def test_cli_reports_bad_config_without_traceback():
    result = subprocess.run([sys.executable, "-m", "tools.cli", "up", "--set", "replica.max_batch=0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "replica.max_batch" in result.stderr and "Traceback" not in result.stderr


def test_up_checks_params_of_the_models_default_algorithm_before_starting(capsys):
    from tools.cli import main

    assert main(["up", "--set", "algorithm.params.nope=1"]) == 2  # no algorithm.name: the model's own
    assert "the model's default low_confidence" in capsys.readouterr().err


def test_up_refuses_a_taken_port_before_starting_ray():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "tools.cli", "up", "--set", f"metrics_port={port}"],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"metrics_port {port} on 127.0.0.1 is not free" in result.stderr and "Traceback" not in result.stderr
    assert "starting dllm-serve" not in result.stdout


@pytest.mark.parametrize("command", ["status", "up"])
def test_a_named_cluster_that_does_not_answer_is_a_clear_error_at_once(command):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    result = subprocess.run([sys.executable, "-m", "tools.cli", command, "--address", address],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"no Ray cluster answers at {address}" in result.stderr and "Traceback" not in result.stderr


def test_up_help_documents_every_setting():
    result = subprocess.run([sys.executable, "-m", "tools.cli", "up", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for key in ("replica.max_batch", "admission.cost_quantile", "slo.latency_s", "autoscaling.max_replicas",
                "metrics_port", "api_key_file", "DLLM_API_KEYS"):
        assert key in result.stdout
    assert AppConfig.model_fields  # the epilog is generated from these
