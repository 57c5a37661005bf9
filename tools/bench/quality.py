"""``dllm-serve bench quality``: what a lower confidence bar buys and costs, side by side.

Each setting is an algorithm with its knob: ``low_confidence`` (the tiny model's default
rule) at several thresholds, and ``fast_dllm_factor`` at several factors. A lower
threshold (a larger factor) commits more tokens per forward, so a block takes fewer
steps and the same machine serves more, at some cost in accuracy. On the trained tiny
model every setting runs the same held-out requests as one closed batch; the settings
run in turn, ``rounds`` times over (each round in the reverse order of the one before),
and tokens/s is the median of a setting's rounds. Accuracy, tokens per forward, steps per
block and the share of the default setting's steps saved do not depend on timing: they
come from the first round (the steps saved bound the speed-up a setting can give).

On random weights (``bench_quality_random``: an SDAR or a LLaDA of random weights and
random prompt ids) only tokens per forward mean anything: there is no right answer.

The engine (torch) is imported by the functions that run it, so the CLI's parser reads
the default sweep without it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from replicas.messages import SamplingParams
from replicas.tiny import task

THRESHOLDS = (0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.3)  # low_confidence; 0.95 is its default
FACTORS = (0.5, 1.0, 2.0, 4.0)  # fast_dllm_factor; 1 is Fast-dLLM's default


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: an algorithm and the value of its knob."""

    algorithm: str
    knob: str
    value: float

    @property
    def label(self) -> str:
        return f"{self.algorithm} {self.knob}={self.value:g}"

    def params(self, max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, algorithm=self.algorithm,
                              algorithm_params={self.knob: self.value}, ignore_eos=ignore_eos)


DEFAULT = Setting("low_confidence", "threshold", 0.95)  # the tiny model's rule as served: the ratios' base


def sweep(thresholds=THRESHOLDS, factors=FACTORS) -> list[Setting]:
    return ([Setting("low_confidence", "threshold", t) for t in thresholds]
            + [Setting("fast_dllm_factor", "factor", f) for f in factors])


@dataclass
class Runs:
    """A setting's runs: the first round's outputs and every round's tokens/s."""

    setting: Setting
    first: dict = field(default_factory=dict)
    tokens_per_s: list[float] = field(default_factory=list)


