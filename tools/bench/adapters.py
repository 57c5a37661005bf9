"""``dllm-serve bench adapters``: what unmerged LoRA adapters cost a step.

Random LLaDA weights (what is measured is the work, not the answers) and random adapters
of rank ``rank`` on all seven projections of every layer (PEFT's layout, written to a
temporary folder and loaded as a server loads them). One closed batch of the same prompts
runs four ways, in alternating order for ``rounds`` rounds:

* ``plain``: an engine without adapters (the reference);
* ``base_rows``: an engine serving adapters, every row the base model's (what serving
  adapters costs the requests that use none);
* ``one_adapter``: every row the same adapter;
* ``mixed``: the rows spread over ``adapters`` adapters (two small products per adapter
  per adapted layer, each over its rows' tokens).

Each figure is the median step time over plain's, per round and the median of the rounds.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from replicas.engine import Engine, EngineConfig
from replicas.messages import GenerateRequest, SamplingParams
from tools.bench.canvas import IdsOnly, random_llada

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
WAYS = ("plain", "base_rows", "one_adapter", "mixed")


def write_random_adapter(path: Path, net, rank: int, seed: int) -> None:
    """A PEFT adapter of ``net`` on every projection, B not zero (scale 2 = alpha / r)."""
    generator = torch.Generator().manual_seed(seed)
    modules = dict(net.named_modules())
    tensors = {}
    for layer in range(len(net.model.layers)):
        for projection in PROJECTIONS:
            name = f"model.layers.{layer}.{projection}"
            linear = modules[name]
            tensors[f"base_model.model.{name}.lora_A.weight"] = (
                torch.randn(rank, linear.in_features, generator=generator) / linear.in_features ** 0.5)
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=generator) * 0.01
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(f'{{"peft_type": "LORA", "r": {rank}, "lora_alpha": {2 * rank}}}')
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _median_step_s(engine: Engine, requests: list[GenerateRequest]) -> float:
    steps = []
    engine.generate(requests, on_step=steps.append)
    return statistics.median(s.step_s for s in steps)


def bench_adapters(batch_sizes=(1, 16), rank: int = 16, adapters: int = 4, prompt_len: int = 64,
                   max_tokens: int = 128, steps: int = 8, rounds: int = 3, **shape) -> dict:
    plain_net = random_llada(**shape)
    settings = dict(fdfo_fill_hold=False, max_model_len=prompt_len + max_tokens + 64, algorithm="fixed_steps",
                    algorithm_params={"steps": steps})
    report = {"parameters": sum(p.numel() for p in plain_net.parameters()), "rank": rank, "adapters": adapters,
              "prompt_len": prompt_len, "max_tokens": max_tokens, "steps_per_block": steps, "rounds": rounds}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as folder:
        paths = {f"a{i}": Path(folder) / f"a{i}" for i in range(adapters)}
        for seed, path in enumerate(paths.values()):
            write_random_adapter(path, plain_net, rank, seed)
        for batch in batch_sizes:
            adapted_net = random_llada(**shape)  # the same weights; an engine serving adapters adapts its model
            engines = {"plain": Engine(plain_net, IdsOnly(), EngineConfig(max_batch=batch, **settings))}
            engines |= dict.fromkeys(WAYS[1:], Engine(adapted_net, IdsOnly(), EngineConfig(
                max_batch=batch, adapters={name: str(path) for name, path in paths.items()}, max_adapters=adapters,
                **settings)))
            prompts = [[1 + (i * 37 + r * 101) % 300 for i in range(prompt_len)] for r in range(batch)]
            names = list(paths)
            adapter_of = {"plain": lambda r: None, "base_rows": lambda r: None, "one_adapter": lambda r: names[0],
                          "mixed": lambda r: names[r % len(names)]}

            def requests(way: str) -> list[GenerateRequest]:
                return [GenerateRequest(f"{way}-{r}", prompt, params, adapter=adapter_of[way](r))
                        for r, prompt in enumerate(prompts)]

            for way in WAYS:  # warm-up: allocator, adapters loaded
                engines[way].generate(requests(way)[:1])
            step_s = {way: [] for way in WAYS}
            for r in range(rounds):
                for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                    step_s[way].append(_median_step_s(engines[way], requests(way)))
            report[f"batch_{batch}"] = {
                "plain_step_ms": round(1000 * statistics.median(step_s["plain"]), 2),
                **{f"{way}_over_plain": round(statistics.median(
                    s / p for s, p in zip(step_s[way], step_s["plain"])), 3) for way in WAYS[1:]},
                "rounds": {way: [round(1000 * s, 2) for s in step_s[way]] for way in WAYS}}
    return report
