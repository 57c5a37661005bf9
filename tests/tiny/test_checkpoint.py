"""The shipped checkpoint loads, and a few-second training run writes a loadable one."""

import torch

from replicas.attention import DenseAttentionContext
from replicas.models.checkpoint import load_model, load_tokenizer
from replicas.tiny import task
from replicas.tiny.train import TrainConfig, train_tiny


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


def test_short_training_run_writes_a_loadable_checkpoint(tmp_path):
    config = TrainConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64, batch_size=4)
    metrics = train_tiny(tmp_path, max_minutes=0.03, config=config, final_eval=False, log=lambda _: None)
    assert metrics["steps"] >= 1
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in tmp_path.iterdir()
    }
    net = load_model(tmp_path)
    assert net.config.hidden_size == 32
    assert load_tokenizer(tmp_path).mask_token_id == net.config.mask_token_id
