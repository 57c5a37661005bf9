"""The committed Prometheus files pass promtool and are what `render rules` writes; the
rules' latency thresholds follow the configured SLO, which the exporter makes a bucket
bound, and the rules fire on series as they say (`promtool test rules`)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from cluster.config import load_config
from cluster.metrics import MetricsExporter
from cluster.render import render_rules
from observability import RULES, binary

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
SOURCE = "deploy/config.gpu.yaml"  # the committed rules' config
COMMITTED = {False: RULES, True: PROMETHEUS / "prometheusrule.yaml"}


def promtool(*args: str, cwd: Path | None = None) -> None:
    result = subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("check, path", [("rules", RULES), ("config", PROMETHEUS / "prometheus.yaml")])
def test_promtool_accepts(check, path):
    promtool("check", check, str(path))


@pytest.mark.parametrize("operator", [False, True], ids=["rule file", "PrometheusRule"])
def test_committed_rules_are_a_fresh_render(operator, tmp_path):
    flags = ["--prometheus-rule"] if operator else []
    out = tmp_path / "rules.yaml"
    command = ["render", "rules", "--config", SOURCE, *flags]
    subprocess.run([sys.executable, "-m", "tools.cli", *command, "-o", str(out)], cwd=ROOT, check=True, timeout=120)
    fresh = render_rules(load_config(ROOT / SOURCE), SOURCE, operator)
    assert COMMITTED[operator].read_text() == out.read_text() == fresh, (
        f"re-render: dllm-serve {' '.join(command)} -o {COMMITTED[operator].relative_to(ROOT)}")


def test_the_operators_resource_holds_the_same_rules():
    resource = yaml.safe_load(COMMITTED[True].read_text())
    assert resource["kind"] == "PrometheusRule" and resource["spec"] == yaml.safe_load(RULES.read_text())


def rules_for(slo_s: float | None) -> dict:
    return yaml.safe_load(render_rules(load_config(overrides={"slo.latency_s": slo_s}), "config.yaml"))


def exprs(rules: dict) -> dict[str, str]:
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


@pytest.mark.parametrize("slo_s", [None, 10, 12.5, 45])
def test_latency_thresholds_follow_the_slo_and_name_an_exported_bucket(slo_s):
    """`le="X"` must name a bucket bound the exporter writes, or the series is silently empty."""
    rules = exprs(rules_for(slo_s))
    threshold = slo_s or 10  # unset: the floor of the SLO derived at run time
    assert rules["DllmLatencyP99OverSLO"].rstrip().endswith(f"> {threshold:g}")
    exporter = MetricsExporter(slo_latency_s=threshold)
    exporter.metrics["dllm_request_latency_seconds"].labels("r").observe(1.0)
    exposition = generate_latest(exporter.registry).decode()
    for name, expr in rules.items():
        for metric, bound in re.findall(r'(\w+_bucket)\{[^}]*le="([^"]+)"', expr):
            assert float(bound) == threshold, name
            assert f'{metric}{{le="{bound}",replica="r"}}' in exposition, f"{name}: {metric} has no bucket le={bound}"


SLO_S = 12.5  # the SLO of the rules promtool tests
RULES_AT_SLO = {rule["alert"]: rule for group in rules_for(SLO_S)["groups"] for rule in group["rules"]}


def _series(name: str, per_minute: float, minutes: int = 70) -> dict:
    return {"series": name, "values": f"0+{per_minute:g}x{minutes}"}


def fired(name: str, value: str = "") -> list[dict]:
    """The alert as it fires: its labels, its summary with ``$value`` humanized to ``value``."""
    rule = RULES_AT_SLO[name]
    summary = re.sub(r"\{\{ \$value \| \w+ \}\}", value, rule["annotations"]["summary"])
    return [{"exp_labels": rule["labels"], "exp_annotations": {"summary": summary}}]


def promtool_test(tmp_path: Path, cases: list[tuple[list[dict], dict[str, list[dict]]]]) -> None:
    """`promtool test rules` of the rules at ``SLO_S``: each case's series (one sample a
    minute), and at 65 min, each named alert firing as expected."""
    (tmp_path / "rules.yaml").write_text(render_rules(load_config(overrides={"slo.latency_s": SLO_S}), "c.yaml"))
    tests = [{"interval": "1m", "input_series": series,
              "alert_rule_test": [{"eval_time": "65m", "alertname": name, "exp_alerts": fires}
                                  for name, fires in alerts.items()]}
             for series, alerts in cases]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}))
    promtool("test", "rules", "tests.yaml", cwd=tmp_path)


def test_latency_rules_fire_as_they_say_at_the_configured_slo(tmp_path):
    """On 100 requests a minute: 80 within the SLO (12.5 s) and 95 within 30 s burn the
    budget and put p99 over the SLO; 50 within 10 s but all within 12.5 s (over a 10 s SLO,
    within this one) fire nothing."""
    def latencies(within: dict[str, float]) -> list[dict]:
        bucket = 'dllm_request_latency_seconds_bucket{{replica="a",le="{}"}}'
        buckets = [_series(bucket.format(le), n) for le, n in within.items()]
        return buckets + [_series('dllm_request_latency_seconds_count{replica="a"}', 100)]

    promtool_test(tmp_path, [
        (latencies({"10.0": 70, "12.5": 80, "30.0": 95, "+Inf": 100}),
         {"DllmLatencySLOFastBurn": fired("DllmLatencySLOFastBurn"),
          "DllmLatencyP99OverSLO": fired("DllmLatencyP99OverSLO", "30s")}),
        (latencies({"10.0": 50, "12.5": 100, "30.0": 100, "+Inf": 100}),
         {"DllmLatencySLOFastBurn": [], "DllmLatencyP99OverSLO": []}),
    ])


def test_errors_inside_streams_fire_the_server_error_alert(tmp_path):
    """Of 1000 responses a minute, all 200: 20 streams that end in a timeout's error event
    are 2% of requests failed; 5 of them, or errors of the client's (429s, a 400 event),
    are not over 1%; nor are 5 500s and 5 internal errors inside streams."""
    def responses(codes: dict[str, float], stream_errors: dict[str, float]) -> list[dict]:
        return [_series(f'dllm_http_responses_total{{code="{c}"}}', n) for c, n in codes.items()] \
            + [_series(f'dllm_stream_errors_total{{code="{c}"}}', n) for c, n in stream_errors.items()]

    promtool_test(tmp_path, [
        (responses({"200": 1000}, {"500": 0, "504": 20}), {"DllmServerErrors": fired("DllmServerErrors", "2%")}),
        (responses({"200": 1000, "429": 500}, {"504": 5, "400": 50}), {"DllmServerErrors": []}),
        (responses({"200": 995, "500": 5}, {"500": 5}), {"DllmServerErrors": []}),
        (responses({"200": 990, "500": 10}, {"500": 10}), {"DllmServerErrors": fired("DllmServerErrors", "2%")}),
    ])
