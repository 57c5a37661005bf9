import pytest
import torch

from replicas.engine import Engine, EngineConfig
from replicas.models.tiny import TinyDllmConfig, TinyDllmForBlockDiffusion
from replicas.tiny.tokenizer import save_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.fixture(scope="session")
def random_model(tokenizer):
    """An untrained tiny model: fast, deterministic, exercises every engine path."""
    torch.manual_seed(0)
    config = TinyDllmConfig(
        vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=256)
    return TinyDllmForBlockDiffusion(config).eval()


@pytest.fixture
def make_engine(random_model, tokenizer):
    def make(**overrides) -> Engine:
        return Engine(random_model, tokenizer, EngineConfig(**overrides))
    return make
