"""A few-second training run writes a checkpoint that serving loads."""

from replicas.models.checkpoint import load_model, load_tokenizer
from tools.tiny_training.train import TrainConfig, train_tiny


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
