"""Request lifecycle: limits, EOS, stop strings, validation, abort, failure, streaming."""

import asyncio
import random
import threading
import time

import pytest
import torch

from exploding_algorithm import NAME as EXPLODING, register_exploding
from failing_call import failing_on_call
from replicas.async_engine import AsyncEngine
from replicas.request import FinishReason
from replicas.messages import RequestError, SamplingParams, WholeAnswer, joined


def assert_pool_full(engine):
    assert engine.pool.num_available == engine.pool.capacity
    assert engine.rows.num_free == engine.config.max_batch
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_max_tokens_truncates_inside_a_block(make_engine):
    engine = make_engine()
    [out] = engine.generate(["abc"], SamplingParams(max_tokens=20, ignore_eos=True))
    assert out.completion_tokens == 20 and len(out.token_ids) == 20
    assert out.finish_reason == FinishReason.LENGTH
    assert out.block_steps and len(out.block_steps) == 2


def test_eos_truncates_and_stops(make_engine, tokenizer):
    engine = make_engine()
    eos = tokenizer.eos_token_id
    # an algorithm-independent way to force EOS: a prompt the random model maps to EOS is
    # not available, so check the output processor directly on a committed block
    request = engine.make_request("abc", SamplingParams(max_tokens=64))
    commit = engine.outputs.commit_block(request, [10, 11, eos, 12] + [eos] * 12)
    assert commit.token_ids == [10, 11] and commit.finish_reason is FinishReason.STOP
    assert request.output_ids == [] and request.finish_reason is None  # the scheduler applies it


def test_stop_string_cuts_text(make_engine, tokenizer):
    engine = make_engine()
    request = engine.make_request("abc", SamplingParams(max_tokens=64, stop=("cd",)))
    ids = tokenizer("abcdef", add_special_tokens=False)["input_ids"]
    commit = engine.outputs.commit_block(request, ids + [ids[0]] * (16 - len(ids)))
    assert commit.text == "ab" and commit.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("prompt,params,message", [
    ("", SamplingParams(), "empty"),
    ("x" * 300, SamplingParams(max_tokens=16), "serves at most"),
    ("abc", SamplingParams(max_tokens=10_000), "serves at most"),
    ("abc", SamplingParams(algorithm="nope"), "unknown algorithm"),
    ("abc", SamplingParams(algorithm="low_confidence", algorithm_params={"threshold": 2}), "threshold"),
    ("abc", SamplingParams(algorithm="low_confidence", algorithm_params={"bogus": 1}), "unknown parameter"),
])
def test_invalid_requests_are_refused(make_engine, prompt, params, message):
    engine = make_engine()
    with pytest.raises(RequestError, match=message):
        engine.add_request(prompt, params)
    assert_pool_full(engine)


def test_requests_asking_alike_share_validated_parameters_and_bad_ones_stay_refused(make_engine):
    """``Engine.algorithm_for`` keeps validated choices: a repeated one is not validated
    again, and a value equal to a kept one but of another type (True == 1) or one that
    cannot be kept (a list) is still judged on its own."""
    engine = make_engine()
    first = engine.make_request("abc", SamplingParams(algorithm="low_confidence", algorithm_params={"top_k": 1}))
    again = engine.make_request("abc", SamplingParams(algorithm="low_confidence", algorithm_params={"top_k": 1}))
    assert first.algorithm_params is again.algorithm_params and first.algorithm_params.top_k == 1
    for value in (True, 1.0, [1]):
        with pytest.raises(RequestError, match="top_k must be an integer"):
            engine.make_request("abc", SamplingParams(algorithm="low_confidence", algorithm_params={"top_k": value}))
    other = engine.make_request("abc", SamplingParams(algorithm="low_confidence", algorithm_params={"top_k": 2}))
    assert other.algorithm_params.top_k == 2


def test_bad_sampling_params():
    with pytest.raises(RequestError):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError):
        SamplingParams(stop=("",))


def test_literal_mask_text_is_not_a_mask(make_engine, tokenizer):
    engine = make_engine()
    ids = engine.encode("a [MASK] b")
    assert tokenizer.mask_token_id not in ids
    with pytest.raises(RequestError, match="mask"):
        engine.add_request([5, tokenizer.mask_token_id, 6])


@pytest.mark.parametrize("mode", ["fdfo", "sync", "static", "fixed_fill"])
def test_no_page_leak_with_aborts(make_engine, mode):
    """250 random requests, 20% aborted mid-block at random steps: the pool ends full."""
    rng = random.Random(mode)
    engine = make_engine(mode=mode, max_batch=16, fill_timeout_s=0.001)
    finals = {}

    def record(request_id):
        return lambda output: output.finished and finals.__setitem__(request_id, output)

    ids = [engine.add_request([rng.randrange(5, 40) for _ in range(rng.randrange(1, 60))],
                              SamplingParams(max_tokens=rng.randrange(1, 64), ignore_eos=True,
                                             algorithm_params={"threshold": rng.choice([0.0, 0.5])}),
                              request_id=f"r{i}", on_output=record(f"r{i}")) for i in range(250)]
    to_abort = set(rng.sample(ids, 50))
    steps = 0
    while engine.has_work():
        if engine.step() is None:
            time.sleep(engine.hold_s())
        steps += 1
        for request_id in list(to_abort):
            request = engine._requests.get(request_id)
            if request is not None and request.steps_in_block > 0 and rng.random() < 0.3:
                engine.abort(request_id)
                to_abort.discard(request_id)
    assert set(finals) == set(ids)  # every request got exactly one final answer
    aborted = [o for o in finals.values() if o.finish_reason == FinishReason.ABORT]
    assert len(aborted) >= 25
    assert_pool_full(engine)


