"""Tiny random checkpoints in each published model's on-disk format.

config.json with the published field names and ``architectures``, the parameters under
the published names (written here independently of our implementations' own naming),
two safetensors shards with ``model.safetensors.index.json``, and a character tokenizer
whose mask and EOS tokens have the ids the model uses.
"""

import hashlib
import json
import string
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders

VOCAB, MASK_ID, EOS_ID, PAD_ID = 256, 250, 251, 252
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2
# SDAR and LLaDA2.0 configs carry no mask id (the defaults table has the real one)
IDS_OVERRIDE = {"mask_token_id": MASK_ID, "eos_token_id": EOS_ID}


def llada_checkpoint() -> tuple[dict, dict]:
    config = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu",
        "block_type": "llama", "layer_norm_type": "rms", "d_model": HIDDEN, "n_heads": HEADS,
        "n_kv_heads": HEADS, "n_layers": LAYERS, "mlp_hidden_size": FFN, "mlp_ratio": 2,
        "vocab_size": VOCAB, "embedding_size": VOCAB, "rope": True, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "max_sequence_length": 512, "include_bias": False,
        "include_qkv_bias": False, "weight_tying": False, "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "block_group_size": 1,
    }
    shapes = {"model.transformer.wte.weight": (VOCAB, HIDDEN), "model.transformer.ln_f.weight": (HIDDEN,),
              "model.transformer.ff_out.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        block = f"model.transformer.blocks.{i}."
        shapes |= {block + "attn_norm.weight": (HIDDEN,), block + "ff_norm.weight": (HIDDEN,),
                   block + "attn_out.weight": (HIDDEN, HIDDEN), block + "ff_proj.weight": (FFN, HIDDEN),
                   block + "up_proj.weight": (FFN, HIDDEN), block + "ff_out.weight": (HIDDEN, FFN)}
        shapes |= {block + f"{p}_proj.weight": (HIDDEN, HIDDEN) for p in "qkv"}
    return config, shapes


def _qwen_config(arch: str, model_type: str, **extra) -> dict:
    return {"architectures": [arch], "model_type": model_type, "hidden_size": HIDDEN,
            "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 512, "hidden_act": "silu", **extra}


def _qwen_layer(i: int, bias: bool, qk_norm: bool) -> dict:
    layer = f"model.layers.{i}."
    shapes = {layer + "input_layernorm.weight": (HIDDEN,), layer + "post_attention_layernorm.weight": (HIDDEN,),
              layer + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
              layer + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
              layer + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
              layer + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
              layer + "mlp.gate_proj.weight": (FFN, HIDDEN), layer + "mlp.up_proj.weight": (FFN, HIDDEN),
              layer + "mlp.down_proj.weight": (HIDDEN, FFN)}
    if bias:
        shapes |= {layer + "self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
                   layer + "self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
                   layer + "self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,)}
    if qk_norm:
        shapes |= {layer + "self_attn.q_norm.weight": (HEAD_DIM,), layer + "self_attn.k_norm.weight": (HEAD_DIM,)}
    return shapes


def dream_checkpoint() -> tuple[dict, dict]:
    config = _qwen_config("DreamModel", "Dream", rope_theta=1000000.0, tie_word_embeddings=False,
                          mask_token_id=MASK_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=EOS_ID)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes |= _qwen_layer(i, bias=True, qk_norm=False)
    return config, shapes


def sdar_checkpoint() -> tuple[dict, dict]:
    config = _qwen_config("SDARForCausalLM", "sdar", head_dim=HEAD_DIM, rope_theta=1000000.0,
                          tie_word_embeddings=True, attention_bias=False, eos_token_id=EOS_ID)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= _qwen_layer(i, bias=False, qk_norm=True)
    return config, shapes


EXPERTS, EXPERT_FFN = 8, 32


def llada2_checkpoint() -> tuple[dict, dict]:
    config = _qwen_config(
        "LLaDA2MoeModelLM", "llada2_moe", head_dim=HEAD_DIM, rope_theta=600000.0, tie_word_embeddings=False,
        moe_intermediate_size=EXPERT_FFN, num_experts=EXPERTS, num_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, score_function="sigmoid",
        moe_router_enable_expert_bias=True, first_k_dense_replace=1, partial_rotary_factor=0.5,
        use_qk_norm=True, use_qkv_bias=False, use_bias=False)
    shapes = {"model.word_embeddings.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        shapes |= {layer + "input_layernorm.weight": (HIDDEN,), layer + "post_attention_layernorm.weight": (HIDDEN,),
                   layer + "attention.query_key_value.weight": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
                   layer + "attention.dense.weight": (HIDDEN, HEADS * HEAD_DIM),
                   layer + "attention.query_layernorm.weight": (HEAD_DIM,),
                   layer + "attention.key_layernorm.weight": (HEAD_DIM,)}
        mlps = [layer + "mlp."] if i == 0 else [layer + f"mlp.experts.{e}." for e in range(EXPERTS)] + [
            layer + "mlp.shared_experts."]
        ffn = FFN if i == 0 else EXPERT_FFN
        for mlp in mlps:
            shapes |= {mlp + "gate_proj.weight": (ffn, HIDDEN), mlp + "up_proj.weight": (ffn, HIDDEN),
                       mlp + "down_proj.weight": (HIDDEN, ffn)}
        if i > 0:
            shapes |= {layer + "mlp.gate.weight": (EXPERTS, HIDDEN), layer + "mlp.gate.expert_bias": (EXPERTS,)}
    return config, shapes


CHECKPOINTS = {"LLaDAModelLM": llada_checkpoint, "DreamModel": dream_checkpoint,
               "SDARForCausalLM": sdar_checkpoint, "LLaDA2MoeModelLM": llada2_checkpoint}
OVERRIDES = {"LLaDAModelLM": {}, "DreamModel": {}, "SDARForCausalLM": IDS_OVERRIDE,
             "LLaDA2MoeModelLM": IDS_OVERRIDE}


def random_tensor(name: str, shape: tuple, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    scale = 1.0 if "embed" in name or "wte" in name else 0.3
    return scale * torch.randn(shape, generator=generator)


def save_tokenizer(path: Path) -> None:
    """Printable characters, fillers up to the mask id, then <|mask|>, <|endoftext|>, <|pad|>."""
    chars = list(string.printable[:95])
    vocab = {c: i for i, c in enumerate(chars)}
    vocab |= {f"<|filler_{i}|>": i for i in range(len(chars), MASK_ID)}
    special = {"<|mask|>": MASK_ID, "<|endoftext|>": EOS_ID, "<|pad|>": PAD_ID}
    vocab |= special | {f"<|reserved_{i}|>": i for i in range(PAD_ID + 1, VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(special))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "mask_token": "<|mask|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>", "model_max_length": 512,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: ",
    }))


def write_checkpoint(path: Path, arch: str, seed: int = 0) -> Path:
    config, shapes = CHECKPOINTS[arch]()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: random_tensor(name, shape, generator) for name, shape in shapes.items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(path / shard))
        weight_map |= {n: shard for n in members}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    save_tokenizer(path)
    return path


def weights_sha256(path: Path) -> str:
    """sha256 over a checkpoint's tensors sorted by name: the utf-8 name, a NUL byte, then
    the float32 little-endian bytes (what the parity fixtures record)."""
    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors |= load_file(str(shard))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + b"\0")
        digest.update(tensors[name].contiguous().numpy().astype("<f4", copy=False).tobytes())
    return digest.hexdigest()
