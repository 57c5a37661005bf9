"""``dllm-serve bench structured``: what a constraint costs and what it buys.

* **Step time.** Random SDAR weights over a byte-level BPE of ``vocab`` ids (trained here,
  ``tools.bench.bytelevel``); the same prompts run as one closed batch unconstrained and
  constrained by a JSON schema (every request), in alternating order, at each batch size;
  the ratio is the median step time (the whole engine step, the constrained decoding
  included) constrained over unconstrained, with every round's.
* **Compile time.** Each schema of ``SCHEMAS`` (and a few regexes) turned into a regular
  expression and compiled for that vocabulary from scratch: p50 and p99 milliseconds.
* **Accuracy.** The trained tiny model's held-out Sudoku requests, unconstrained and
  constrained by each request's own format: its grids' givens kept, a digit 1-4 in every
  blank (``puzzle_regex``); and the median step time of the two runs (a trained model's
  proposals mostly fit: the program runs where they do not).
"""

from __future__ import annotations

import json
import statistics
import time

from replicas.messages import SamplingParams
from replicas.tiny import task

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"]}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 8},
    {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "number"},
                                      "founded": {"type": "string", "format": "date"}}},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{4}"}, "qty": {"type": "integer"},
        "price": {"type": "number"}}, "required": ["sku", "qty"]}, "maxItems": 5},
        "customer": {"$ref": "#/$defs/customer"}}, "required": ["items"],
     "$defs": {"customer": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                                             "vip": {"type": "boolean"}}}}},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "number"}, "why": {"type": "string", "maxLength": 64}},
     "required": ["answer", "confidence"]},
    {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "integer"}, {"type": "null"}]},
    {"type": "object"},  # json_object
]
REGEXES = ["(yes|no)", "[0-9]{3}-[0-9]{4}", r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}", r"\d{4}-\d{2}-\d{2}"]
SOURCES = [("schema", schema) for schema in SCHEMAS] + [("regex", regex) for regex in REGEXES]


def puzzle_regex(request: task.Request) -> str:
    """The answer format of a tiny-task request: its grids in order, each cell its given
    digit or any of 1-4."""
    return "".join(cell if cell != task.BLANK else "[1-4]" for puzzle in request.puzzles for cell in puzzle)


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def compile_times(tokenizer, end_ids, excluded, sources=SOURCES) -> dict:
    """Milliseconds to turn each schema (and regex) into an automaton, compiled once each."""
    from cluster.structured import schema_regex
    from replicas.grammar import Grammars

    grammars = Grammars(tokenizer, end_ids, excluded)
    grammars.vocabulary  # noqa: B018 - built once per model, not per schema
    timings, states = [], []
    for kind, source in sources:
        start = time.perf_counter()
        regex = schema_regex(source, "response_format") if kind == "schema" else source
        automaton = grammars.compile(regex)
        timings.append(1000 * (time.perf_counter() - start))
        states.append(automaton.num_states)
    slowest = max(range(len(sources)), key=timings.__getitem__)
    return {"compiled": len(timings), "p50_ms": round(_percentile(timings, 0.5), 2),
            "p99_ms": round(_percentile(timings, 0.99), 2), "max_states": max(states),
            "slowest": json.dumps(sources[slowest][1])[:120]}


def _run(engine, prompts: list[str], params) -> tuple[float, list]:
    """The batch's median step seconds and its answers."""
    steps = []
    outputs = engine.generate(prompts, params, on_step=steps.append)
    return statistics.median(s.step_s for s in steps), outputs


def step_times(vocab: int, batch_sizes=(1, 16), rounds: int = 3, max_tokens: int = 64, hidden: int = 64,
               layers: int = 2, sources=SOURCES) -> dict:
    """Constrained over unconstrained median step time, per batch size (random SDAR weights
    of ``hidden`` and ``layers``: the forward the constrained decoding is measured beside)."""
    from cluster.structured import schema_regex
    from replicas.engine import Engine, EngineConfig
    from tools.bench.bytelevel import bytelevel_tokenizer, random_model

    tokenizer = bytelevel_tokenizer(vocab)
    net = random_model(tokenizer, "sdar", block_length=16, hidden=hidden, layers=layers)
    report = {"vocab": len(tokenizer), "hidden": hidden, "layers": layers, "max_tokens": max_tokens, "rounds": rounds,
              "compile": compile_times(tokenizer, net.spec.end_token_ids, (net.spec.mask_token_id,), sources)}
    regex = schema_regex(PERSON, "response_format")
    for batch in batch_sizes:
        engine = Engine(net, tokenizer, EngineConfig(max_batch=batch, fdfo_fill_hold=False, max_model_len=256,
                                                     algorithm="fixed_steps", algorithm_params={"steps": 4}))
        prompts = [f"person {i} as JSON:" for i in range(batch)]
        free = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        bound = SamplingParams(max_tokens=max_tokens, regex=regex)
        _run(engine, prompts, bound)  # warm-up, and the automaton compiled
        ratios, valid = [], 0
        for r in range(rounds):
            order = (free, bound) if r % 2 == 0 else (bound, free)
            seconds = {}
            for params in order:
                seconds[params is bound], outputs = _run(engine, prompts, params)
                if params is bound:
                    valid += sum(_is_json(o.text) for o in outputs)
            ratios.append(seconds[True] / seconds[False])
        report[f"batch_{batch}"] = {"free_step_ms": round(1000 * seconds[False], 2),
                                    "constrained_over_free": round(statistics.median(ratios), 3),
                                    "rounds": [round(r, 3) for r in ratios],
                                    "valid_json": f"{valid}/{rounds * batch}"}
    return report


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def accuracy(model: str = "tiny", num_requests: int = 200, max_batch: int = 16) -> dict:
    """The tiny task's accuracy unconstrained and constrained by each request's format."""
    from replicas.engine import Engine, EngineConfig
    from replicas.models import load_model, load_tokenizer
    from tools.bench.evaluation import score

    requests = task.heldout_requests()[:num_requests]
    engine = Engine(load_model(model), load_tokenizer(model), EngineConfig(max_batch=max_batch, fdfo_fill_hold=False))
    prompts = [r.prompt for r in requests]
    free_s, free = _run(engine, prompts, SamplingParams(max_tokens=task.MAX_TOKENS))
    bound_s, bound = _run(engine, prompts, [SamplingParams(max_tokens=task.MAX_TOKENS, regex=puzzle_regex(r))
                                            for r in requests])
    graded = {name: score(requests, outputs) for name, outputs in (("free", free), ("constrained", bound))}
    return {name: {"request_accuracy": round(g["request_accuracy"], 4), "puzzle_accuracy": round(g["puzzle_accuracy"], 4)}
            for name, g in graded.items()} | {"requests": num_requests, "max_batch": max_batch,
                                              "constrained_over_free_step": round(bound_s / free_s, 3)}


def bench_structured(vocab: int = 4000, batch_sizes=(1, 16), rounds: int = 3, requests: int = 200,
                     hidden: int = 64, layers: int = 2) -> dict:
    return {"step_time": step_times(vocab, batch_sizes, rounds, hidden=hidden, layers=layers),
            "tiny_accuracy": accuracy(num_requests=requests)}
