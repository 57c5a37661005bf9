"""The pre-norm decoder stack that LLaDA, Dream, SDAR and LLaDA2.0 share.

The four architectures differ in their config field names, parameter names, QKV bias,
QK-norm, fused QKV, partial rotary and their MLP (dense SwiGLU or a mixture of experts);
everything else is this one stack. Parameters carry Qwen-style names
(``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ``lm_head`` ...); each
architecture maps its checkpoint's own names onto these (``checkpoint_renames``).

Attention goes through ``context.attend`` (replicas.attention), so which tokens a query
sees (block-causal or bidirectional, cached or not) is decided by the runner.

Built with a ``TensorParallel`` of size N (``replicas.models.parallel``), the stack is one
rank's share: its heads, its slice of each MLP and of the vocabulary, added up across the
ranks after each attention block and MLP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replicas.models.layers import RMSNorm, RotaryEmbedding, Rotation, SwiGLU
from replicas.models.parallel import SINGLE, TensorParallel
from replicas.models.spec import ConfigFields
from replicas.models.defaults import default_spec


@dataclass(frozen=True)
class DecoderShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's q and k before rotary (Qwen3, Ling)
    fused_qkv: bool = False  # one qkv_proj: rows [q heads | k heads | v heads]
    rotary_dim: int | None = None  # partial rotary; None = the whole head
    tie_word_embeddings: bool = False

    def on_rank(self, tp: TensorParallel) -> "DecoderShape":
        """The share of one tensor-parallel rank: its heads and its slice of the MLP (the
        vocabulary stays whole here: ``VocabParallelEmbedding`` and the head split it)."""
        if tp.size == 1:
            return self
        return dataclasses.replace(self, num_heads=tp.split(self.num_heads, "the attention heads"),
                                   num_kv_heads=tp.split(self.num_kv_heads, "the KV heads"),
                                   intermediate_size=tp.split(self.intermediate_size, "the MLP's width"))


class VocabParallelEmbedding(nn.Embedding):
    """One rank's rows of the embedding: it looks up the ids in its share of the
    vocabulary, zeros for the others, and the ranks' all-reduce completes every row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__(tp.split(vocab_size, "the vocabulary"), hidden_size)
        self.tp = tp
        self.start = tp.rank * self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


class Attention(nn.Module):
    def __init__(self, shape: DecoderShape, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        hidden, q_out, kv_out = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        if shape.fused_qkv:
            self.qkv_proj = nn.Linear(hidden, q_out + 2 * kv_out, bias=shape.qkv_bias)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=shape.qkv_bias)
            self.k_proj = nn.Linear(hidden, kv_out, bias=shape.qkv_bias)
            self.v_proj = nn.Linear(hidden, kv_out, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(q_out, hidden, bias=False)
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
            self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if hasattr(self, "qkv_proj"):
            q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
            return self.qkv_proj(x).split([q_out, kv_out, kv_out], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, rotation: Rotation, context) -> torch.Tensor:
        q, k, v = self.project(x)
        return self._attend(q, k, v, rotation, rotation, context)

    def forward_kept(self, x: torch.Tensor, keep: torch.Tensor, rotation: Rotation, context,
                     on_keep: Callable[[], None]) -> torch.Tensor:
        """The outputs of the packed tokens ``keep`` only: every token's K and V (written,
        and attended to), the kept tokens' queries. ``on_keep`` runs once the K and V are
        projected (from there on, the layer's projections see the kept tokens only)."""
        if hasattr(self, "qkv_proj"):  # one projection: the queries are computed for every token
            q, k, v = self.project(x)
            on_keep()
            q = q[keep]
        else:
            k, v = self.k_proj(x), self.v_proj(x)
            on_keep()
            q = self.q_proj(x[keep])
        return self._attend(q, k, v, rotation.select(keep), rotation, context, kept_queries=True)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rotation: Rotation,
                k_rotation: Rotation, context, kept_queries: bool = False) -> torch.Tensor:
        """Heads, QK-norm, rotary, attention and the output projection of projected q, k, v."""
        q = q.unflatten(-1, (self.heads, self.head_dim))
        k = k.unflatten(-1, (self.kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.kv_heads, self.head_dim))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q_rotation.rotate(q), k_rotation.rotate(k)
        if kept_queries:
            out = context.attend(self.layer_index, q, k, v, kept_queries=True)
        else:
            out = context.attend(self.layer_index, q, k, v)
        return self.o_proj(out.flatten(-2))