def test_failing_algorithm_fails_only_its_rows(make_engine, monkeypatch):
    register_exploding(monkeypatch)
    engine = make_engine(max_batch=4)
    outs = engine.generate(["abc", "def", "ghi"], [
        SamplingParams(max_tokens=32, ignore_eos=True),
        SamplingParams(max_tokens=32, algorithm=EXPLODING),
        SamplingParams(max_tokens=32, ignore_eos=True)])
    assert [o.finish_reason for o in outs] == [FinishReason.LENGTH, FinishReason.ERROR, FinishReason.LENGTH]
    assert "boom" in outs[1].error
    assert engine.totals.requests_failed == 1
    assert_pool_full(engine)


def test_failing_forward_fails_rows_and_engine_recovers(make_engine):
    engine = make_engine(max_batch=4)
    engine.runner.forward = failing_on_call(engine.runner.forward, 2, RuntimeError("device lost"))
    outs = engine.generate(["abc", "def"], SamplingParams(max_tokens=32, ignore_eos=True))
    assert all(o.finish_reason == FinishReason.ERROR for o in outs)
    assert_pool_full(engine)
    [again] = engine.generate(["abc"], SamplingParams(max_tokens=32, ignore_eos=True))
    assert again.finish_reason == FinishReason.LENGTH


