"""Tiny random checkpoints in each published model's on-disk format.

config.json with the published field names and ``architectures``, the parameters under
the published names (written here independently of our implementations' own naming),
two safetensors shards with ``model.safetensors.index.json``, and a character tokenizer
whose mask and EOS tokens have the ids the model uses.
"""

import hashlib
import json
import string
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders

VOCAB, MASK_ID, EOS_ID, PAD_ID = 256, 250, 251, 252
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2
EXPERTS, EXPERT_FFN = 8, 32
# SDAR and LLaDA2.0 configs carry no mask id (the defaults table has the real one)
IDS_OVERRIDE = {"mask_token_id": MASK_ID, "eos_token_id": EOS_ID}


@dataclass(frozen=True)
class Dims:
    """A checkpoint's sizes and special ids; the default is the tiny one the tests use."""

    vocab: int = VOCAB
    hidden: int = HIDDEN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    ffn: int = FFN
    layers: int = LAYERS
    experts: int = EXPERTS
    expert_ffn: int = EXPERT_FFN
    max_positions: int = 512
    mask_id: int = MASK_ID
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID
    weight_scale: float = 0.3  # of the random matrices (large ones want ~0.02: activations stay finite)


TINY = Dims()
# SDAR-1.7B's shape (Qwen3-1.7B's, its ids and 32,768 positions), with ``layers`` to choose
SDAR_1_7B = Dims(vocab=151936, hidden=2048, heads=16, kv_heads=8, head_dim=128, ffn=6144, layers=28,
                 max_positions=32768, mask_id=151669, eos_id=151645, pad_id=151643, weight_scale=0.02)


def llada_checkpoint(d: Dims = TINY) -> tuple[dict, dict]:
    config = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu",
        "block_type": "llama", "layer_norm_type": "rms", "d_model": d.hidden, "n_heads": d.heads,
        "n_kv_heads": d.heads, "n_layers": d.layers, "mlp_hidden_size": d.ffn, "mlp_ratio": 2,
        "vocab_size": d.vocab, "embedding_size": d.vocab, "rope": True, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "max_sequence_length": d.max_positions, "include_bias": False,
        "include_qkv_bias": False, "weight_tying": False, "mask_token_id": d.mask_id,
        "eos_token_id": d.eos_id, "pad_token_id": d.pad_id, "block_group_size": 1,
    }
    shapes = {"model.transformer.wte.weight": (d.vocab, d.hidden), "model.transformer.ln_f.weight": (d.hidden,),
              "model.transformer.ff_out.weight": (d.vocab, d.hidden)}
    for i in range(d.layers):
        block = f"model.transformer.blocks.{i}."
        shapes |= {block + "attn_norm.weight": (d.hidden,), block + "ff_norm.weight": (d.hidden,),
                   block + "attn_out.weight": (d.hidden, d.hidden), block + "ff_proj.weight": (d.ffn, d.hidden),
                   block + "up_proj.weight": (d.ffn, d.hidden), block + "ff_out.weight": (d.hidden, d.ffn)}
        shapes |= {block + f"{p}_proj.weight": (d.hidden, d.hidden) for p in "qkv"}
    return config, shapes


def _qwen_config(d: Dims, arch: str, model_type: str, **extra) -> dict:
    return {"architectures": [arch], "model_type": model_type, "hidden_size": d.hidden,
            "intermediate_size": d.ffn, "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads,
            "num_hidden_layers": d.layers, "vocab_size": d.vocab, "rms_norm_eps": 1e-6,
            "max_position_embeddings": d.max_positions, "hidden_act": "silu", **extra}


def _qwen_layer(d: Dims, i: int, bias: bool, qk_norm: bool) -> dict:
    layer = f"model.layers.{i}."
    shapes = {layer + "input_layernorm.weight": (d.hidden,), layer + "post_attention_layernorm.weight": (d.hidden,),
              layer + "self_attn.q_proj.weight": (d.heads * d.head_dim, d.hidden),
              layer + "self_attn.k_proj.weight": (d.kv_heads * d.head_dim, d.hidden),
              layer + "self_attn.v_proj.weight": (d.kv_heads * d.head_dim, d.hidden),
              layer + "self_attn.o_proj.weight": (d.hidden, d.heads * d.head_dim),
              layer + "mlp.gate_proj.weight": (d.ffn, d.hidden), layer + "mlp.up_proj.weight": (d.ffn, d.hidden),
              layer + "mlp.down_proj.weight": (d.hidden, d.ffn)}
    if bias:
        shapes |= {layer + "self_attn.q_proj.bias": (d.heads * d.head_dim,),
                   layer + "self_attn.k_proj.bias": (d.kv_heads * d.head_dim,),
                   layer + "self_attn.v_proj.bias": (d.kv_heads * d.head_dim,)}
    if qk_norm:
        shapes |= {layer + "self_attn.q_norm.weight": (d.head_dim,), layer + "self_attn.k_norm.weight": (d.head_dim,)}
    return shapes


