"""Token proposals for one denoise step, shared by every rule.

A proposal is one token and one confidence per position of every row (``[B, L]`` each);
a proposed token is never the mask id. Three ways to propose:

* ``greedy``: argmax, confidence = its softmax probability (temperature 0 everywhere).
* ``categorical``: SGLang's dLLM sampling / LLaDA2.0's ``_sample_with_temperature_topk_topp``:
  draw from softmax(logits / T) restricted by top-k and top-p; the confidence is the drawn
  token's probability under that same distribution.
* ``gumbel``: LLaDA's ``add_gumbel_noise`` (also Fast-dLLM's): argmax of exp(l) / (-log u)^T
  in float64; the confidence is the drawn token's untempered softmax probability.

Rows with temperature 0 are greedy and draw no noise. Rows that sample draw it from their
own ``RowNoise`` (a torch.Generator seeded from (seed, block_index)), so a row's tokens
depend only on its own request, never on the rest of the batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from .base import AlgorithmParams, check_number
from .selection import per_row


MAX_TOP_K = 1 << 20  # above any served vocabulary (top_k beyond the vocabulary keeps every token)


class Proposal(NamedTuple):
    tokens: torch.Tensor  # LongTensor[B, L]
    confidence: torch.Tensor  # FloatTensor[B, L]


@dataclasses.dataclass(frozen=True)
class TopKTopPParams(AlgorithmParams):
    """Sampling filters of SGLang / LLaDA2.0; only used when temperature > 0."""

    top_k: int = 0  # keep the k most likely tokens; 0 or -1 (vLLM's) = no limit
    top_p: float = 1.0  # keep tokens whose more likely tokens hold <= p of the mass; 1 = no limit, 0 = the top one

    def validate(self) -> None:
        super().validate()
        check_number("top_k", self.top_k, minimum=-1, maximum=MAX_TOP_K, integer=True)
        check_number("top_p", self.top_p, minimum=0, maximum=1)


# the filters' values that filter nothing: a rule without the filter takes them as absent
NO_FILTER = {"top_k": (0, -1), "top_p": (1,)}


@dataclasses.dataclass
class RowNoise:
    """One row's random source for one block; the generator is made on first use."""

    seed: int
    generator: torch.Generator | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def for_block(cls, seed: int | None, block_index: int) -> RowNoise:
        """Seeded from (seed, block_index); a missing seed is drawn at random."""
        if seed is None:
            seed = secrets.randbits(63)
        digest = hashlib.blake2b(f"{seed}:{block_index}".encode(), digest_size=8).digest()
        return cls(int.from_bytes(digest, "little"))

    def uniform(
        self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype
    ) -> torch.Tensor:
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        return torch.rand(shape, generator=self.generator, device=device, dtype=dtype)