class DecoderLayer(nn.Module):
    adapters = None  # an ``AdapterBank`` where unmerged adapters are served (``replicas.adapters``)

    def __init__(self, shape: DecoderShape, layer_index: int, mlp: nn.Module, tp: TensorParallel = SINGLE):
        """``shape``: this rank's (``DecoderShape.on_rank``)."""
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape, layer_index)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = mlp
        self.tp = tp

    def forward(self, x: torch.Tensor, rotation: Rotation, context,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep``: the packed tokens whose outputs go on (the last layer's: those whose
        logits are read); every token's K and V are still computed and written. Where the
        context can (``narrows_queries``) only the kept tokens' queries attend, else every
        token's do and the kept ones go on to the MLP. Without autograd the residual adds go
        into ``x``'s memory (one activation less to allocate a layer)."""
        add = torch.add if torch.is_grad_enabled() else torch.Tensor.add_
        if keep is not None and context.narrows_queries:
            attended = self.self_attn.forward_kept(self.input_layernorm(x), keep, rotation, context, self._keep)
            x = add(x[keep], self.tp.all_reduce(attended))
        else:
            x = add(x, self.tp.all_reduce(self.self_attn(self.input_layernorm(x), rotation, context)))
            if keep is not None:
                x = x[keep]
                self._keep()
        return add(x, self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x))))

    def _keep(self) -> None:
        if self.adapters is not None:
            self.adapters.keep()


class DecoderBody(nn.Module):
    def __init__(self, shape: DecoderShape, make_mlp: Callable[[int], nn.Module], tp: TensorParallel = SINGLE):
        super().__init__()
        self.rotary = RotaryEmbedding(shape.head_dim, shape.rope_theta, shape.rotary_dim)
        self.embed_tokens = (nn.Embedding(shape.vocab_size, shape.hidden_size) if tp.size == 1
                             else VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, tp))
        local = shape.on_rank(tp)
        self.layers = nn.ModuleList(
            DecoderLayer(local, i, make_mlp(i), tp) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class DecoderLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head; subclasses say how to build it
    from their config.json (``config_class``) and how their parameter names map here."""

    config_class: type
    # (checkpoint name pattern, our name) regex pairs, applied in order by the loader
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config, shape: DecoderShape, make_mlp: Callable[[int], nn.Module] | None = None,
                 tp: TensorParallel = SINGLE):
        """``shape``: the whole model's; ``make_mlp(layer)``: this rank's MLP of that layer
        (default: its share of a dense SwiGLU)."""
        super().__init__()
        self.config = config
        self.shape = shape
        self.tp = tp
        local = shape.on_rank(tp)
        self.spec = default_spec(type(self).__name__, config, local)  # its KV heads: this rank's
        self.model = DecoderBody(shape, make_mlp or (lambda i: SwiGLU(shape.hidden_size, local.intermediate_size)),
                                 tp)
        if not shape.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, tp.split(shape.vocab_size, "the vocabulary"), bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``input_ids`` (``[T]`` packed or ``[B, S]`` dense); ``logits_index``
        selects the packed tokens whose logits are needed: the last layer's MLP runs on
        those alone (a refreshed canvas or a prompt chunk feeds many more tokens than the
        step reads)."""
        x = self.model.embed_tokens(input_ids)
        rotation = self.model.rotary(positions, x.dtype)
        *layers, last = self.model.layers
        for layer in layers:
            x = layer(x, rotation, context)
        x = last(x, rotation, context, keep=logits_index)
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.shape.tie_word_embeddings else self.lm_head.weight
        return self.tp.gather_last(x @ head.T)


@dataclass
class QwenStyleConfig(ConfigFields):
    """The config.json fields of the Qwen/Llama family (Dream, SDAR; LLaDA2.0 adds its own)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mask_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    architectures: tuple[str, ...] = ()
    model_type: str = ""

    def decoder_shape(self, **extra) -> DecoderShape:
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        values = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads, num_kv_heads=self.num_key_value_heads or self.num_attention_heads,
            head_dim=head_dim, intermediate_size=self.intermediate_size, rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps, max_positions=self.max_position_embeddings,
            qkv_bias=self.attention_bias, tie_word_embeddings=self.tie_word_embeddings)
        return DecoderShape(**{**values, **extra})
