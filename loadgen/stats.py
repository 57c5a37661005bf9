"""Percentiles and the run summary: pure functions over records."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from loadgen.records import OK, REFUSED, Record

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict:
    """p50/p90/p99, mean and max of ``values`` (all None when empty)."""
    summary = {f"p{q}": percentile(values, q) for q in QUANTILES}
    summary["mean"] = sum(values) / len(values) if values else None
    summary["max"] = max(values) if values else None
    return summary


def meets_slo(record: Record, slo_latency_s: float | None, slo_ttfb_s: float | None) -> bool:
    """A completed request within both SLOs (an SLO that is None always holds)."""
    return (record.status == OK
            and (slo_latency_s is None or record.latency_s <= slo_latency_s)
            and (slo_ttfb_s is None or (record.ttfb_s is not None and record.ttfb_s <= slo_ttfb_s)))


def summarize(records: Sequence[Record], offered_rate: float, slo_latency_s: float | None = None,
              slo_ttfb_s: float | None = None, top_errors: int = 5) -> dict:
    """The report of one run.

    duration_s runs from the first send to the last completion; throughput, output tokens/s
    and goodput (completed requests within the SLO) are per second of that duration.
    Percentiles cover completed requests only.
    """
    done = [r for r in records if r.status == OK]
    refused = sum(r.status == REFUSED for r in records)
    first_send = min((r.sent_s for r in records), default=0.0)
    last_send = max((r.sent_s for r in records), default=0.0)
    duration = max((r.end_s for r in done), default=first_send) - first_send
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    tokens = sum(r.output_tokens for r in done)
    good = sum(meets_slo(r, slo_latency_s, slo_ttfb_s) for r in done)
    errors = Counter(r.error for r in records if r.status not in (OK, REFUSED))
    told = [r for r in done if r.prompt_tokens and r.cached_tokens is not None]
    return {
        "offered_rate": offered_rate,
        "sent": len(records),
        "completed": len(done),
        "refused": refused,
        "errors": len(records) - len(done) - refused,
        "duration_s": duration,
        "achieved_rate": (len(records) - 1) / (last_send - first_send) if last_send > first_send else None,
        "max_send_lag_s": max((r.sent_s - r.planned_s for r in records), default=None),
        "ttfb_s": distribution([r.ttfb_s for r in done if r.ttfb_s is not None]),
        "latency_s": distribution([r.latency_s for r in done]),
        "throughput_rps": per_second(len(done)),
        "output_tokens": tokens,
        "output_tokens_per_s": per_second(tokens),
        "tokens_from": sorted({r.tokens_from for r in done if r.tokens_from}),
        # prompt tokens the server found in its prefix cache, of those of the answers that say
        "prefix_hit_rate": sum(r.cached_tokens for r in told) / sum(r.prompt_tokens for r in told) if told else None,
        "slo": {"latency_s": slo_latency_s, "ttfb_s": slo_ttfb_s},
        "good": good,
        "goodput_rps": per_second(good),
        "top_errors": dict(errors.most_common(top_errors)),
    }
