"""Turns a ScheduledBatch into model inputs and runs the forward."""

from __future__ import annotations

import time

import torch
from torch import nn

from replicas.attention import BatchLayout, PagedAttentionContext
from replicas.batch import ScheduledBatch
from replicas.kv_cache import KVCache, PagePool
from replicas.slots import SlotTable


class ModelRunner:
    def __init__(self, model: nn.Module, slots: SlotTable, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.slots = slots
        self.kv_cache = kv_cache
        self.device = device
        self.block_length = model.spec.block_length
        self._offsets = torch.arange(self.block_length)

    def build_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, BatchLayout, torch.Tensor]:
        """Packed input ids, positions, attention layout and the block tokens' indices."""
        size, slots, offsets = self.block_length, self.slots, self._offsets
        unit_slot = batch.row_slots[batch.unit_row]
        segment = batch.unit_segment
        flat_page = unit_slot * slots.max_pages + segment
        valid = offsets < batch.unit_count[:, None]  # [U, L]
        input_ids = slots.tokens.view(-1, size)[flat_page][valid]
        positions = (segment[:, None] * size + offsets)[valid]
        page = slots.page_table.view(-1)[flat_page]
        page = torch.where(batch.unit_scratch, PagePool.SCRATCH_PAGE, page)
        slot_mapping = (page[:, None] * size + offsets)[valid]

        unit_start = torch.zeros(batch.unit_count.numel() + 1, dtype=torch.long)
        torch.cumsum(batch.unit_count, 0, out=unit_start[1:])
        key_pages = int(segment.max()) + 1
        table = slots.page_table[unit_slot, :key_pages]
        key_slots = (table[:, :, None] * size + offsets).view(-1, key_pages * size)
        key_segment = torch.arange(key_pages).repeat_interleave(size)
        key_offset = offsets.repeat(key_pages)
        prompt_last = slots.prompt_pages[unit_slot, None] - 1
        prompt_tail = slots.prompt_tail[unit_slot, None]
        key_valid = (key_segment <= segment[:, None]) & (
            (key_segment != prompt_last) | (key_offset < prompt_tail))

        logits_index = (unit_start[:-1][batch.unit_is_block][:, None] + offsets).view(-1)
        layout = BatchLayout(unit_start=unit_start, slot_mapping=slot_mapping,
                             key_slots=key_slots, key_valid=key_valid)
        return input_ids, positions, layout, logits_index

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, float]:
        """Logits ``[R, L, V]`` of the batch's block units, and the forward's seconds."""
        input_ids, positions, layout, logits_index = self.build_inputs(batch)
        start = time.perf_counter()
        context = PagedAttentionContext(layout, self.kv_cache.k, self.kv_cache.v, self.block_length)
        logits = self.model(input_ids.to(self.device), positions.to(self.device), context,
                            logits_index.to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        return logits.view(-1, self.block_length, logits.shape[-1]).float().cpu(), elapsed
