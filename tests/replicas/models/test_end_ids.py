"""Every id that ends an answer: the defaults table's, config.json's and
generation_config.json's, or the user's; an answer ends at the first of them."""

import json
import shutil
import types

import pytest

from checkpoint_builders import EOS_ID, OVERRIDES
from replicas.engine import Engine, EngineConfig
from replicas.models import CheckpointError, load_model_spec
from replicas.models.defaults import default_spec
from replicas.request import FinishReason
from replicas.messages import SamplingParams

FULL_VOCAB = types.SimpleNamespace(vocab_size=160_000, num_layers=1, num_kv_heads=1, head_dim=8, max_positions=4096)


@pytest.mark.parametrize("arch,config_eos,expected", [
    # LLaDA-8B-Instruct: <|eot_id|> ends the answer, <|endoftext|> pads the rest
    ("LLaDAModelLM", 126081, {126081, 126348}),
    # Dream and SDAR (Qwen tokenizers): <|im_end|> and <|endoftext|>, whichever config.json names first
    ("DreamModel", 151643, {151643, 151645}),
    ("SDARForCausalLM", 151645, {151645, 151643}),
    ("LLaDA2MoeModelLM", None, {156892}),
    # config.json may list several
    ("LLaDA2MoeModelLM", [156892, 156900], {156892, 156900}),
])
def test_each_architecture_ends_answers_at_its_published_ids(arch, config_eos, expected):
    spec = default_spec(arch, types.SimpleNamespace(eos_token_id=config_eos), FULL_VOCAB)
    assert spec.end_token_ids == expected
    assert spec.eos_token_id == (config_eos[0] if isinstance(config_eos, list) else config_eos or min(expected))


def test_table_ids_outside_a_small_vocabulary_are_left_out(checkpoint_dir):
    assert load_model_spec(checkpoint_dir("LLaDAModelLM")).end_token_ids == {EOS_ID}


def test_generation_config_adds_its_ids_and_overrides_replace_them(checkpoint_dir, tmp_path):
    path = shutil.copytree(checkpoint_dir("DreamModel"), tmp_path / "dream")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, 3, 4, 999_999]}))
    assert load_model_spec(path).end_token_ids == {EOS_ID, 3, 4}
    assert load_model_spec(path, {"stop_token_ids": [7]}).end_token_ids == {EOS_ID, 7}
    with pytest.raises(CheckpointError, match="stop_token_ids \\[999999\\] are outside the vocabulary"):
        load_model_spec(path, {"stop_token_ids": [999_999]})
    with pytest.raises(CheckpointError, match="must be a list of token ids"):
        load_model_spec(path, {"stop_token_ids": "3"})
    (path / "generation_config.json").write_text("[")
    with pytest.raises(CheckpointError, match="generation_config.json is not a valid JSON object"):
        load_model_spec(path)


@pytest.mark.parametrize("arch", ["LLaDAModelLM", "SDARForCausalLM"])
def test_an_answer_ends_before_the_first_end_id_and_never_returns_it(checkpoint_dir, arch):
    """The random model's own output, with ignore_eos, names a token of its 3rd block; made a
    stop id, the same request ends just before that token's first occurrence, finish stop."""
    path = str(checkpoint_dir(arch))
    engine = Engine.from_pretrained(path, EngineConfig(max_batch=1, model_overrides=OVERRIDES[arch]))
    size = engine.block_length
    params = SamplingParams(max_tokens=4 * size, ignore_eos=True)
    free_run = engine.generate(["Tell me a story."], params)[0].token_ids
    stop = next(t for t in free_run[2 * size:] if t != EOS_ID)
    overrides = {**OVERRIDES[arch], "stop_token_ids": [stop]}
    engine = Engine.from_pretrained(path, EngineConfig(max_batch=1, model_overrides=overrides))
    output = engine.generate(["Tell me a story."], SamplingParams(max_tokens=4 * size))[0]
    ends = [i for i, t in enumerate(free_run) if t in (stop, EOS_ID)]
    assert output.token_ids == free_run[:ends[0]]
    assert output.finish_reason == FinishReason.STOP and stop not in output.token_ids
