"""Attention over a packed step batch with a paged KV cache.

Every step packs the new tokens of all rows into one sequence. A row's keys are the
tokens already in its pages (prompt and committed blocks) plus its new tokens, which
are written to the cache before attention reads it back. The mask is block-causal at
page granularity: a query in the row's page ``s`` sees every valid key in pages ``<= s``
(bidirectional inside a page). Pages are exactly one block, so this is the attention
of the SDAR / LLaDA2.0 / D2F family and committed blocks have an exact KV cache.

Model code calls ``context.attend(layer, q, k, v)`` and never knows which backend or
which kind of batch (packed inference or dense training) it runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BatchLayout:
    """Where each new token of a step lives; built by the runner, read by attention.

    T new tokens over B rows; Kmax = the longest row's key span (its pages x L).
    """

    query_start: torch.Tensor  # [B+1] cumulative new-token counts
    token_segment: torch.Tensor  # [T] page index within its row of each new token
    slot_mapping: torch.Tensor  # [T] flat cache slot each new token's K/V goes to
    key_slots: torch.Tensor  # [B, Kmax] flat cache slot of each key position
    key_segment: torch.Tensor  # [B, Kmax] page index within the row of each key
    key_valid: torch.Tensor  # [B, Kmax] False for unused slots (partial prompt page, padding)


class PagedAttentionContext:
    """Torch SDPA over gathered pages (CPU and fallback backend)."""

    def __init__(self, layout: BatchLayout, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]):
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.slot_mapping = layout.slot_mapping
        self.key_slots = layout.key_slots
        rows = layout.query_start.numel() - 1
        lens = layout.query_start[1:] - layout.query_start[:-1]
        self.rows = rows
        self.qmax = int(lens.max())
        token_row = torch.repeat_interleave(torch.arange(rows), lens)
        offset = torch.arange(layout.token_segment.numel()) - layout.query_start[token_row]
        self.pad_index = token_row * self.qmax + offset
        q_segment = torch.full((rows * self.qmax,), -1, dtype=torch.long)
        q_segment[self.pad_index] = layout.token_segment
        q_segment = q_segment.view(rows, self.qmax, 1)
        mask = layout.key_valid[:, None, :] & (layout.key_segment[:, None, :] <= q_segment)
        # padding queries see everything so that no softmax row is empty
        mask |= (q_segment < 0)
        self.mask = mask.unsqueeze(1)  # [B, 1, Qmax, Kmax]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q[T, H, D]``, ``k``/``v[T, Hkv, D]`` -> ``[T, H, D]``."""
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache.index_copy_(0, self.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, self.slot_mapping, v.to(v_cache.dtype))
        keys = k_cache[self.key_slots].transpose(1, 2)  # [B, Hkv, Kmax, D]
        values = v_cache[self.key_slots].transpose(1, 2)
        heads, dim = q.shape[1], q.shape[2]
        padded = q.new_zeros(self.rows * self.qmax, heads, dim)
        padded[self.pad_index] = q
        padded = padded.view(self.rows, self.qmax, heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            padded, keys.to(q.dtype), values.to(q.dtype), attn_mask=self.mask,
            enable_gqa=heads != keys.shape[1],
        )
        return out.transpose(1, 2).reshape(self.rows * self.qmax, heads, dim)[self.pad_index]


class DenseAttentionContext:
    """Plain SDPA over ``[B, S]`` sequences with an explicit mask (training)."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask  # [B, 1, S, S] bool

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q[B, S, H, D]`` -> ``[B, S, H, D]``."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.mask,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)
