"""A model whose forward is recorded once and then replayed: the engine's host work
measured without the forward running on the host.

On a CPU the forward runs on the same cores and caches as the engine's bookkeeping, and
its tens of megabytes of activations and gathered keys evict the host's working set (the
interpreter's and torch's dispatch code and data, the step's arrays), so every host op
after a forward pays cache misses. On an accelerator the forward runs elsewhere and the
host keeps its caches. A run that replays the recorded logits makes the same steps
(scheduling, input building, the attention layout, the algorithms, commits, emission)
with no forward at all: the host time per step a GPU node would see, at this CPU's speed.

A replay paced by another model (``PacedReplay``) runs that model's forward in each
recorded one's place and hands the engine the recorded logits: the recorded run's steps
and tokens (the trained tiny model's answers) at the other model's cost (a 1B-class one).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


class ReplayDiverged(RuntimeError):
    """A replayed step fed other tokens than the recorded one: the runs are not the same."""


class RecordedForward(nn.Module):
    """Wraps a model: records its logits step by step; after ``replay()`` returns them in
    order instead of running it (each replayed step checks it feeds as many tokens as the
    recorded one did)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.spec = model.spec
        self.recorded: list[tuple[int, torch.Tensor]] = []  # (tokens fed, logits) per forward
        self._cursor: int | None = None  # the next forward to replay; None: recording

    def replay(self) -> None:
        """Replay the recording from its first forward (again, after an earlier replay)."""
        self._cursor = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        if self._cursor is None:
            logits = self.model(input_ids, positions, context, logits_index)
            self.recorded.append((input_ids.numel(), logits.clone()))
            return logits
        index = self._cursor
        if index >= len(self.recorded) or self.recorded[index][0] != input_ids.numel():
            raise ReplayDiverged(f"forward {index} of the replay fed {input_ids.numel()} tokens, where the "
                                 f"recording has {self.recorded[index][0] if index < len(self.recorded) else 'none'}")
        self._cursor += 1
        return self.recorded[index][1].clone()  # the engine may write into the logits it gets


class PacedReplay(nn.Module):
    """Replays ``recording`` from its first forward, each forward paced by ``pacer``'s on the
    same inputs (its KV written to the engine's pool, its logits computed), whose logits it
    hands back with the recorded ones in their place: the recorded vocabulary's columns
    hold the recorded logits and the others -inf, so every rule makes the recorded choices
    at the pacer's vocabulary's width. The engine sees the recorded model's spec with the
    pacer's KV shape and vocabulary. ``run_pacer`` False: the same logits with no forward
    (the host's work of such a run)."""

    def __init__(self, recording: RecordedForward, pacer: nn.Module, run_pacer: bool = True):
        super().__init__()
        recorded, paced = recording.spec, pacer.spec
        if paced.vocab_size < recorded.vocab_size or paced.max_positions < recorded.max_positions:
            raise ValueError(f"the pacer's vocabulary ({paced.vocab_size}) and positions ({paced.max_positions}) "
                             f"must hold the recorded model's ({recorded.vocab_size}, {recorded.max_positions})")
        self.pacer = pacer  # first: the engine reads the device and dtype off the first parameter
        self.recording = recording
        self.run_pacer = run_pacer
        self.spec = dataclasses.replace(recorded, num_layers=paced.num_layers, num_kv_heads=paced.num_kv_heads,
                                        head_dim=paced.head_dim, vocab_size=paced.vocab_size)
        recording.replay()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        recorded = self.recording(input_ids, positions, context, logits_index)
        if self.run_pacer:
            logits = self.pacer(input_ids, positions, context, logits_index)
        else:
            logits = recorded.new_empty(*recorded.shape[:-1], self.spec.vocab_size)
        width = recorded.shape[-1]
        logits[..., :width] = recorded
        logits[..., width:] = float("-inf")
        return logits
