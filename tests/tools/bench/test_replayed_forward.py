"""The bench's replayed forward: a replay makes the recorded run's steps and tokens with
no forward, and one that feeds other tokens than the recording fails its requests."""

import pytest

from tools.bench.evaluation import tiny_params
from tools.bench.prefix import random_sdar
from tools.bench.replayed_forward import PacedReplay, RecordedForward
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



@pytest.mark.parametrize("run_pacer", [True, False], ids=["paced", "no forward"])
def test_a_paced_replay_gives_the_recorded_tokens_with_the_pacers_forward(recorded, monkeypatch, run_pacer):
    """The engine sees the recorded model's spec with the pacer's KV shape and vocabulary,
    and commits the recorded tokens (the pacer's logits beyond the recorded vocabulary are
    -inf); the pacer runs once per forward (none without ``run_pacer``), the recorded
    model never."""
    recorder, tokenizer, config, prompts, outputs = recorded
    pacer = random_sdar(hidden=32, layers=1, heads=2, vocab=200)
    paced_forwards = []
    pacer_forward = pacer.forward
    monkeypatch.setattr(pacer, "forward", lambda *args: paced_forwards.append(args) or pacer_forward(*args))
    monkeypatch.setattr(recorder.model, "forward", lambda *args: pytest.fail("a replay ran the recorded model"))
    paced = PacedReplay(recorder, pacer, run_pacer)
    assert (paced.spec.vocab_size, paced.spec.num_layers, paced.spec.block_length) == (200, 1, 16)
    replayed = Engine(paced, tokenizer, config).generate(prompts, tiny_params())
    assert [o.token_ids for o in replayed] == [o.token_ids for o in outputs]
    assert len(paced_forwards) == (len(recorder.recorded) if run_pacer else 0)
