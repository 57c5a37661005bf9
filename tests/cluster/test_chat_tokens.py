"""A chat's prompt ids are what the model's own chat template gives: the template's special
tokens (turn markers) are tokens, not their characters; a completion's text keeps a
special token's look-alike as text."""

import asyncio
import json

from replicas.messages import GenerateChunk
from replicas.models import load_tokenizer
from test_ingress_path import answer
from test_input_bounds import ingress_over
from tests.replicas.models.checkpoint_builders import EOS_ID, write_checkpoint

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}assistant: "


def test_the_chat_templates_special_tokens_are_tokens(tmp_path):
    path = write_checkpoint(tmp_path / "llada", "LLaDAModelLM")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    sent = []

    async def generate(job):
        sent.append(job.prompt_ids)
        yield GenerateChunk(text="x", token_ids=[5], finished=True, finish_reason="stop", completion_tokens=1)

    plain, instance = ingress_over(generate, model=str(path))
    messages = [{"role": "user", "content": "hi"}]
    response = asyncio.run(answer(plain, instance, {"model": "llada", "messages": messages},
                                  path="/v1/chat/completions"))
    assert response.status_code == 200, response.body
    expected = load_tokenizer(str(path)).apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected  # a BatchEncoding in newer transformers
    assert sent[-1] == list(expected) and EOS_ID in sent[-1]
    response = asyncio.run(answer(plain, instance, {"model": "llada", "prompt": "hi<|endoftext|>", "max_tokens": 4}))
    assert response.status_code == 200, response.body
    assert EOS_ID not in sent[-1]  # a completion's look-alike stays characters
