"""Attention over a packed step batch with a paged KV cache.

Every step packs the new tokens of all rows into one sequence. A row's keys are the
tokens already in its pages (prompt and committed blocks) plus its new tokens, which
are written to the cache before attention reads it back. Which keys a unit sees is the
runner's choice (``key_valid``): block-causal at page granularity (a query at the row's
page index ``s`` sees every valid key at page indices ``<= s``, bidirectional inside a page: the
SDAR / LLaDA2.0 / D2F family, whose committed blocks have an exact KV cache), or every
page of the row up to its active block (bidirectional LLaDA / Dream).

Model code calls ``context.attend(layer, q, k, v)`` and never knows which backend (torch
SDPA, or vllm-flash-attn varlen on CUDA; ``paged_context`` picks) or which kind of batch
(packed inference or dense training) it runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from replicas.devices import to_device


@dataclass
class BatchLayout:
    """Where each new token of a step lives; built by the runner, read by attention.

    The T new tokens come in page-sized *units* (a unit is at most one page of one row,
    and starts at the page's first position), and attention is computed per *span*: a
    unit, or consecutive units of one row that see the same keys (all of a refreshed
    bidirectional row's pages; ``ModelRunner.build_inputs`` decides). A span's queries see
    the same keys (every valid position of the row's pages up to and including their own
    unit's), which at unit granularity is exactly the block-causal mask. A *cache
    position* is a token's flat index in the KV cache: page x page size + offset.
    """

    span_start: torch.Tensor  # [A+1] cumulative new-token counts per span (on the host)
    cache_positions: torch.Tensor  # [T] cache position each new token's K/V goes to
    key_cache_positions: torch.Tensor  # [A, Kmax] cache position of each key
    key_valid: torch.Tensor  # [A, Kmax] False for unused positions (partial prompt page, padding)
    span_length: int | None = None  # the longest span's tokens; None: every span is one unit (a page at most)
    # every span's keys are exactly its own new tokens (refreshed rows' whole sequences, the
    # whole step): attention takes them as they come, without the cache's gather
    keys_are_queries: bool = False
    cache_kept: bool = True  # later steps read the new K/V (False without a KV cache)


GROUP_BYTES = {"cuda": 1 << 30}  # K and V one group of spans gathers at once (``span_groups``), by device type
DEFAULT_GROUP_BYTES = 256 << 20


def keys_per_group(kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """How many keys' K and V one group gathers at most."""
    budget = GROUP_BYTES.get(device.type, DEFAULT_GROUP_BYTES)
    return max(1, budget // (2 * kv_heads * head_dim * dtype.itemsize))


def span_groups(spans: int, key_width: int, group_keys: int) -> list[tuple[int, int]]:
    """Ranges of spans attended together. Each span gathers ``key_width`` keys' K and V
    from the cache, so a step of many spans over long rows (a block-causal prompt chunk at
    32K positions: 512 units of 4 tokens) would gather tens of gigabytes at once; groups of
    at most ``group_keys`` keys (or one span) bound a step's memory whatever the context
    length. A step of short rows is one group."""
    size = max(1, group_keys // max(key_width, 1))
    return [(start, min(start + size, spans)) for start in range(0, spans, size)]


@dataclass
class QueryPlacement:
    """Where queries go in ``PagedAttentionContext``'s padded SDPA: the spans holding one
    (``spans``; None: every span), each padded to ``length`` queries; ``pad_index``: each
    query's slot in ``[spans x length]``, None where they fill it in order."""

    spans: torch.Tensor | None
    length: int
    pad_index: torch.Tensor | None


class PagedAttentionContext:
    """Torch SDPA over gathered pages, one attention row per span, its queries padded to
    the longest span's (CPU and fallback).

    ``kept`` (host ``[K]``, the model's ``logits_index``): the tokens whose outputs the
    last layer keeps; given it, that layer may ask for the kept tokens' queries only
    (``attend(..., kept_queries=True)``): every token's K and V are still written and read."""

    def __init__(self, layout: BatchLayout, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                 page_size: int, kept: torch.Tensor | None = None):
        self.device = device = k_cache[0].device
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.cache_positions = to_device(layout.cache_positions, device)
        self.key_cache_positions = to_device(layout.key_cache_positions, device)
        span_start = layout.span_start.numpy()  # a host tensor: the index math runs in numpy
        counts = span_start[1:] - span_start[:-1]
        self.spans = counts.size
        self.span_length = layout.span_length or page_size
        # when every span is as long as the longest (denoise-only steps: whole pages) the
        # packed queries already have the padded shape and need no scatter/gather
        self.pad_index = None
        self.counts = counts
        if span_start[-1] != self.spans * self.span_length:  # (no span is longer)
            token_span = np.repeat(np.arange(self.spans), counts)
            offset = np.arange(span_start[-1]) - span_start[token_span]
            self.pad_index = to_device(torch.from_numpy(token_span * self.span_length + offset), device)
        self.placement = QueryPlacement(None, self.span_length, self.pad_index)  # every token's queries
        self.kept = None if kept is None else kept.numpy()
        self.narrows_queries = kept is not None
        self._kept_placement: QueryPlacement | None = None
        self.keys_are_queries = layout.keys_are_queries
        # nothing reads the new K/V back: neither this step (its own keys) nor a later one
        self.writes = layout.cache_kept or not layout.keys_are_queries
        if self.keys_are_queries:  # the keys padded as the queries are: the mask says which slots hold one
            self.mask = None if self.pad_index is None else to_device(torch.from_numpy(
                np.arange(self.span_length) < counts[:, None]).reshape(self.spans, 1, 1, -1), device)
        else:
            self.mask = to_device(layout.key_valid.reshape(self.spans, 1, 1, -1), device)  # [A, 1, 1, Kmax]
        _, kv_heads, head_dim = k_cache[0].shape
        self.group_keys = keys_per_group(kv_heads, head_dim, k_cache[0].dtype, device)
        self.groups = span_groups(self.spans, layout.key_cache_positions.shape[1], self.group_keys)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kept_queries: bool = False) -> torch.Tensor:
        """``q[T, H, D]``, ``k``/``v[T, Hkv, D]`` -> ``[T, H, D]``; ``kept_queries``: ``q`` is
        the kept tokens' (``[K, H, D]``, in ``kept``'s order), and so is the output."""
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        if self.writes:
            k_cache.index_copy_(0, self.cache_positions, k.to(k_cache.dtype))
            v_cache.index_copy_(0, self.cache_positions, v.to(v_cache.dtype))
        if not q.shape[0]:  # no query: a step of prompt chunks alone keeps no token
            return q
        place = self.kept_placement() if kept_queries else self.placement
        spans = self.spans if place.spans is None else place.spans.numel()
        out = self._attend_keys(layer, _padded(q, place.pad_index, spans, place.length), k, v, place.spans)
        out = out.transpose(1, 2).reshape(spans * place.length, *q.shape[1:])
        return out if place.pad_index is None else out[place.pad_index]

    def _attend_keys(self, layer: int, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     chosen: torch.Tensor | None) -> torch.Tensor:
        """SDPA of the ``chosen`` spans' (None: every span's) padded queries over their keys."""
        mask = self.mask if self.mask is None or chosen is None else self.mask[chosen]
        if self.keys_are_queries:
            keys, values = (_padded(x, self.pad_index, self.spans, self.span_length) for x in (k, v))
            if chosen is not None:
                keys, values = keys[chosen], values[chosen]
            return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                                  enable_gqa=queries.shape[1] != keys.shape[1])
        key_positions, groups = self.key_cache_positions, self.groups
        if chosen is not None:
            key_positions = key_positions[chosen]
            groups = span_groups(key_positions.shape[0], key_positions.shape[1], self.group_keys)
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        parts = [self._attend_spans(queries[a:b], k_cache, v_cache, key_positions[a:b], mask[a:b]) for a, b in groups]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def kept_placement(self) -> QueryPlacement:
        """Where the kept tokens' queries go (worked out once a forward, by the last layer):
        the spans holding one, each padded to the most any of them holds."""
        if self._kept_placement is None:
            if self.kept is None:
                raise ValueError("this attention context was given no kept tokens")
            token_span = np.repeat(np.arange(self.spans), self.counts)
            kept_span = token_span[self.kept]
            per_span = np.bincount(kept_span, minlength=self.spans)
            holding = np.flatnonzero(per_span)
            length = int(per_span.max())
            # each kept query's slot: its span's rank among the holding ones, then its rank in its span
            order = np.argsort(kept_span, kind="stable")
            first = np.cumsum(per_span) - per_span
            slot = np.empty_like(order)
            slot[order] = np.arange(order.size) - first[kept_span[order]]
            pad_index = (np.cumsum(per_span > 0) - 1)[kept_span] * length + slot
            in_order = pad_index.size == holding.size * length and bool((pad_index == np.arange(pad_index.size)).all())
            self._kept_placement = QueryPlacement(
                spans=None if holding.size == self.spans else to_device(torch.from_numpy(holding), self.device),
                length=length, pad_index=None if in_order else to_device(torch.from_numpy(pad_index), self.device))
        return self._kept_placement

    @staticmethod
    def _attend_spans(queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      key_cache_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """SDPA of spans' queries ``[a, H, L, D]`` over their keys gathered from the cache."""
        spans, width = key_cache_positions.shape
        flat_positions = key_cache_positions.reshape(-1)
        keys = k_cache.index_select(0, flat_positions).view(spans, width, *k_cache.shape[1:]).transpose(1, 2)
        values = v_cache.index_select(0, flat_positions).view(spans, width, *v_cache.shape[1:]).transpose(1, 2)
        return F.scaled_dot_product_attention(queries, keys.to(queries.dtype), values.to(queries.dtype),
                                              attn_mask=mask, enable_gqa=queries.shape[1] != keys.shape[1])


def kept_tokens(logits_index: torch.Tensor, tokens: int, shifted: bool) -> torch.Tensor | None:
    """The packed tokens whose outputs a forward of ``tokens`` tokens keeps (host ``[K]``:
    ``logits_index`` flat), or None where that is every token in order (unshifted reads of
    every token, as a step of block units alone makes them: distinct, so the identity), and
    the last layer has nothing to narrow or gather."""
    kept = logits_index.view(-1)
    return None if not shifted and kept.numel() == tokens else kept


def _padded(x: torch.Tensor, pad_index: torch.Tensor | None, spans: int, length: int) -> torch.Tensor:
    """``x[T, heads, D]`` as ``[spans, heads, length, D]``: token i at flat slot
    ``pad_index[i]`` (None: in order, filling every slot), zeros in the slots none fills."""
    if pad_index is not None:
        padded = x.new_zeros(spans * length, *x.shape[1:])
        padded[pad_index] = x
        x = padded
    return x.view(spans, length, *x.shape[1:]).transpose(1, 2)


class DenseAttentionContext:
    """Plain SDPA over ``[B, S]`` sequences with an explicit mask (training)."""

    narrows_queries = False

    def __init__(self, mask: torch.Tensor):
        self.mask = mask  # [B, 1, S, S] bool

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q[B, S, H, D]`` -> ``[B, S, H, D]``."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.mask,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)


class FlashAttentionContext:
    """vllm-flash-attn varlen over the same layout (CUDA, fp16/bf16): each span's queries
    against its valid keys, gathered from the pages and packed without padding."""

    narrows_queries = False  # its last layer computes every token's queries

    def __init__(self, layout: BatchLayout, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                 page_size: int):
        from vllm_flash_attn import flash_attn_varlen_func

        device = k_cache[0].device
        self._attn = flash_attn_varlen_func
        self.k_cache, self.v_cache = k_cache, v_cache
        self.cache_positions = layout.cache_positions.to(device)
        valid = layout.key_valid
        self.key_index = layout.key_cache_positions[valid].to(device)  # span-major: valid keys of span 0, 1, ...
        key_counts = valid.sum(1)
        self.cu_k = torch.zeros(key_counts.numel() + 1, dtype=torch.int32)
        torch.cumsum(key_counts, 0, out=self.cu_k[1:])
        self.max_k = int(key_counts.max())
        q_counts = layout.span_start[1:] - layout.span_start[:-1]
        self.max_q = int(q_counts.max())
        self.cu_q = layout.span_start.to(device=device, dtype=torch.int32)
        self.cu_k = self.cu_k.to(device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache.index_copy_(0, self.cache_positions, k.to(k_cache.dtype))
        v_cache.index_copy_(0, self.cache_positions, v.to(v_cache.dtype))
        keys = k_cache.index_select(0, self.key_index).to(q.dtype)
        values = v_cache.index_select(0, self.key_index).to(q.dtype)
        return self._attn(q, keys, values, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
                          max_seqlen_q=self.max_q, max_seqlen_k=self.max_k, causal=False)


BACKENDS = ("auto", "sdpa", "flash")


def flash_available() -> bool:
    try:
        import vllm_flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: flash on CUDA in fp16/bf16 when vllm-flash-attn is installed, else SDPA."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}; choose one of {list(BACKENDS)}")
    usable = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_available()
    if backend == "flash" and not usable:
        raise ValueError("attention backend 'flash' needs CUDA, float16/bfloat16 and vllm-flash-attn "
                         "(pip install 'dllm-serve[gpu]')")
    return "flash" if backend == "flash" or (backend == "auto" and usable) else "sdpa"


def paged_context(backend: str, layout: BatchLayout, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                  page_size: int, kept: torch.Tensor | None = None):
    """The one function model code's attention goes through: the resolved backend's context.
    ``kept``: see ``PagedAttentionContext``."""
    if backend == "flash":
        return FlashAttentionContext(layout, k_cache, v_cache, page_size)
    return PagedAttentionContext(layout, k_cache, v_cache, page_size, kept)
