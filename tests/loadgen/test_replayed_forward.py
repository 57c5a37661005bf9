"""The bench's replayed forward: a replay makes the recorded run's steps and tokens with
no forward, and one that feeds other tokens than the recording fails its requests."""

import pytest

from loadgen.bench.evaluation import tiny_params
from loadgen.bench.replayed_forward import RecordedForward
from replicas.engine import Engine, EngineConfig
from replicas.models import load_model, load_tokenizer
from replicas.tiny import task


@pytest.fixture(scope="module")
def recorded():
    net, tokenizer = load_model("tiny"), load_tokenizer("tiny")
    recorder = RecordedForward(net)
    prompts = [r.prompt for r in task.make_requests(12, seed=3)]
    config = EngineConfig(max_batch=4, fdfo_fill_hold=False)
    outputs = Engine(recorder, tokenizer, config).generate(prompts, tiny_params())
    return recorder, tokenizer, config, prompts, outputs


def test_a_replay_gives_the_recorded_tokens_without_running_the_model(recorded, monkeypatch):
    recorder, tokenizer, config, prompts, outputs = recorded
    forwards = len(recorder.recorded)

    def no_forward(*args, **kwargs):
        raise AssertionError("a replay ran the model")

    monkeypatch.setattr(recorder.model, "forward", no_forward)
    for _ in range(2):  # a recording replays more than once
        recorder.replay()
        steps = []
        replayed = Engine(recorder, tokenizer, config).generate(prompts, tiny_params(), on_step=steps.append)
        assert [o.token_ids for o in replayed] == [o.token_ids for o in outputs]
        assert [o.text for o in replayed] == [o.text for o in outputs]
        assert len(steps) == forwards and all(s.step_s > s.forward_s for s in steps)
    assert len(recorder.recorded) == forwards  # replays record nothing


def test_a_replay_that_feeds_other_tokens_fails_its_requests(recorded):
    recorder, tokenizer, config, prompts, _ = recorded
    recorder.replay()
    # a longer first prompt: other tokens in the first forward (the engine fails a broken forward's rows)
    [answer] = Engine(recorder, tokenizer, config).generate([prompts[0] + prompts[1]], tiny_params())
    assert "forward 0 of the replay fed" in answer.error and not answer.token_ids
