"""The shipped checkpoint loads."""

import torch

from replicas.attention import DenseAttentionContext
from replicas.models.checkpoint import load_model, load_tokenizer
from replicas.tiny import task


def test_shipped_checkpoint_loads():
    net = load_model("tiny")
    tokenizer = load_tokenizer("tiny")
    assert net.config.block_length == 16
    assert net.config.eos_token_id == tokenizer.eos_token_id
    assert net.config.mask_token_id == tokenizer.mask_token_id
    assert net.config.vocab_size == len(tokenizer)
    ids = torch.tensor([tokenizer(task.heldout_requests()[0].prompt)["input_ids"]])
    page = torch.arange(112) // 16
    mask = (page[:, None] >= page[None, :])[None, None]
    with torch.no_grad():
        logits = net(ids, torch.arange(112)[None], DenseAttentionContext(mask))
    assert logits.shape == (1, 112, net.config.vocab_size)