def uniform_rows(
    noise: Sequence[RowNoise | None],
    rows: list[int],
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[len(rows), *shape]`` uniform draws in [0, 1), each row from its own generator."""
    missing = [row for row in rows if noise[row] is None]
    if missing:
        raise ValueError(f"rows {missing} need noise but have no state; call init_state first")
    return torch.stack([noise[row].uniform(shape, device, dtype) for row in rows])


def sampling_rows(
    params: Sequence[AlgorithmParams], device: torch.device
) -> tuple[list[int], torch.Tensor | None]:
    """The rows with temperature > 0, and every row's temperature (None when no row samples:
    the common greedy step makes no tensor)."""
    rows = [row for row, p in enumerate(params) if p.temperature > 0]
    return rows, per_row(params, "temperature", device) if rows else None


def token_probability(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """softmax(logits)[tokens] in float32 (as the published rules compute it; one fused
    softmax is faster on CPU than a logsumexp and an exp, at any vocabulary size)."""
    return probabilities(logits).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """softmax(logits) in float32 (a no-op ``float`` would still cost a dispatch)."""
    return (logits if logits.dtype == torch.float32 else logits.float()).softmax(-1)


_NUMPY_FLOATS = frozenset({torch.float16, torch.float32, torch.float64})  # numpy has no bfloat16


def on_host(scores: torch.Tensor) -> bool:
    """Whether ``scores`` is a CPU tensor numpy can view: where the host paths below apply
    (a small numpy op costs a few times less than torch's on a CPU host)."""
    return scores.device.type == "cpu" and scores.dtype in _NUMPY_FLOATS


def argmax_last(scores: torch.Tensor) -> torch.Tensor:
    """The index of the maximum along the last dimension (ties: the lowest; a NaN counts as
    the maximum), as ``torch.argmax``. On the CPU it is numpy's argmax, which gives the
    same indices two to four times faster than torch's reductions along a last dimension
    (16 x 32 positions of 85 ids: 32 us against 60 with two threads and 115 with one; of
    32,000 ids: 7 ms against 15-22); elsewhere ``max``, faster than ``argmax`` there too."""
    if on_host(scores):
        return torch.from_numpy(scores.numpy().argmax(-1))
    return scores.max(-1).indices


def greedy_tokens(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Argmax per position over every id but the mask id (ties: lowest id): the argmax of a
    copy of ``logits`` whose mask column is -inf (a few ops, no read back to an accelerator)."""
    scores = logits.clone()
    scores.select(-1, mask_id).fill_(float("-inf"))
    return argmax_last(scores)


def greedy(logits: torch.Tensor, mask_id: int) -> Proposal:
    tokens = greedy_tokens(logits, mask_id)
    return Proposal(tokens, token_probability(logits, tokens))


def greedy_on_host(logits: torch.Tensor, mask_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``greedy``'s tokens and confidences as numpy arrays, for logits ``on_host``: the same
    values with a third of the host ops. The argmax runs on the logits themselves; only the
    positions whose argmax is the mask id (rare) are argmaxed again without it."""
    scores = logits.numpy()
    tokens = scores.argmax(-1)
    chose_mask = tokens == mask_id
    others = scores[chose_mask]  # a copy, empty unless the argmax is the mask id somewhere (no ``any``:
    # on a CPU host, the first numpy reduction after a forward costs ~25 us to bring back)
    if others.size:
        others[:, mask_id] = -np.inf
        tokens[chose_mask] = others.argmax(-1)
    probs = probabilities(logits).numpy()
    vocab = probs.shape[-1]
    confidence = probs.reshape(-1, vocab)[np.arange(tokens.size), tokens.reshape(-1)]
    return tokens, confidence.reshape(tokens.shape)


def categorical(
    logits: torch.Tensor,
    mask_id: int,
    params: Sequence[TopKTopPParams],
    noise: Sequence[RowNoise | None],
    greedy_proposal: Proposal | None = None,
) -> Proposal:
    """Greedy rows as ``greedy`` (or ``greedy_proposal`` if given); sampling rows drawn from
    their tempered, top-k/top-p filtered distribution (inverse CDF, one draw per position)."""
    proposal = greedy(logits, mask_id) if greedy_proposal is None else greedy_proposal
    rows, temperature = sampling_rows(params, logits.device)
    if not rows:
        return proposal
    tokens, confidence = proposal.tokens.clone(), proposal.confidence.clone()
    scaled = logits[rows].float() / temperature[rows, None, None].float()
    scaled[..., mask_id] = float("-inf")
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = _filtered_probs(ordered, [params[row] for row in rows])
    cdf = probs.cumsum(-1)
    draw = uniform_rows(noise, rows, (logits.shape[1],), logits.device, torch.float32)
    pick = (cdf < draw.unsqueeze(-1) * cdf[..., -1:]).sum(-1, keepdim=True)
    tokens[rows] = order.gather(-1, pick).squeeze(-1)
    confidence[rows] = probs.gather(-1, pick).squeeze(-1)
    return Proposal(tokens, confidence)


def _filtered_probs(ordered: torch.Tensor, params: Sequence[TopKTopPParams]) -> torch.Tensor:
    """Probabilities over logits sorted in descending order after top-k, then top-p
    (top-p measured on the top-k distribution, as LLaDA2.0 does)."""
    vocab = ordered.shape[-1]
    rank = torch.arange(vocab, device=ordered.device)
    top_k = per_row(params, "top_k", ordered.device, torch.long)
    top_k = torch.where(top_k > 0, top_k, vocab)
    ordered = ordered.masked_fill(rank >= top_k[:, None, None], float("-inf"))
    probs = ordered.softmax(-1)
    top_p = per_row(params, "top_p", ordered.device, torch.float32)[:, None, None]
    mass_before = probs.cumsum(-1) - probs
    keep = (mass_before <= top_p) | (top_p >= 1)
    return ordered.masked_fill(~keep, float("-inf")).softmax(-1)


def gumbel_tokens(
    logits: torch.Tensor,
    mask_id: int,
    params: Sequence[AlgorithmParams],
    noise: Sequence[RowNoise | None],
) -> torch.Tensor:
    """LLaDA's Gumbel-max draw at each row's temperature (greedy where it is 0).

    argmax exp(l) / (-log u)^T is computed as argmax l - T log(-log u): the same argmax,
    without overflowing exp.
    """
    tokens = greedy_tokens(logits, mask_id)
    rows, temperature = sampling_rows(params, logits.device)
    if rows:
        u = uniform_rows(noise, rows, tuple(logits.shape[1:]), logits.device, torch.float64)
        scores = logits[rows].double() - temperature[rows, None, None] * torch.log(-torch.log(u))
        scores[..., mask_id] = float("-inf")
        tokens[rows] = argmax_last(scores)
    return tokens


def gumbel(
    logits: torch.Tensor,
    mask_id: int,
    params: Sequence[AlgorithmParams],
    noise: Sequence[RowNoise | None],
) -> Proposal:
    tokens = gumbel_tokens(logits, mask_id, params, noise)
    return Proposal(tokens, token_probability(logits, tokens))
