"""A chat's prompt ids are what the model's own chat template gives: the template's special
tokens (turn markers) are tokens, not their characters; a completion's text keeps a
special token's look-alike as text. OpenAI's roles and text parts reach the template as
the served models' templates take them."""

import asyncio
import json

from replicas.messages import GenerateChunk
from replicas.models import load_tokenizer
from test_ingress_path import answer
from test_input_bounds import ingress_over
from tests.replicas.models.checkpoint_builders import EOS_ID, write_checkpoint

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}assistant: "
# like Qwen's (Dream, SDAR): a role it does not know renders nothing
SYSTEM_USER_ASSISTANT = ("{% for m in messages %}{% if m['role'] in ('system', 'user', 'assistant') %}"
                         "{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}assistant: ")


def checkpoint_ingress(tmp_path, template: str):
    """An ingress of a random LLaDA checkpoint whose chat template is ``template``, the
    checkpoint's path, and the prompt ids its replicas are sent."""
    path = write_checkpoint(tmp_path / "llada", "LLaDAModelLM")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    sent = []

    async def generate(job):
        sent.append(job.prompt_ids)
        yield GenerateChunk(text="x", token_ids=[5], finished=True, finish_reason="stop", completion_tokens=1)

    plain, instance = ingress_over(generate, model=str(path))
    return plain, instance, path, sent


def template_ids(path, messages) -> list[int]:
    """The ids the checkpoint's own ``apply_chat_template`` gives ``messages``."""
    ids = load_tokenizer(str(path)).apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in newer transformers


def chat(plain, instance, messages) -> None:
    response = asyncio.run(answer(plain, instance, {"model": "llada", "messages": messages},
                                  path="/v1/chat/completions"))
    assert response.status_code == 200, response.body


def test_the_chat_templates_special_tokens_are_tokens(tmp_path):
    plain, instance, path, sent = checkpoint_ingress(tmp_path, TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    chat(plain, instance, messages)
    assert sent[-1] == template_ids(path, messages) and EOS_ID in sent[-1]
    response = asyncio.run(answer(plain, instance, {"model": "llada", "prompt": "hi<|endoftext|>", "max_tokens": 4}))
    assert response.status_code == 200, response.body
    assert EOS_ID not in sent[-1]  # a completion's look-alike stays characters


def test_developer_messages_are_system_ones_and_text_parts_are_lines(tmp_path):
    plain, instance, path, sent = checkpoint_ingress(tmp_path, SYSTEM_USER_ASSISTANT)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    chat(plain, instance, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}])
    assert sent[-1] == template_ids(path, [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hello\nworld"}])
