"""LLaDA2.0 (``LLaDA2MoeModelLM``: LLaDA2.0-mini), a Ling/Bailing-MoE backbone.

Block-causal attention (exact KV cache) with a fused ``query_key_value`` projection,
per-head q/k RMSNorm (``use_qk_norm``) and partial rotary (``partial_rotary_factor``: the
first fraction of each head turns, the rest passes). The first ``first_k_dense_replace``
layers have a dense SwiGLU; the others a mixture of experts:

* router: sigmoid scores of ``mlp.gate.weight``; ``mlp.gate.expert_bias`` is added for
  the choice only. Experts come in ``n_group`` groups; a group scores the sum of its two
  best biased scores, the ``topk_group`` best groups stay, and the ``num_experts_per_tok``
  best experts among them are picked.
* weights: the unbiased scores of the picked experts, renormalized to sum 1
  (``norm_topk_prob``), times ``routed_scaling_factor``.
* plus ``num_shared_experts`` always-on shared experts (one SwiGLU).

Under tensor parallelism each rank holds its run of whole routed experts (expert
parallelism) and its slice of the shared experts and of the dense layers
(``replicas.models.parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from replicas.models.layers import SwiGLU
from replicas.models.parallel import SINGLE, TensorParallel, expert_width, local_experts
from replicas.models.transformer import DecoderLM, QwenStyleConfig

_LAYER = r"^model\.layers\.(\d+)\.attention\."


@dataclass
class LLaDA2MoeConfig(QwenStyleConfig):
    moe_intermediate_size: int = 512
    num_experts: int = 256
    num_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    moe_router_enable_expert_bias: bool = True
    score_function: str = "sigmoid"
    first_k_dense_replace: int = 1
    partial_rotary_factor: float = 1.0
    use_qk_norm: bool = True
    use_qkv_bias: bool = False
    moe_shared_expert_intermediate_size: int | None = None


class MoEGate(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids ``[N, k]`` and their weights ``[N, k]`` for tokens ``x[N, hidden]``."""
        c = self.config
        scores = torch.sigmoid(x.float() @ self.weight.float().T)
        biased = scores + self.expert_bias.float() if hasattr(self, "expert_bias") else scores
        if c.n_group > 1:
            grouped = biased.view(-1, c.n_group, c.num_experts // c.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, True)
            biased = grouped.masked_fill(~keep[..., None], 0.0).view(-1, c.num_experts)
        experts = biased.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, experts)
        if c.norm_topk_prob and c.num_experts_per_tok > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * c.routed_scaling_factor


class SparseMoE(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, tp: TensorParallel = SINGLE):
        """This rank's routed experts (keyed by their ids: ``experts.E``, as checkpoints name
        them; whole or a slice of each, ``replicas.models.parallel``) and its slice of the
        shared experts; the caller adds up the ranks' outputs."""
        super().__init__()
        self.gate = MoEGate(config)
        width = expert_width(config.moe_intermediate_size, tp)
        self.experts = nn.ModuleDict({str(e): SwiGLU(config.hidden_size, width)
                                      for e in local_experts(config.num_experts, tp)})
        if config.num_shared_experts:
            shared = config.moe_shared_expert_intermediate_size or config.moe_intermediate_size * config.num_shared_experts
            self.shared_experts = SwiGLU(config.hidden_size, tp.split(shared, "the shared experts' width"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(flat)
        out = torch.zeros_like(flat)
        # one matmul per expert of this rank that has tokens this step (no fused MoE kernel yet)
        for expert in experts.unique().tolist():
            if str(expert) not in self.experts:
                continue  # another rank's
            token, choice = (experts == expert).nonzero(as_tuple=True)  # choice: which of the top-k
            contribution = self.experts[str(expert)](flat[token]) * weights[token, choice, None].to(flat.dtype)
            out.index_add_(0, token, contribution)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
        return out.view_as(x)


class LLaDA2MoeModelLM(DecoderLM):
    config_class = LLaDA2MoeConfig
    checkpoint_renames = (
        (r"^model\.word_embeddings\.", "model.embed_tokens."),
        (_LAYER + r"query_key_value\.", r"model.layers.\1.self_attn.qkv_proj."),
        (_LAYER + r"dense\.", r"model.layers.\1.self_attn.o_proj."),
        (_LAYER + r"query_layernorm\.", r"model.layers.\1.self_attn.q_norm."),
        (_LAYER + r"key_layernorm\.", r"model.layers.\1.self_attn.k_norm."),
    )

    def __init__(self, config: LLaDA2MoeConfig, tp: TensorParallel = SINGLE):
        if config.score_function != "sigmoid":
            raise ValueError(f"LLaDA2MoeModelLM: score_function {config.score_function!r} is not supported")
        head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        shape = config.decoder_shape(qkv_bias=config.use_qkv_bias, qk_norm=config.use_qk_norm, fused_qkv=True,
                                     rotary_dim=int(head_dim * config.partial_rotary_factor))

        def make_mlp(layer: int) -> nn.Module:
            if layer < config.first_k_dense_replace:
                return SwiGLU(config.hidden_size, tp.split(config.intermediate_size, "the MLP's width"))
            return SparseMoE(config, tp)

        super().__init__(config, shape, make_mlp, tp)
