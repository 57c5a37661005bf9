"""The engine's settings, declared once (no torch).

``EngineConfig`` is what ``replicas.engine.Engine`` runs with; the cluster config embeds
it (``cluster.config.ReplicaSettings`` adds the Ray and Serve settings) and the
command line's engine flags and their help are generated from its fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from replicas.batching import SchedulerMode
from replicas.request_cost import max_request_cost

if TYPE_CHECKING:
    from replicas.memory import PoolSize
    from replicas.models.spec import ModelSpec


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mode: SchedulerMode = Field(SchedulerMode.FDFO, description="batching policy: 'fdfo' commits done blocks and admits waiting "
                                                             "requests every step; 'sync', 'static' and 'fixed_fill' are the research baselines "
                                                             "(replicas.batching)")
    max_batch: int = Field(16, ge=1, le=1024, description="most requests in the running batch (rows of a denoise step)")
    num_pages: int | None = Field(
        None, ge=2, description="KV pages, exactly (default: sized from memory, see memory_utilization; a page "
                                "holds one block of every layer's K and V)")
    memory_utilization: float | None = Field(
        None, gt=0, le=1,
        description="share of the device's memory this replica may use for its weights, the largest step's "
                    "activations and the KV pool, measured at start after loading the weights and running that "
                    "step (vLLM's gpu_memory_utilization); on a CPU, of the machine's memory (default: 0.9 on an "
                    "accelerator; on a CPU the pool gets kv_cache_memory's default instead)")
    kv_cache_memory: ByteSize | None = Field(
        None, gt=0,
        description="bytes for the KV pool, e.g. 8GiB or 512MiB, instead of what memory_utilization leaves "
                    "(default on a CPU: a quarter of the memory available at start, at most 4GiB); the pool "
                    "never takes more pages than max_batch requests of max_model_len need")
    max_tokens_per_step: int | None = Field(
        None, ge=1, description="new-token bound per step: every row's block and, with fused_commit, the write of its last committed block always run (so it is at least max_batch x block length, twice that with fused_commit), prompt slices fill the rest (default: max(2048, 2 x max_batch x block length))")
    max_model_len: int | None = Field(
        None, ge=1, description="longest prompt + output (default: the model's limit, cut to what the KV pool holds "
                                "for one request, with a log line; a value given here that the pool cannot hold "
                                "stops the replica at start)")
    device: str = Field("cpu", description="torch device the model runs on: 'cpu' or 'cuda'")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="weights and KV dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    kv_cache: Literal["prefix", "none"] = Field(
        "prefix", description="'prefix': committed blocks' KV is cached (exact for block-causal models, Fast-dLLM's "
                            "approximate prefix or dual cache for bidirectional ones); 'none' recomputes the whole "
                            "sequence every step (exact, slow)")
    canvas: Literal["full", "block"] | None = Field(
        None, description="'full': every block's masks are in the sequence from the start and attended (the "
                          "reference generation of LLaDA and Dream; with kv_cache prefix, Fast-dLLM's dual cache); "
                          "'block': a block sees only the prompt, committed blocks and itself (faster); "
                          "default: the model's (full for LLaDA and Dream, block otherwise); full needs a "
                          "bidirectional model")
    block_alignment: Literal["page", "prompt"] | None = Field(
        None, description="'page': the answer's first block starts on a fresh page after the prompt; 'prompt': "
                          "blocks are aligned to the sequence's start and the first answer block fills the rest "
                          "of the prompt's last block (the reference generation of SDAR and LLaDA2.0; canvas "
                          "block only); default: the model's ('prompt' for SDAR and LLaDA2.0, 'page' otherwise)")
    attention_backend: Literal["auto", "sdpa", "flash"] = Field(
        "auto", description="attention kernel: 'flash' is vllm-flash-attn (CUDA, the gpu extra); auto picks it when usable")
    lora: str | None = Field(None, description="PEFT LoRA adapter directory merged into the weights at load (one "
                                               "adapter, no cost a step; see adapters for several)")
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="PEFT LoRA adapters served unmerged beside the base model, name -> directory: a request's "
                    "model picks one; rows of several adapters and of the base model run in one step, each "
                    "adapter's rows paying two small products per adapted layer (not with lora or "
                    "tensor_parallel_size > 1)")
    max_adapters: int = Field(
        4, ge=1, le=1024, description="adapters loaded per replica at once: loaded on first use, the least "
                                      "recently used dropped first; the router prefers replicas that hold "
                                      "a request's adapter")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64,
        description="ranks one replica's model is split over (one device each, packed on one node): attention "
                    "heads, MLPs and the vocabulary split, a MoE's experts distributed (LLaDA, Dream, SDAR, "
                    "LLaDA2.0); torch.distributed between them, NCCL on CUDA, gloo on CPU")
    expert_parallel_size: int | None = Field(
        None, ge=1, le=64,
        description="MoE models (LLaDA2.0): the parts the routed experts are distributed in over the "
                    "tensor-parallel ranks, a divisor of tensor_parallel_size; each part's experts are split "
                    "over tensor_parallel_size / expert_parallel_size ranks (1: every rank holds a slice of "
                    "every expert; default: tensor_parallel_size, whole experts on each rank)")
    model_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="per-model defaults to override: block_length, mask_token_id, eos_token_id, stop_token_ids, "
                    "attention (block_causal|bidirectional|block_causal_whole_prompt: D2F's, the prompt one block), "
                    "default_algorithm, default_algorithm_params")
    fill_timeout_s: float | None = Field(
        None, ge=0, description="fixed_fill mode: batch fill timeout in seconds (default: tuned online)")
    prefix_cache: bool = Field(
        True, description="reuse the KV pages of prompt prefixes that earlier requests computed (exact; used "
                          "where a page's KV depends only on the pages before it: a block-causal model with "
                          "kv_cache prefix, e.g. SDAR, LLaDA2.0 and the tiny model; LLaDA and Dream recompute "
                          "the prompt with every block and do not use it)")
    fused_commit: bool = Field(
        True, description="commit a block at the step that fills its last mask and write its final KV in the "
                          "row's next forward, instead of one more forward of the block (rules that edit wait)")
    fdfo_fill_hold: bool = Field(
        True, description="fdfo mode: an under-filled step may wait briefly for arrivals (replicas.fill_timeout)")
    algorithm: str | None = Field(
        None, description="denoise algorithm of requests that name none (default: the model's own, "
                          "from the per-model defaults table)")
    algorithm_params: dict[str, Any] = Field(
        default_factory=dict, description="parameters of that default algorithm, e.g. {threshold: 0.9}")

    @model_validator(mode="after")
    def _adapters_alone(self) -> EngineConfig:
        if self.adapters and (self.lora or self.tensor_parallel_size > 1):
            raise ValueError("adapters (unmerged) are served without lora (merged) and with tensor_parallel_size 1")
        return self


@dataclass(frozen=True)
class ServingShape:
    """What an engine's settings and its model fix for every request, computed once
    (``of``): the engine, the replica, the ingress and the failover all read it here."""

    block_length: int
    max_model_len: int  # longest prompt + output
    max_pages_per_request: int
    num_pages: int  # the KV pool
    token_budget: int  # tokens a step may feed
    canvas: str  # in force: configured, else the model's (a block-causal model's is 'block')
    aligned: bool  # answer blocks aligned to the sequence's start (block_alignment 'prompt')
    max_cost: int  # the most row-steps a request is charged (``limits.max_request_cost``)
    prefix_cache: bool  # in force: configured, and the model's prefix KV is exact to reuse

    @classmethod
    def of(cls, config: EngineConfig, spec: ModelSpec, pool: PoolSize | None = None) -> ServingShape:
        """Raises ValueError for settings the model cannot serve. ``pool``: the pool's pages
        and the longest request, as the replica's memory decided them (``replicas.memory``);
        without it, what the settings alone give (the pages ``max_batch`` requests of
        ``max_model_len`` need: an upper bound, as the ingress reads it)."""
        size = spec.block_length
        max_model_len = pool.max_model_len if pool is not None else config.max_model_len or spec.max_positions
        if max_model_len > spec.max_positions:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {spec.max_positions} positions")
        pages = max_model_len // size
        budget = config.max_tokens_per_step or max(2048, 2 * config.max_batch * size)
        forced = config.max_batch * size * (2 if config.fused_commit else 1)  # what a step feeds whatever the budget
        if budget < forced:
            writes = " and the writes of their last committed blocks (fused_commit)" if config.fused_commit else ""
            raise ValueError(f"max_tokens_per_step {budget} cannot hold {config.max_batch} blocks of {size}{writes}: "
                             f"it must be at least {forced}")
        canvas = config.canvas or (spec.canvas if spec.bidirectional else "block")
        if canvas == "full" and not spec.bidirectional:
            raise ValueError("canvas 'full' needs a bidirectional model: a block-causal one never attends "
                             "to later blocks")
        aligned = (config.block_alignment or spec.block_alignment) == "prompt"
        if aligned and canvas == "full":
            raise ValueError("block_alignment 'prompt' is the block-causal models' reference; "
                             "with canvas 'full' use block_alignment 'page'")
        # a page's KV depends on the pages before it alone: no row is ever refreshed (replicas.runner)
        prefix_cache = (config.prefix_cache and config.kv_cache == "prefix" and not spec.bidirectional
                        and not spec.shift_logits and not spec.whole_prompt)
        num_pages = pool.num_pages if pool is not None else config.num_pages or config.max_batch * pages + 1
        return cls(size, max_model_len, pages, num_pages, budget, canvas,
                   aligned, max_request_cost(max_model_len, size), prefix_cache)


def resolve_algorithm(config: EngineConfig, spec: ModelSpec, name: str | None = None,
                      params: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """The algorithm a request runs and its parameters (not yet validated).

    The default is the configured algorithm with its parameters, else the model's own with
    the configured parameters on top of the model's. A request naming no algorithm, or the
    default one, gets ``params`` on top of the default's parameters; another algorithm
    gets ``params`` alone.
    """
    if config.algorithm is None:
        default, default_params = spec.default_algorithm, {**spec.default_algorithm_params, **config.algorithm_params}
    else:
        default, default_params = config.algorithm, config.algorithm_params
    name = name or default
    return name, {**(default_params if name == default else {}), **(params or {})}
