"""Plain-text tables of run summaries (the JSON report is the summary itself)."""

from __future__ import annotations

from loadgen.stats import QUANTILES


def number(value: float | None, fmt: str = ".3f") -> str:
    """``value`` formatted, '-' for None."""
    return "-" if value is None else format(value, fmt)


def _slo_text(slo: dict) -> str:
    parts = [f"{name} <= {slo[key]:g} s" for name, key in (("latency", "latency_s"), ("TTFB", "ttfb_s"))
             if slo[key] is not None]
    return "within " + " and ".join(parts) if parts else "counted: no SLO given"


def format_summary(summary: dict) -> str:
    """The report of one run as an aligned table."""
    rate = summary["achieved_rate"]
    lag = summary["max_send_lag_s"]
    lines = [
        f"offered rate     {number(summary['offered_rate'], '.2f')} req/s"
        + (f"  (achieved {rate:.2f} req/s, max send lag {lag * 1000:.1f} ms)" if rate is not None else ""),
        f"duration         {summary['duration_s']:.2f} s (first send to last completion)",
        f"requests         sent {summary['sent']} = completed {summary['completed']} + refused "
        f"{summary['refused']} + errors {summary['errors']}",
        f"{'seconds':<17}" + "".join(f"{f'p{q}':>9}" for q in QUANTILES) + f"{'mean':>9}{'max':>9}",
    ]
    for label, key in (("TTFB", "ttfb_s"), ("latency", "latency_s")):
        values = summary[key]
        lines.append(f"{label:<17}" + "".join(f"{number(values[f'p{q}']):>9}" for q in QUANTILES)
                     + f"{number(values['mean']):>9}{number(values['max']):>9}")
    source = ", ".join(summary["tokens_from"]) or "-"
    lines += [
        f"throughput       {summary['throughput_rps']:.2f} req/s, {summary['output_tokens_per_s']:.1f} output "
        f"tokens/s (tokens from {source})",
        f"goodput          {summary['goodput_rps']:.2f} req/s ({summary['good']} of {summary['completed']} "
        f"completed requests {_slo_text(summary['slo'])})",
    ]
    if summary["prefix_hit_rate"] is not None:
        lines.append(f"prefix cache     {summary['prefix_hit_rate']:.1%} of prompt tokens were cached")
    lines += [f"error            {count} x {message}" for message, count in summary["top_errors"].items()]
    return "\n".join(lines)


_SWEEP_COLUMNS = (  # header, width, value of a summary
    ("rate", 7, lambda s: number(s["offered_rate"], ".2f")),
    ("sent", 6, lambda s: str(s["sent"])),
    ("ok", 6, lambda s: str(s["completed"])),
    ("429", 5, lambda s: str(s["refused"])),
    ("err", 5, lambda s: str(s["errors"])),
    ("ttfb p50", 10, lambda s: number(s["ttfb_s"]["p50"])),
    ("ttfb p99", 10, lambda s: number(s["ttfb_s"]["p99"])),
    ("lat p50", 10, lambda s: number(s["latency_s"]["p50"])),
    ("lat p90", 10, lambda s: number(s["latency_s"]["p90"])),
    ("lat p99", 10, lambda s: number(s["latency_s"]["p99"])),
    ("req/s", 8, lambda s: f"{s['throughput_rps']:.2f}"),
    ("tok/s", 9, lambda s: f"{s['output_tokens_per_s']:.1f}"),
    ("goodput", 9, lambda s: f"{s['goodput_rps']:.2f}"),
)


def format_table(rows: list[dict], columns) -> list[str]:
    """A header line and one right-aligned line per row; ``columns``: (header, width, value of a row)."""
    return (["".join(f"{header:>{width}}" for header, width, _ in columns)]
            + ["".join(f"{value(row):>{width}}" for _, width, value in columns) for row in rows])


def format_sweep(summaries: list[dict]) -> str:
    """One row per offered rate (latencies in seconds, rates per second)."""
    rows = format_table(summaries, _SWEEP_COLUMNS)
    if summaries:
        rows.append(f"goodput: completed requests {_slo_text(summaries[0]['slo'])}")
    return "\n".join(rows)
