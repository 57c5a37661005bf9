"""Tensor (and, for LLaDA2.0, expert) parallel layers: for each published architecture on a
random checkpoint, two CPU ranks over gloo, each reading only its share of the weights, give
the logits one process gives, and an engine over them answers as an engine over one."""

from dataclasses import replace
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
from tests.replicas.models.test_lora import checkpoint_weights, write_adapter
from tools.bench.local_ranks import on_ranks

TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 250, 250, 250, 7, 8, 9], [11, 12, 13, 14, 250, 250, 250, 250, 1, 2, 3, 4]])
PROMPTS = [[5, 17, 42, 99, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7, 8], [200, 100, 50, 25, 12, 6]]


def config(arch: str) -> EngineConfig:
    return EngineConfig(model_overrides=OVERRIDES[arch], max_batch=4)


def answers(engine: Engine) -> list[list[int]]:
    """The engine's answers to ``PROMPTS``, two blocks each, in one batch."""
    params = SamplingParams(max_tokens=2 * engine.block_length, ignore_eos=True)
    return [chunk.token_ids for chunk in engine.generate(PROMPTS, params)]


def on_rank(tp: TensorParallel, checkpoint: Path, arch: str, expert_size: int | None = None) -> dict:
    """One rank's logits of ``TOKENS`` (bidirectional), the parameters it holds, then rank
    0's engine answers (its forwards broadcast to the other rank) or, on the other rank, how
    many forwards it followed. ``expert_size``: the expert-parallel size."""
    tp = replace(tp, expert_size=expert_size)
    net = load_model(checkpoint, overrides=OVERRIDES[arch], tp=tp)
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    mask = torch.ones(TOKENS.shape[0], 1, TOKENS.shape[1], TOKENS.shape[1], dtype=torch.bool)
    with torch.inference_mode():
        logits = net(TOKENS, positions, DenseAttentionContext(mask))
    experts = [set(layer.mlp.experts) for layer in net.model.layers if hasattr(layer.mlp, "experts")]
    seen = {"logits": logits, "parameters": sum(p.numel() for p in net.parameters()), "experts": experts}
    if tp.rank:
        return seen | {"followed": follow_as_rank(net, config(arch))}
    engine = Engine(net, load_tokenizer(checkpoint), config(arch))
    try:
        return seen | {"answers": answers(engine)}
    finally:
        engine.runner.broadcast.close()


@pytest.mark.parametrize("arch, expert_size", [(arch, None) for arch in sorted(CHECKPOINTS)]
                         + [("LLaDA2MoeModelLM", 1)])  # a slice of every expert on each rank
def test_two_ranks_give_the_logits_and_the_answers_of_one(tmp_path, arch, expert_size):
    checkpoint = write_checkpoint(tmp_path / arch, arch)
    net = load_model(checkpoint, overrides=OVERRIDES[arch])
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    mask = torch.ones(TOKENS.shape[0], 1, TOKENS.shape[1], TOKENS.shape[1], dtype=torch.bool)
    with torch.inference_mode():
        alone = net(TOKENS, positions, DenseAttentionContext(mask))
    whole = sum(p.numel() for p in net.parameters())
    expected = answers(Engine(net, load_tokenizer(checkpoint), config(arch)))

    first, second = on_ranks(2, on_rank, checkpoint, arch, expert_size)
    scale = alone.abs().max()
    for rank in (first, second):  # float32 sums in another order: within 1e-5 of the logits' scale (~1e-6 seen)
        assert (rank["logits"] - alone).abs().max() <= 1e-5 * scale
        # each holds about half: the norms and the router are whole
        assert rank["parameters"] < 0.6 * whole
    assert first["answers"] == expected
    assert second["followed"] >= 2  # at least a forward a block
    if first["experts"]:  # whole experts split between the ranks, or a slice of every expert on each
        assert all(a.isdisjoint(b) if expert_size is None else a == b
                   for a, b in zip(first["experts"], second["experts"], strict=True))


def logits_on_rank(tp: TensorParallel, checkpoint: Path, arch: str, lora: Path) -> torch.Tensor:
    """One rank's logits of ``TOKENS`` with the LoRA adapter ``lora`` merged into its share."""
    net = load_model(checkpoint, overrides=OVERRIDES[arch], tp=tp, lora=lora)
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    mask = torch.ones(TOKENS.shape[0], 1, TOKENS.shape[1], TOKENS.shape[1], dtype=torch.bool)
    with torch.inference_mode():
        return net(TOKENS, positions, DenseAttentionContext(mask))


def test_a_merged_lora_adapter_splits_with_the_weights(tmp_path):
    """Each rank merges its part of the delta (B's rows where the layer splits by rows of its
    output, A's columns where it splits by its input): the logits of the whole merged model."""
    arch = "LLaDAModelLM"
    checkpoint = write_checkpoint(tmp_path / arch, arch)
    weights = checkpoint_weights(checkpoint)
    targets = [f"model.transformer.blocks.{i}.{m}.weight" for i in (0, 1) for m in ("q_proj", "attn_out", "ff_proj", "ff_out")]
    write_adapter(tmp_path / "adapter", {name: weights[name].shape for name in targets})
    alone = logits_on_rank(TensorParallel(0, 1), checkpoint, arch, tmp_path / "adapter")
    plain = load_model(checkpoint, overrides=OVERRIDES[arch])
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    mask = torch.ones(TOKENS.shape[0], 1, TOKENS.shape[1], TOKENS.shape[1], dtype=torch.bool)
    with torch.inference_mode():
        assert (plain(TOKENS, positions, DenseAttentionContext(mask)) - alone).abs().max() > 1e-2  # it matters
    scale = alone.abs().max()
    for logits in on_ranks(2, logits_on_rank, checkpoint, arch, tmp_path / "adapter"):
        assert (logits - alone).abs().max() <= 1e-5 * scale
    check_checkpoint(checkpoint, lora=tmp_path / "adapter", overrides=OVERRIDES[arch], tensor_parallel_size=2)


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
    with pytest.raises(CheckpointError, match="not a mixture of experts: expert_parallel_size applies to MoE"):
        check_checkpoint(checkpoint, overrides=OVERRIDES["SDARForCausalLM"], tensor_parallel_size=2,
                         expert_parallel_size=1)
    moe = write_checkpoint(tmp_path / "moe", "LLaDA2MoeModelLM")
    with pytest.raises(CheckpointError, match=r"the expert-parallel size \(3\) must divide the tensor-parallel"):
        check_checkpoint(moe, overrides=OVERRIDES["LLaDA2MoeModelLM"], tensor_parallel_size=2,
                         expert_parallel_size=3)
    check_checkpoint(moe, overrides=OVERRIDES["LLaDA2MoeModelLM"], tensor_parallel_size=2, expert_parallel_size=1)
