"""docs/configuration.md is what the settings say now (regenerate it when this fails)."""

from pathlib import Path

from cluster.config import AppConfig
from cluster.config_reference import render, settings, up_flags

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_page_is_current():
    assert PAGE.read_text() == render(), (
        "docs/configuration.md is stale: run `python -m cluster.config_reference > docs/configuration.md`")


def test_every_setting_is_described_once():
    keys = [setting.key for setting in settings()]
    assert len(keys) == len(set(keys))
    assert {"model", "replica.max_batch", "slo.latency_s", "quality.levels[].step_ratio"} <= set(keys)
    assert not [setting.key for setting in settings() if not setting.description.strip()]


def test_flags_name_the_settings_they_set():
    flags = up_flags()
    assert flags["replica.max_batch"] == "--max-batch"
    assert flags["drain_timeout_s"] == "--drain-timeout"
    assert flags["autoscaling.min_replicas"] == "--min-replicas"
    assert set(flags) <= {setting.key for setting in settings()}
    assert all(f"`{key}` | `{flag}` |" in render() for key, flag in flags.items())


def test_defaults_are_the_models():
    page = render()
    assert f"| `port` | `--port` | int | `{AppConfig().port}` |" in page
    assert "| `replica.num_pages` | `--num-pages` | int or none | none |" in page