def dream_checkpoint(d: Dims = TINY) -> tuple[dict, dict]:
    config = _qwen_config(d, "DreamModel", "Dream", rope_theta=1000000.0, tie_word_embeddings=False,
                          mask_token_id=d.mask_id, eos_token_id=d.eos_id, pad_token_id=d.pad_id, bos_token_id=d.eos_id)
    shapes = {"model.embed_tokens.weight": (d.vocab, d.hidden), "model.norm.weight": (d.hidden,),
              "lm_head.weight": (d.vocab, d.hidden)}
    for i in range(d.layers):
        shapes |= _qwen_layer(d, i, bias=True, qk_norm=False)
    return config, shapes


def sdar_checkpoint(d: Dims = TINY) -> tuple[dict, dict]:
    config = _qwen_config(d, "SDARForCausalLM", "sdar", head_dim=d.head_dim, rope_theta=1000000.0,
                          tie_word_embeddings=True, attention_bias=False, eos_token_id=d.eos_id)
    shapes = {"model.embed_tokens.weight": (d.vocab, d.hidden), "model.norm.weight": (d.hidden,)}
    for i in range(d.layers):
        shapes |= _qwen_layer(d, i, bias=False, qk_norm=True)
    return config, shapes



def llada2_checkpoint(d: Dims = TINY) -> tuple[dict, dict]:
    config = _qwen_config(
        d, "LLaDA2MoeModelLM", "llada2_moe", head_dim=d.head_dim, rope_theta=600000.0, tie_word_embeddings=False,
        moe_intermediate_size=d.expert_ffn, num_experts=d.experts, num_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, score_function="sigmoid",
        moe_router_enable_expert_bias=True, first_k_dense_replace=1, partial_rotary_factor=0.5,
        use_qk_norm=True, use_qkv_bias=False, use_bias=False)
    shapes = {"model.word_embeddings.weight": (d.vocab, d.hidden), "model.norm.weight": (d.hidden,),
              "lm_head.weight": (d.vocab, d.hidden)}
    for i in range(d.layers):
        layer = f"model.layers.{i}."
        shapes |= {layer + "input_layernorm.weight": (d.hidden,), layer + "post_attention_layernorm.weight": (d.hidden,),
                   layer + "attention.query_key_value.weight": ((d.heads + 2 * d.kv_heads) * d.head_dim, d.hidden),
                   layer + "attention.dense.weight": (d.hidden, d.heads * d.head_dim),
                   layer + "attention.query_layernorm.weight": (d.head_dim,),
                   layer + "attention.key_layernorm.weight": (d.head_dim,)}
        mlps = [layer + "mlp."] if i == 0 else [layer + f"mlp.experts.{e}." for e in range(d.experts)] + [
            layer + "mlp.shared_experts."]
        ffn = d.ffn if i == 0 else d.expert_ffn
        for mlp in mlps:
            shapes |= {mlp + "gate_proj.weight": (ffn, d.hidden), mlp + "up_proj.weight": (ffn, d.hidden),
                       mlp + "down_proj.weight": (d.hidden, ffn)}
        if i > 0:
            shapes |= {layer + "mlp.gate.weight": (d.experts, d.hidden), layer + "mlp.gate.expert_bias": (d.experts,)}
    return config, shapes


CHECKPOINTS = {"LLaDAModelLM": llada_checkpoint, "DreamModel": dream_checkpoint,
               "SDARForCausalLM": sdar_checkpoint, "LLaDA2MoeModelLM": llada2_checkpoint}
OVERRIDES = {"LLaDAModelLM": {}, "DreamModel": {}, "SDARForCausalLM": IDS_OVERRIDE,
             "LLaDA2MoeModelLM": IDS_OVERRIDE}


def random_tensor(name: str, shape: tuple, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
    """Norm weights about 1, embeddings N(0, 1), other matrices N(0, ``scale``), on the
    generator's device."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=generator, device=generator.device)
    scale = 1.0 if "embed" in name or "wte" in name else scale
    return scale * torch.randn(shape, generator=generator, device=generator.device)


def save_tokenizer(path: Path, d: Dims = TINY) -> None:
    """Printable characters, fillers up to the first special id, <|mask|>, <|endoftext|>,
    <|pad|> at their ids, reserved names for the rest of the vocabulary."""
    chars = list(string.printable[:95])
    special = {"<|mask|>": d.mask_id, "<|endoftext|>": d.eos_id, "<|pad|>": d.pad_id}
    first = min(special.values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab |= {f"<|filler_{i}|>" if i < first else f"<|reserved_{i}|>": i
              for i in range(len(chars), d.vocab) if i not in special.values()}
    vocab |= special
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(special))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "mask_token": "<|mask|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>", "model_max_length": d.max_positions,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: ",
    }))


def write_checkpoint(path: Path, arch: str, seed: int = 0, dims: Dims = TINY,
                     dtype: torch.dtype = torch.float32, device: str = "cpu") -> Path:
    """A random checkpoint of ``arch`` with ``dims``, its tensors stored in ``dtype`` (drawn
    on ``device``: a GPU draws a billion in a moment)."""
    config, shapes = CHECKPOINTS[arch](dims)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator(device).manual_seed(seed)
    tensors = {name: random_tensor(name, shape, generator, dims.weight_scale).to(dtype).cpu()
               for name, shape in shapes.items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(path / shard))
        weight_map |= {n: shard for n in members}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    save_tokenizer(path, dims)
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
