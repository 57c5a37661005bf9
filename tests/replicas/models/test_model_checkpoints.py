"""Each published architecture, as a tiny random checkpoint in its on-disk format, loads
through the public path and generates through the engine in every scheduler mode."""

import json
import shutil

import pytest

from checkpoint_builders import CHECKPOINTS, EOS_ID, MASK_ID, OVERRIDES
from replicas.engine import Engine, EngineConfig
from replicas.models import CheckpointError, load_model_spec, load_tokenizer
from replicas.messages import SamplingParams
from replicas.batching import SchedulerMode

PROMPTS = ["What is 2+2?", "Tell me a story about a cat.", "x"]


@pytest.mark.parametrize("arch", CHECKPOINTS)
def test_modes_are_identical_at_batch_1(checkpoint_dir, arch):
    path = checkpoint_dir(arch)
    outputs = {}
    for mode in SchedulerMode:
        engine = Engine.from_pretrained(str(path), EngineConfig(mode=mode.value, max_batch=1,
                                                                model_overrides=OVERRIDES[arch]))
        params = SamplingParams(max_tokens=2 * engine.block_length, ignore_eos=True)
        outputs[mode] = [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert all(len(ids) == 2 * engine.block_length for ids in outputs[SchedulerMode.FDFO])
    assert all(outputs[mode] == outputs[SchedulerMode.FDFO] for mode in SchedulerMode)


@pytest.mark.parametrize("arch", ["LLaDAModelLM", "DreamModel"])
def test_bidirectional_models_without_cache_at_batch_4(checkpoint_dir, arch):
    engine = Engine.from_pretrained(str(checkpoint_dir(arch)), EngineConfig(max_batch=4, kv_cache="none"))
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=64, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [64] * len(PROMPTS)


@pytest.mark.parametrize("arch", CHECKPOINTS)
def test_spec_comes_from_the_defaults_table_and_the_config(checkpoint_dir, arch):
    spec = load_model_spec(checkpoint_dir(arch), OVERRIDES[arch])
    expected = {"LLaDAModelLM": (32, "bidirectional", False), "DreamModel": (32, "bidirectional", True),
                "SDARForCausalLM": (4, "block_causal", False), "LLaDA2MoeModelLM": (32, "block_causal", False)}
    assert (spec.block_length, spec.attention, spec.shift_logits) == expected[arch]
    assert (spec.mask_token_id, spec.eos_token_id) == (MASK_ID, EOS_ID)
    tokenizer = load_tokenizer(checkpoint_dir(arch))
    assert tokenizer.mask_token_id == MASK_ID and tokenizer.eos_token_id == EOS_ID


def test_overrides_make_llada_block_causal_with_another_block_length(checkpoint_dir):
    spec = load_model_spec(checkpoint_dir("LLaDAModelLM"), {"attention": "block_causal", "block_length": 8})
    assert (spec.attention, spec.block_length) == ("block_causal", 8)


def test_table_ids_outside_a_small_vocabulary_are_a_clear_error(checkpoint_dir):
    with pytest.raises(CheckpointError, match="mask_token_id 151669 is outside the vocabulary"):
        load_model_spec(checkpoint_dir("SDARForCausalLM"))


def test_missing_shard_unknown_architecture_and_missing_tokenizer(checkpoint_dir, tmp_path):
    broken = shutil.copytree(checkpoint_dir("DreamModel"), tmp_path / "dream")
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        Engine.from_pretrained(str(broken))
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["MysteryLM"]}))
    with pytest.raises(CheckpointError, match="MysteryLM"):
        load_model_spec(broken)
    no_tokenizer = shutil.copytree(checkpoint_dir("LLaDAModelLM"), tmp_path / "llada")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_tokenizer(no_tokenizer)
