"""Attention spans: a row's units that see the same keys attend as one span (their keys
gathered once), where that pads no more queries than one span a unit; the logits and
tokens are those of one span a unit."""

import pytest
import torch

from replicas.engine import Engine, EngineConfig
from replicas.messages import SamplingParams
from replicas.runner import ModelRunner
from tools.bench.canvas import IdsOnly, random_llada


@pytest.fixture(scope="module")
def llada():
    return random_llada(d_model=64, layers=2, heads=4, mlp=176, vocab=500, seed=5)


def run(net, monkeypatch, merge: bool, kv_cache: str, prompts, max_tokens: int, later: int = 0, mode: str = "fdfo"):
    """(answers' tokens, every forward's block logits, (units, spans, keys are the queries)
    of every forward);
    the last prompt arrives ``later`` steps after the others."""
    if not merge:
        monkeypatch.setattr(ModelRunner, "_spans", lambda self, *args: None)
    engine = Engine(net, IdsOnly(), EngineConfig(
        mode=mode, max_batch=len(prompts), canvas="full", kv_cache=kv_cache, fdfo_fill_hold=False, max_model_len=256,
        algorithm="fixed_steps", algorithm_params={"steps": 4}))
    runner, layouts, logits = engine.runner, [], []
    build, forward = runner.build_inputs, runner.forward

    def recording_build(batch, refreshed):
        inputs = build(batch, refreshed)
        layout = inputs[2]
        layouts.append((runner._units(batch, refreshed)[0].size, layout.span_start.numel() - 1,
                        layout.keys_are_queries))
        return inputs

    def recording_forward(batch):
        out, timer = forward(batch)
        logits.append(out.clone())
        return out, timer

    monkeypatch.setattr(runner, "build_inputs", recording_build)
    monkeypatch.setattr(runner, "forward", recording_forward)
    answers = {}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts[:-1] if later else prompts):
        engine.add_request(prompt, params, f"r{i}", on_output=answers.setdefault(i, []).append)
    steps = 0
    while engine.has_work() or len(answers) < len(prompts):  # each answer streamed, block by block
        if later and steps == later:
            i = len(prompts) - 1
            engine.add_request(prompts[i], params, f"r{i}", on_output=answers.setdefault(i, []).append)
        engine.step()
        steps += 1
    monkeypatch.undo()
    assert all(chunks[-1].finished for chunks in answers.values())
    return [[t for chunk in answers[i] for t in chunk.token_ids] for i in range(len(prompts))], logits, layouts


@pytest.mark.parametrize("second_prompt", [40, 8])  # as long as the first (two pages), or shorter (padded)
def test_rows_refreshed_alike_attend_as_one_span_each_with_the_logits_of_one_span_a_unit(llada, monkeypatch,
                                                                                        second_prompt):
    prompts = [[7 + i for i in range(40)], [90 + i for i in range(second_prompt)]]
    tokens, logits, layouts = run(llada, monkeypatch, True, "none", prompts, 64)
    alone_tokens, alone_logits, alone_layouts = run(llada, monkeypatch, False, "none", prompts, 64)
    assert tokens == alone_tokens and all(len(t) == 64 for t in tokens) and len(logits) == len(alone_logits)
    for ours, theirs in zip(logits, alone_logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # every forward refreshes both rows' whole canvases (4 and 4 or 3 pages): one span a row,
    # whose keys are its own tokens (no gather from the cache)
    units = 8 if second_prompt == 40 else 7
    assert layouts and all(layout == (units, 2, True) for layout in layouts)
    assert all(spans == units and not own for units, spans, own in alone_layouts)


@pytest.mark.parametrize("mode", ["fdfo", "sync"])
def test_a_step_whose_rows_differ_keeps_one_span_a_unit_under_sdpa(llada, monkeypatch, mode):
    """With the prefix cache a block's first step refreshes its row and the later steps
    feed the block alone: a batch mixing the two would pad the one-unit rows' queries to
    the refreshed row's length, so its units stay apart."""
    prompts = [[7 + i for i in range(40)], [90 + i for i in range(40)]]
    tokens, _, layouts = run(llada, monkeypatch, True, "prefix", prompts, 64, later=2, mode=mode)
    alone_tokens, _, _ = run(llada, monkeypatch, False, "prefix", prompts, 64, later=2, mode=mode)
    assert tokens == alone_tokens
    merged = [(units, spans) for units, spans, _ in layouts if spans < units]
    apart = [(units, spans) for units, spans, own in layouts if spans == units and units > 2 and not own]
    # the rows' first steps merge; fdfo's mixed steps do not (sync starts the later row with
    # the next round, when both refresh)
    assert merged and (apart if mode == "fdfo" else not apart)