def _rounds(settings: list[Setting], rounds: int, run) -> list[Runs]:
    """``run(setting)`` -> (score dict, tokens/s), ``rounds`` times, alternating the order."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    runs = {s: Runs(s) for s in settings}
    for index in range(rounds):
        for setting in settings if index % 2 == 0 else settings[::-1]:
            scored, tokens_per_s = run(setting)
            runs[setting].first = runs[setting].first or scored
            runs[setting].tokens_per_s.append(tokens_per_s)
    return list(runs.values())


def _measure(engine, prompts, params) -> tuple[list, dict, float]:
    from tools.bench.engine import run_closed_batch, tokens_per_row_forward

    outputs, steps, wall = run_closed_batch(engine, prompts, params)
    tokens = sum(o.completion_tokens for o in outputs)
    blocks = [b for o in outputs for b in o.block_steps]
    shape = {"tokens_per_forward": tokens_per_row_forward(tokens, steps),
             "steps_per_block": round(sum(blocks) / len(blocks), 3), "steps": len(steps)}
    return outputs, shape, tokens / wall


def _table(runs: list[Runs], default: Setting | None) -> list[dict]:
    base = next((r for r in runs if r.setting == default), None)
    rows = []
    for r in runs:
        row = {"algorithm": r.setting.algorithm, r.setting.knob: r.setting.value, **r.first,
               "tokens_per_s": round(statistics.median(r.tokens_per_s), 1)}
        if base is not None:
            row["forwards_saved_vs_default"] = round(1 - r.first["steps"] / base.first["steps"], 3)
            ratios = [a / b for a, b in zip(r.tokens_per_s, base.tokens_per_s)]
            row["throughput_vs_default"] = round(statistics.median(ratios), 3)
            row["throughput_spread"] = round(max(ratios) - min(ratios), 3)
            if "request_accuracy" in row:
                row["accuracy_points_vs_default"] = round(
                    (row["request_accuracy"] - base.first["request_accuracy"]) * 100, 2)
        rows.append(row)
    return rows


def bench_quality(model: str = "tiny", num_requests: int = task.HELDOUT_REQUESTS, max_batch: int = 16,
                  rounds: int = 3, workload: str = "heldout", settings: list[Setting] | None = None) -> dict:
    """The sweep on the trained tiny model (accuracy and speed): its held-out requests, or
    ``hard`` ones (8 to 12 blanks a puzzle, as ``bench engine --workload hard``)."""
    from tools.bench.engine import BENCH_SEED, WORKLOADS, run_closed_batch
    from tools.bench.evaluation import score
    from replicas.engine import Engine, EngineConfig
    from replicas.models import load_model, load_tokenizer

    if not 1 <= num_requests <= task.HELDOUT_REQUESTS:
        raise ValueError(f"requests must be in 1..{task.HELDOUT_REQUESTS}, got {num_requests}")
    if workload not in ("heldout", "hard"):
        raise ValueError(f"unknown workload {workload!r}: heldout or hard")
    settings = settings or sweep()
    requests = (task.heldout_requests()[:num_requests] if workload == "heldout"
                else task.make_requests(num_requests, BENCH_SEED, blank_weights=WORKLOADS["hard"]))
    prompts = [r.prompt for r in requests]
    net, tokenizer = load_model(model), load_tokenizer(model)
    config = EngineConfig(max_batch=max_batch, fdfo_fill_hold=False)
    run_closed_batch(Engine(net, tokenizer, config), prompts[:max_batch], settings[0].params(task.MAX_TOKENS))  # warm-up

    def run(setting: Setting):
        outputs, shape, tokens_per_s = _measure(Engine(net, tokenizer, config), prompts,
                                                setting.params(task.MAX_TOKENS))
        graded = score(requests, outputs)
        return {"request_accuracy": round(graded["request_accuracy"], 4),
                "puzzle_accuracy": round(graded["puzzle_accuracy"], 4), **shape}, tokens_per_s

    return {"model": model, "workload": workload, "requests": num_requests, "max_batch": max_batch, "rounds": rounds,
            "default": DEFAULT.label, "settings": _table(_rounds(settings, rounds, run), DEFAULT)}


def bench_quality_random(architecture: str = "sdar", num_requests: int = 8, prompt_len: int = 64,
                         max_tokens: int = 64, max_batch: int = 8, settings: list[Setting] | None = None,
                         **shape) -> dict:
    """Tokens per forward of each setting on random weights (one round: nothing is timed)."""
    import random

    from tools.bench.canvas import IdsOnly, random_llada
    from tools.bench.prefix import random_sdar
    from replicas.engine import Engine, EngineConfig

    settings = settings or sweep()
    net = {"sdar": random_sdar, "llada": random_llada}[architecture](**shape)
    vocab = net.spec.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab - 200) for _ in range(prompt_len)] for _ in range(num_requests)]
    config = EngineConfig(max_batch=max_batch, fdfo_fill_hold=False,
                          max_model_len=prompt_len + max_tokens + 2 * net.spec.block_length)

    def run(setting: Setting):
        _, measured, tokens_per_s = _measure(Engine(net, IdsOnly(), config), prompts,
                                             setting.params(max_tokens, ignore_eos=True))
        return measured, tokens_per_s

    return {"architecture": architecture, "parameters": sum(p.numel() for p in net.parameters()),
            "requests": num_requests, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "block_length": net.spec.block_length,
            "settings": [{k: v for k, v in row.items() if k != "tokens_per_s"}
                         for row in _table(_rounds(settings, 1, run), None)]}


def format_quality(report: dict) -> str:
    """The sweep as a table."""
    rows = report["settings"]
    tiny = "request_accuracy" in rows[0]
    head = f"{'setting':<28}{'tokens/fwd':>11}{'steps/block':>12}"
    head += f"{'accuracy':>10}{'vs default':>11}{'steps saved':>12}{'tokens/s':>10}{'speed-up':>10}" if tiny else ""
    lines = [head]
    for row in rows:
        knob = "threshold" if "threshold" in row else "factor"
        line = f"{row['algorithm'] + ' ' + knob + '=' + format(row[knob], 'g'):<28}" \
               f"{row['tokens_per_forward']:>11.2f}{row['steps_per_block']:>12.2f}"
        if tiny:
            line += (f"{row['request_accuracy']:>10.1%}{row['accuracy_points_vs_default']:>+10.1f}p"
                     f"{row['forwards_saved_vs_default']:>12.1%}{row['tokens_per_s']:>10.0f}"
                     f"{row['throughput_vs_default']:>9.2f}x")
        lines.append(line)
    return "\n".join(lines)


def plot_quality(report: dict, path: str) -> None:
    """Accuracy against tokens per forward, one line per algorithm, each point its knob."""
    from loadgen.plot import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algorithm in dict.fromkeys(row["algorithm"] for row in report["settings"]):
        rows = [row for row in report["settings"] if row["algorithm"] == algorithm]
        knob = "threshold" if "threshold" in rows[0] else "factor"
        xs, ys = [row["tokens_per_forward"] for row in rows], [row["request_accuracy"] * 100 for row in rows]
        ax.plot(xs, ys, marker="o", label=f"{algorithm} ({knob})")
        for row, x, y in zip(rows, xs, ys):
            ax.annotate(format(row[knob], "g"), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xlabel="tokens committed per row-forward", ylabel="request accuracy (%)",
           title=f"tiny model, {report['requests']} {report['workload']} requests, batch {report['max_batch']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
