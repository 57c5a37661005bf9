"""The committed Prometheus files pass promtool, and the Operator's copy of the rules is the same."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.metrics import METRICS
from observability import RULES, alert_exprs, binary

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


@pytest.mark.parametrize("check, path", [("rules", RULES), ("config", PROMETHEUS / "prometheus.yaml")])
def test_promtool_accepts(check, path):
    result = subprocess.run([binary("promtool"), "check", check, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_rule_resource_holds_the_same_rules():
    resource = yaml.safe_load((PROMETHEUS / "prometheusrule.yaml").read_text())
    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"] == yaml.safe_load(RULES.read_text())


def test_bucket_thresholds_in_alerts_are_buckets():
    """`le="X"` must name a bucket bound, or the series is silently empty."""
    buckets = {spec.name: spec.buckets for spec in METRICS if spec.buckets}
    for name, expr in alert_exprs():
        for metric, bound in re.findall(r'(\w+)_bucket\{[^}]*le="([^"]+)"', expr):
            assert float(bound) in buckets[metric], f"{name}: {metric} has no bucket le={bound}"