def test_mixed_algorithms_in_one_batch_match_running_alone(make_engine):
    params = [SamplingParams(max_tokens=32, ignore_eos=True, algorithm=name)
              for name in ["low_confidence", "fast_dllm_threshold", "fixed_steps", "joint_threshold"]]
    prompts = ["abc", "hello", "xyz12", "q"]
    together = make_engine(max_batch=8).generate(prompts, params)
    alone = [make_engine(max_batch=1).generate([p], q)[0] for p, q in zip(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_async_stream_yields_each_block_before_the_end(make_engine):
    engine = make_engine()
    runner = AsyncEngine(engine)

    async def collect():
        return [o async for o in runner.generate("abc", SamplingParams(max_tokens=64, ignore_eos=True))]

    try:
        outputs = asyncio.run(collect())
    finally:
        runner.shutdown()
    assert len(outputs) == 4
    assert [o.finished for o in outputs] == [False, False, False, True]
    assert all(len(o.token_ids) == 16 for o in outputs)


def test_a_whole_answer_wakes_the_caller_once_and_reports_each_block_in_the_engine_thread(make_engine):
    """``whole``: one chunk, the streamed chunks joined (log-probabilities too); ``on_progress``
    sees each block before the last as it commits, in the engine's thread; the caller's loop
    is handed one item, not one a block."""
    engine = make_engine()
    runner = AsyncEngine(engine)
    params = SamplingParams(max_tokens=64, ignore_eos=True, logprobs=1, algorithm_params={"seed": 3})
    seen, handed = [], []

    async def answers():
        streamed = [o async for o in runner.generate("abc", params)]
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args):
            handed.append(args)
            return call_soon_threadsafe(*args)

        loop.call_soon_threadsafe = counted
        def progressed(steps, tokens):
            seen.append((threading.current_thread().name, steps, tokens))

        whole = [o async for o in runner.generate("abc", params, whole=True, on_progress=progressed)]
        return streamed, whole

    try:
        streamed, whole = asyncio.run(answers())
    finally:
        runner.shutdown()
    assert len(streamed) == 4 and len(whole) == 1 and len(handed) == 1
    answer = lambda c: (c.text, c.token_ids, c.block_steps, c.finish_reason, c.logprobs, c.steps,  # noqa: E731
                        c.completion_tokens)  # (not its timing or cache hits)
    assert answer(whole[0]) == answer(joined(streamed)) and len(whole[0].logprobs) == 64
    assert [(steps, tokens) for _, steps, tokens in seen] == [(c.steps, len(c.token_ids)) for c in streamed[:-1]]
    assert {name for name, _, _ in seen} == {"dllm-engine"}


def test_a_whole_answer_that_ends_early_keeps_the_blocks_it_committed(make_engine):
    """A whole answer aborted after some blocks: its chunks joined carry their ids."""
    engine = make_engine()
    chunks = []

    def abort_after_the_first_block(steps, tokens):
        engine.abort(request_id)

    request_id = engine.add_request("abc", SamplingParams(max_tokens=128, ignore_eos=True), whole=True,
                                    on_output=WholeAnswer(chunks.append, on_block=abort_after_the_first_block))
    while engine.has_work():
        engine.step()
    [chunk] = chunks
    assert chunk.finished and chunk.finish_reason == "abort"
    block = engine.block_length
    assert 0 < len(chunk.token_ids) < 128 and len(chunk.token_ids) % block == 0
    assert len(chunk.token_ids) == chunk.completion_tokens and len(chunk.block_steps) == len(chunk.token_ids) // block


@pytest.mark.parametrize("stop, decodes", [((), "once"), (("never there",), "per block")])
def test_a_whole_answer_is_decoded_once_unless_a_stop_string_needs_its_text_sooner(make_engine, stop, decodes):
    engine = make_engine()
    decode, sizes = engine.outputs.decode, []
    engine.outputs.decode = lambda ids: sizes.append(len(ids)) or decode(ids)
    params = SamplingParams(max_tokens=64, ignore_eos=True, stop=stop, algorithm_params={"seed": 3})
    [whole] = engine.generate(["abc"], params)
    streaming, chunks = make_engine(), []
    streaming.add_request("abc", params, on_output=chunks.append)  # text block by block
    while streaming.has_work():
        streaming.step()
    assert whole.text == joined(chunks).text and len(whole.token_ids) == 64 and len(chunks) == 4
    assert sizes == [64] if decodes == "once" else len(sizes) >= 4


def test_async_cancel_aborts_and_frees_pages(make_engine):
    engine = make_engine()
    runner = AsyncEngine(engine)

    async def take_one():
        stream = runner.generate("abc", SamplingParams(max_tokens=128, ignore_eos=True))
        first = await stream.__anext__()
        await stream.aclose()
        return first

    try:
        first = asyncio.run(take_one())
        assert not first.finished
        # The engine thread frees the request's row before it counts the abort: wait for
        # both (the first alone once read a count not yet made on a busy machine).
        deadline = time.monotonic() + 60
        while (engine.has_work() or engine.totals.requests_aborted == 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.totals.requests_aborted == 1 and not engine.has_work()
        assert_pool_full(engine)
    finally:
        runner.shutdown()


def test_fixed_fill_waits_to_fill_the_batch_or_for_the_timeout(make_engine):
    engine = make_engine(mode="fixed_fill", max_batch=4, fill_timeout_s=0.3)
    params = SamplingParams(max_tokens=16, ignore_eos=True, algorithm_params={"threshold": 0.0})
    for prompt in ["a", "b", "c"]:
        engine.add_request(prompt, params)
    assert engine.step() is None  # three of four rows: hold
    assert 0 < engine.hold_s() <= 0.3
    engine.add_request("d", params)
    stats = engine.step()  # the fourth arrival fills the batch: start at once
    assert stats is not None and stats.batch_size == 4
    while engine.has_work():
        engine.step()
    engine.add_request("e", params)
    start = time.monotonic()
    assert engine.step() is None
    while engine.has_work():
        if engine.step() is None:
            time.sleep(engine.hold_s())
    assert time.monotonic() - start >= 0.29  # a lone request waited for the timeout
    assert_pool_full(engine)


def test_the_token_budget_is_a_bound(make_engine):
    """A fused-commit step feeds each row's new block and its last block's write: a budget
    of one block per row is refused, and no step feeds more than the budget."""
    with pytest.raises(ValueError, match="at least 128"):
        make_engine(max_batch=4, max_tokens_per_step=64, fused_commit=True)
    make_engine(max_batch=4, max_tokens_per_step=64, fused_commit=False)
    engine = make_engine(max_batch=4, max_tokens_per_step=128, fused_commit=True)
    fed = []
    for prompt in ["1.3." * 5, "abc", "12.4..7.9" * 3, "x"]:
        engine.add_request(prompt, SamplingParams(max_tokens=48, ignore_eos=True))
    while engine.has_work():
        stats = engine.step()
        if stats is not None:
            fed.append(stats.num_tokens)
    assert fed and max(fed) <= 128


def test_every_step_runs_in_inference_mode_however_it_is_called(make_engine, monkeypatch):
    """``Engine.step`` enters ``torch.inference_mode`` itself when its caller has not; the
    loops that step many times (``generate``, the async engine's thread) enter it once."""
    engine = make_engine()
    modes = []
    forward = engine.runner.forward

    def recorded(batch):
        modes.append((threading.current_thread().name, torch.is_inference_mode_enabled()))
        return forward(batch)
    monkeypatch.setattr(engine.runner, "forward", recorded)

    engine.add_request("abc", SamplingParams(max_tokens=32, ignore_eos=True))
    assert not torch.is_inference_mode_enabled()
    while engine.has_work():
        engine.step()
    engine.generate(["abc"], SamplingParams(max_tokens=32, ignore_eos=True))
    runner = AsyncEngine(engine)

    async def collect():
        return [o async for o in runner.generate("abc", SamplingParams(max_tokens=32, ignore_eos=True))]
    try:
        asyncio.run(collect())
    finally:
        runner.shutdown()
    assert {thread for thread, _ in modes} == {threading.current_thread().name, "dllm-engine"}
    assert len(modes) >= 3 and all(enabled for _, enabled in modes)
    assert not torch.is_inference_mode_enabled()
