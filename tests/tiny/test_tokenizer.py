"""The character tokenizer through transformers.AutoTokenizer."""

import pytest
from transformers import AutoTokenizer

from replicas.tiny import task
from replicas.tiny.tokenizer import save_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def test_special_tokens(tokenizer):
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["[PAD]", "[BOS]", "[EOS]", "[MASK]", "[UNK]"]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id) == (0, 2, 3)


def test_prompt_is_112_tokens_without_bos(tokenizer):
    for request in task.make_requests(20, seed=0):
        ids = tokenizer(request.prompt)["input_ids"]
        assert len(ids) == 112
        assert tokenizer.decode(ids) == "".join(request.prompt.split())


def test_whitespace_is_ignored_and_decode_inserts_no_spaces(tokenizer):
    ids = tokenizer("1.3. ..2.\n4...", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "1.3...2.4..."
    eos = tokenizer.eos_token_id
    assert tokenizer.decode(ids + [eos, eos], skip_special_tokens=True) == "1.3...2.4..."
    assert tokenizer.decode(tokenizer("Hi, there!")["input_ids"]) == "Hi,there!"


def test_unknown_characters_map_to_unk(tokenizer):
    assert tokenizer("é")["input_ids"] == [tokenizer.unk_token_id]


def test_chat_template_renders_the_last_user_message(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "1.3. ----"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "1.3. ----"
