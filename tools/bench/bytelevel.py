"""A random-weight checkpoint whose tokenizer is a byte-level BPE (GPT-2's and Qwen's kind),
trained here on generated JSON and words, for the bench and the tests of constrained answers."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from replicas.models.checkpoint import save_model
from replicas.models.llada import LLaDAConfig, LLaDAModelLM
from replicas.models.sdar import SDARForCausalLM
from replicas.models.transformer import QwenStyleConfig

EOS, MASK = "<|endoftext|>", "<|mask|>"  # ids 0 and 1
WORDS = ("the of and to in is that for it as with was on be by at this have from or one name age city email "
         "true false null user id items tags price status active count value type title 中文 emoji 🙂").split()


def _value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth > 2 or kind < 0.4:
        return rng.choice([rng.randint(-999, 99999), round(rng.uniform(-50, 50), 2), True, False, None,
                           " ".join(rng.choices(WORDS, k=rng.randint(1, 3)))])
    if kind < 0.7:
        return {rng.choice(WORDS): _value(rng, depth + 1) for _ in range(rng.randint(1, 3))}
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def corpus(lines: int = 1500, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(lines):
        yield " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))
        yield json.dumps(_value(rng), ensure_ascii=False, separators=rng.choice([(",", ":"), (", ", ": ")]))


def bytelevel_tokenizer(vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` ids: the end of text and the mask first, all 256
    bytes, then merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, MASK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, mask_token=MASK)


def random_model(tokenizer, architecture: str = "sdar", block_length: int = 8, seed: int = 0, hidden: int = 64,
                 layers: int = 2):
    """Random weights of an SDAR (blocks) or LLaDA (full canvas) over ``tokenizer``'s ids,
    small by default (heads of 16)."""
    import torch

    from replicas.models.defaults import apply_overrides

    torch.manual_seed(seed)
    vocab = len(tokenizer)
    eos, mask = tokenizer.convert_tokens_to_ids([EOS, MASK])
    if architecture == "sdar":
        config = QwenStyleConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=layers, num_attention_heads=hidden // 16,
                                 num_key_value_heads=hidden // 32, max_position_embeddings=2048,
                                 tie_word_embeddings=True, mask_token_id=mask, eos_token_id=eos,
                                 architectures=("SDARForCausalLM",), model_type="sdar")
        net = SDARForCausalLM(config).eval()
        net.spec = apply_overrides(net.spec, {"block_length": block_length})
    else:
        config = LLaDAConfig(d_model=hidden, n_heads=hidden // 16, n_layers=layers, mlp_hidden_size=2 * hidden,
                             vocab_size=vocab,
                             max_sequence_length=2048, mask_token_id=mask, eos_token_id=eos)
        net = LLaDAModelLM(config).eval()
    return net


def save_checkpoint(path: Path, architecture: str = "sdar") -> Path:
    """A checkpoint directory (weights, config, tokenizer) that ``dllm-serve up --model`` serves."""
    tokenizer = bytelevel_tokenizer()
    save_model(random_model(tokenizer, architecture), path)
    tokenizer.save_pretrained(str(path))
    return path
