"""The README's metrics table, the Grafana dashboard, the alert rules and the exporter agree."""

import re

from cluster.metrics import METRICS
from observability import ROOT, alert_exprs, dashboard_targets, dashboard_variable_queries, metric_names

_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def exported_series() -> dict[str, str]:
    """Series name -> metric name, as the exporter writes them."""
    series = {}
    for spec in METRICS:
        suffixes = _HISTOGRAM_SERIES if spec.buckets else ("",)
        series |= {spec.name + suffix: spec.name for suffix in suffixes}
    return series


def referenced() -> dict[str, set[str]]:
    """dllm_* series name -> where it is read (dashboard panel or alert)."""
    places: dict[str, set[str]] = {}
    queries = [*dashboard_targets(), *(("variable", q) for q in dashboard_variable_queries()),
               *((f"alert {name}", expr) for name, expr in alert_exprs())]
    for place, expr in queries:
        for name in metric_names(expr):
            if name.startswith("dllm_"):
                places.setdefault(name, set()).add(place)
    return places


def test_every_referenced_metric_is_exported():
    unknown = {name: places for name, places in referenced().items() if name not in exported_series()}
    assert not unknown, f"read by the dashboard or alerts but not exported: {unknown}"


def test_every_exported_metric_is_documented_and_on_the_dashboard():
    documented = set(re.findall(r"^\| `(dllm_[a-z_]+)` \|", (ROOT / "README.md").read_text(), flags=re.M))
    exported = {spec.name for spec in METRICS}
    on_dashboard = {exported_series()[name] for name in referenced() if name in exported_series()}
    assert exported == documented, (
        f"undocumented: {sorted(exported - documented)}; documented, not exported: {sorted(documented - exported)}")
    assert exported <= on_dashboard, f"exported but on no dashboard panel or alert: {sorted(exported - on_dashboard)}"


def test_metric_name_extraction():
    expr = 'sum by (le) (rate(dllm_a_bucket{replica=~"$replica", le="30.0"}[5m])) / on (x) dllm_b and up{job="dllm"}'
    assert metric_names(expr) == {"dllm_a_bucket", "dllm_b", "up"}
