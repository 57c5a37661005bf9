"""Figures of a run and of a rate sweep (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence

from loadgen.records import OK, REFUSED, LoadgenError, Record


def pyplot():
    """matplotlib.pyplot on the Agg backend; ``LoadgenError`` if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise LoadgenError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: list[float], label: str) -> None:
    ordered = sorted(values)
    ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=label)


def plot_run(records: Sequence[Record], path: str, title: str) -> None:
    """Latency and TTFB CDFs of completed requests, and latency against send time with
    refusals and errors marked (at the time their answer took)."""
    plt = pyplot()
    fig, (cdf, timeline) = plt.subplots(1, 2, figsize=(12, 4.5))
    done = [r for r in records if r.status == OK]
    if done:
        _cdf(cdf, [r.latency_s for r in done], "latency")
        ttfb = [r.ttfb_s for r in done if r.ttfb_s is not None]
        if ttfb:
            _cdf(cdf, ttfb, "TTFB")
        cdf.legend()
    cdf.set(xlabel="seconds", ylabel="fraction of completed requests", title="CDF", ylim=(0, 1.02))
    cdf.grid(alpha=0.3)
    for status, style in ((OK, dict(marker=".", color="tab:blue", label="completed")),
                          (REFUSED, dict(marker="x", color="tab:red", label="refused (429)")),
                          ("error", dict(marker="^", color="black", label="error"))):
        chosen = [r for r in records if r.status == status]
        if chosen:
            timeline.scatter([r.sent_s for r in chosen], [r.latency_s for r in chosen], s=14, **style)
    timeline.set(xlabel="send time (s from start)", ylabel="latency (s)", title="latency over time")
    if records:
        timeline.legend()
    timeline.grid(alpha=0.3)
    _save(plt, fig, path, title)


def plot_sweep(summaries: Sequence[dict], path: str, title: str) -> None:
    """p50/p99 latency and throughput/goodput against offered rate."""
    plt = pyplot()
    fig, (latency, rates) = plt.subplots(1, 2, figsize=(12, 4.5))
    offered = [s["offered_rate"] for s in summaries]
    for q in ("p50", "p99"):
        latency.plot(offered, [s["latency_s"][q] for s in summaries], marker="o", label=f"latency {q}")
    latency.set(xlabel="offered rate (req/s)", ylabel="seconds", title="latency of completed requests")
    rates.plot(offered, [s["throughput_rps"] for s in summaries], marker="o", label="throughput")
    rates.plot(offered, [s["goodput_rps"] for s in summaries], marker="s", label="goodput")
    rates.plot(offered, offered, linestyle="--", color="gray", label="offered")
    rates.set(xlabel="offered rate (req/s)", ylabel="req/s", title="throughput and goodput")
    for ax in (latency, rates):
        ax.legend()
        ax.grid(alpha=0.3)
    _save(plt, fig, path, title)


def _save(plt, fig, path: str, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
