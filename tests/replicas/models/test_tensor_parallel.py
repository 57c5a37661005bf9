"""Tensor (and, for LLaDA2.0, expert) parallel layers: two CPU ranks over gloo give the
logits one process gives, for each published architecture on a random checkpoint, each
rank reading only its share of the weights."""

from pathlib import Path

import pytest
import torch

from replicas.attention import DenseAttentionContext
from replicas.engine import Engine, follow_as_rank
from replicas.engine_config import EngineConfig
from replicas.messages import SamplingParams
from replicas.models.checkpoint import CheckpointError, check_checkpoint, load_model, load_tokenizer
from replicas.models.parallel import TensorParallel
from tests.replicas.models.checkpoint_builders import CHECKPOINTS, OVERRIDES, write_checkpoint
from tools.bench.local_ranks import on_ranks

TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 250, 250, 250, 7, 8, 9], [11, 12, 13, 14, 250, 250, 250, 250, 1, 2, 3, 4]])


def logits_on(tp: TensorParallel, checkpoint: Path, arch: str) -> dict:
    """One rank's logits of ``TOKENS`` (bidirectional) and the parameters it holds."""
    net = load_model(checkpoint, overrides=OVERRIDES[arch], tp=tp)
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    mask = torch.ones(TOKENS.shape[0], 1, TOKENS.shape[1], TOKENS.shape[1], dtype=torch.bool)
    with torch.inference_mode():
        logits = net(TOKENS, positions, DenseAttentionContext(mask))
    return {"logits": logits, "parameters": sum(p.numel() for p in net.parameters())}


@pytest.mark.parametrize("arch", sorted(CHECKPOINTS))
def test_two_ranks_give_the_logits_of_one(tmp_path, arch):
    checkpoint = write_checkpoint(tmp_path / arch, arch)
    [alone] = [logits_on(TensorParallel(), checkpoint, arch)]
    ranks = on_ranks(2, logits_on, checkpoint, arch)
    scale = alone["logits"].abs().max()
    for rank in ranks:  # float32 sums in another order: within 1e-5 of the logits' scale (~1e-6 seen)
        assert (rank["logits"] - alone["logits"]).abs().max() <= 1e-5 * scale
        # each holds about half: the norms, the router and (LLaDA2.0) nothing else are whole
        assert rank["parameters"] < 0.6 * alone["parameters"]
    assert torch.equal(ranks[0]["logits"].argmax(-1), alone["logits"].argmax(-1))


def test_a_model_that_does_not_split_is_refused_with_the_reason_before_anything_starts(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "sdar", "SDARForCausalLM")
    with pytest.raises(CheckpointError, match=r"the KV heads \(2\) does not split evenly over 4"):
        load_model(checkpoint, overrides=OVERRIDES["SDARForCausalLM"], tp=TensorParallel(0, 4))
    # what `dllm-serve up` checks before it starts a process
    with pytest.raises(CheckpointError, match=r"the KV heads \(2\) does not split evenly over 4"):
        check_checkpoint(checkpoint, overrides=OVERRIDES["SDARForCausalLM"], tensor_parallel_size=4)
    with pytest.raises(CheckpointError, match="TinyDllmForBlockDiffusion has no tensor-parallel layers"):
        check_checkpoint("tiny", tensor_parallel_size=2)
    check_checkpoint(checkpoint, overrides=OVERRIDES["SDARForCausalLM"], tensor_parallel_size=2)


PROMPTS = [[5, 17, 42, 99, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7, 8], [200, 100, 50, 25, 12, 6]]


def answers_on(tp: TensorParallel, checkpoint: Path, arch: str) -> list[list[int]] | int:
    """Rank 0: the engine's answers to ``PROMPTS`` (two blocks each, in one batch), its
    forwards broadcast to the other ranks; another rank: how many forwards it followed."""
    config = EngineConfig(model_overrides=OVERRIDES[arch], max_batch=4)
    model = load_model(checkpoint, overrides=OVERRIDES[arch], tp=tp)
    if tp.rank:
        return follow_as_rank(model, config)
    engine = Engine(model, load_tokenizer(checkpoint), config)
    try:
        params = SamplingParams(max_tokens=2 * engine.block_length, ignore_eos=True)
        return [chunk.token_ids for chunk in engine.generate(PROMPTS, params)]
    finally:
        engine.runner.broadcast.close()


@pytest.mark.parametrize("arch", sorted(CHECKPOINTS))
def test_an_engine_over_two_ranks_answers_as_over_one(tmp_path, arch):
    checkpoint = write_checkpoint(tmp_path / arch, arch)
    config = EngineConfig(model_overrides=OVERRIDES[arch], max_batch=4)
    alone = Engine.from_pretrained(str(checkpoint), config)
    expected = [c.token_ids for c in alone.generate(PROMPTS, SamplingParams(max_tokens=2 * alone.block_length,
                                                                            ignore_eos=True))]
    answers, followed = on_ranks(2, answers_on, checkpoint, arch)
    assert answers == expected
    assert followed >= 2  # at least one forward per block
