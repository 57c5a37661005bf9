"""The Prometheus alert rules for one config (`dllm-serve render rules`).

Their latency thresholds are the config's SLO (``slo.latency_s``; where it is left to be
derived at run time, its floor: ``SLOSettings.latency_or_floor_s``), and the metrics actor
makes that SLO a bucket bound of ``dllm_request_latency_seconds``, so the burn-rate rule
reads the share of requests over it exactly. Job names are those of
deploy/prometheus: ``dllm`` (the metrics actor) and ``ray``. A stream's status, 200, goes out
before its end: the server-error rule counts the error events that end streams too
(``dllm_stream_errors_total``).
"""

from __future__ import annotations

from prometheus_client.utils import floatToGoString

from cluster.config import AppConfig

BURN_BUDGET = 0.01  # the share of requests that may exceed the SLO
FAST_BURN = 14.4  # page when that budget burns this many times too fast (Google SRE's 1 h / 5 min pair)
SERVER_ERROR_SHARE = 0.01  # warn when more requests than this end in an error of ours


def _rule(alert: str, expr: str, for_: str | None, severity: str, summary: str) -> dict:
    """One alerting rule (``for_`` None: it fires at the first evaluation that finds it true)."""
    return {"alert": alert, "expr": expr.strip() + "\n", **({"for": for_} if for_ else {}),
            "labels": {"severity": severity}, "annotations": {"summary": summary}}


def _share_over(slo: float, window: str) -> str:
    bucket = f'dllm_request_latency_seconds_bucket{{le="{floatToGoString(slo)}"}}'
    return (f"(1 - sum(rate({bucket}[{window}]))\n"
            f"       / sum(rate(dllm_request_latency_seconds_count[{window}])))")


def alert_rules(config: AppConfig) -> dict:
    """The rule groups (Prometheus' rule-file format)."""
    slo = config.slo.latency_or_floor_s
    burn = f"{FAST_BURN:g} * {BURN_BUDGET:g}"
    rules = [
        _rule("DllmLatencyP99OverSLO", f"""
histogram_quantile(0.99, sum by (le) (rate(dllm_request_latency_seconds_bucket[5m]))) > {slo:g}
""", "10m", "warning", "p99 request latency {{ $value | humanizeDuration }} is over the " + f"{slo:g} s SLO"),
        _rule("DllmLatencySLOFastBurn", f"""
{_share_over(slo, "1h")} > {burn}
and
{_share_over(slo, "5m")} > {burn}
""", None, "critical", f"requests over the {slo:g} s latency SLO burn the {BURN_BUDGET:.0%} error budget "
                       f"{FAST_BURN:g}x too fast (over the last hour and the last 5 minutes)"),
        _rule("DllmServerErrors", f"""
((sum(rate(dllm_http_responses_total{{code=~"5.."}}[5m])) or vector(0))
  + (sum(rate(dllm_stream_errors_total{{code=~"5.."}}[5m])) or vector(0)))
  / clamp_min(sum(rate(dllm_http_responses_total[5m])), 1e-9) > {SERVER_ERROR_SHARE:g}
""", "5m", "warning", "{{ $value | humanizePercentage }} of requests end in an error of ours: a 5xx, or an "
                      "error event inside a stream sent as 200 (timeout, replica failure, internal error)"),
        _rule("DllmStepQueueGrowing", """
min_over_time(dllm_step_queue_length[10m]) > 0 and deriv(dllm_step_queue_length[10m]) > 0.05
""", "5m", "warning", "replica {{ $labels.replica }}: its step queue has grown for 10 minutes"),
        _rule("DllmComputeRatioCollapse", """
avg_over_time(dllm_compute_ratio[10m]) < 0.5 and rate(dllm_steps_total[10m]) > 1
""", "10m", "warning", "replica {{ $labels.replica }}: forwards are {{ $value | humanizePercentage }} of step "
                       "time (dispatch overhead dominates)"),
        _rule("DllmRejectionsRising", """
sum(rate(dllm_rejected_total[5m]))
  / clamp_min(sum(rate(dllm_admitted_total[5m])) + sum(rate(dllm_rejected_total[5m])), 1e-9) > 0.05
""", "5m", "warning", "{{ $value | humanizePercentage }} of requests are refused at step capacity: add replicas"),
        _rule("DllmReplicaUnhealthy", """
min by (application, deployment, replica) (ray_serve_deployment_replica_healthy) == 0
""", "2m", "critical", "Serve replica {{ $labels.replica }} of {{ $labels.deployment }} fails its health check"),
        _rule("DllmNoReplicaReporting", "dllm_replicas == 0", "2m", "critical",
              "no engine replica has reported to the metrics actor for 2 minutes"),
        _rule("DllmMetricsDown", 'up{job="dllm"} == 0 or absent(up{job="dllm"})', "2m", "critical",
              "Prometheus cannot scrape the dllm-serve metrics actor"),
    ]
    return {"groups": [{"name": "dllm-serve", "rules": rules}]}


def prometheus_rule(config: AppConfig) -> dict:
    """The same rules as a PrometheusRule of the Prometheus Operator; its ``release: prometheus``
    label is the one a kube-prometheus-stack release named ``prometheus`` selects rules by."""
    metadata = {"name": "dllm-serve", "labels": {"release": "prometheus"}}
    if config.kubernetes.namespace:
        metadata["namespace"] = config.kubernetes.namespace
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": metadata,
            "spec": alert_rules(config)}
