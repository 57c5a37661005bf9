"""Dream's reference sampler (``diffusion_generate`` of Dream-v0, ``generation_utils.py``).

Dream denoises its canvas in ``steps`` steps on the time grid ``linspace(1, eps, steps + 1)``
(float32). At step i, with t and s the grid's i-th and (i+1)-th points and m the masks
left, it unmasks ``int(m * (1 - s / t))`` positions (all that are left at the last step):
the most confident ones, or, with ``alg_temp`` > 0, a draw without replacement from
softmax(confidence / alg_temp). The confidence (``alg``):

* ``maskgit_plus``: the proposed token's probability;
* ``topk_margin``: the top-1 minus the top-2 probability;
* ``entropy``: the negative entropy sum(p log(p + 1e-10)) (Dream's README example);
* ``origin``: no confidence: each masked position is unmasked with probability 1 - s/t.

Tokens are the argmax (temperature 0) or drawn from softmax(logits / temperature) after
Dream's top-p, then top-k filter, which also shape the probabilities the confidence reads.

Here the canvas is one block and ``steps`` counts its steps: with the full canvas and a
block as long as the answer this is Dream's generation; with several blocks, each block
runs the schedule in turn. Dream's schedule may unmask nothing at a step (with ``steps``
near the number of masks, its first step does so), so this rule does not fill a mask at
every step; it finishes a block in ``steps`` forwards. Unlike Dream, a proposed token is
never the mask id.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .base import AlgorithmError, AlgorithmStep, DllmAlgorithm, check_number, register, short_repr
from .fixed_steps import MAX_STEPS
from .sampling import RowNoise, TopKTopPParams, greedy_tokens, sampling_rows, uniform_rows
from .selection import masked_confidence, per_row, top_n

ALGS = ("entropy", "maskgit_plus", "topk_margin", "origin")
ENTROPY_EPSILON = 1e-10


@dataclasses.dataclass(frozen=True)
class DreamParams(TopKTopPParams):
    steps: int = 32
    alg: str = "entropy"
    alg_temp: float = 0.0
    eps: float = 1e-3

    def validate(self) -> None:
        super().validate()
        check_number("steps", self.steps, minimum=1, maximum=MAX_STEPS, integer=True)
        if not isinstance(self.alg, str) or self.alg not in ALGS:
            raise AlgorithmError(f"alg must be one of {ALGS}, got {short_repr(self.alg)}", param="alg")
        check_number("alg_temp", self.alg_temp, minimum=0, maximum=100)
        check_number("eps", self.eps, minimum=0, maximum=1, exclusive_minimum=True)


class DreamState(NamedTuple):
    noise: RowNoise | None
    steps_taken: int = 0


@register
class Dream(DllmAlgorithm):
    name = "dream"
    params_class = DreamParams
    fills_every_step = False

    def init_state(self, params: DreamParams, block_index: int) -> DreamState:
        return DreamState(RowNoise.for_block(params.seed, block_index) if self.draws_noise(params) else None)

    def draws_noise(self, params: DreamParams) -> bool:
        return params.temperature > 0 or params.alg_temp > 0 or params.alg == "origin"

    def max_steps_per_block(self, params: DreamParams, block_length: int) -> int:
        # the last scheduled step unmasks whatever is left; one more forward sees the block whole
        return params.steps + 1

    def step(
        self,
        logits: torch.Tensor,
        block: torch.Tensor,
        mask_id: int,
        params: Sequence[DreamParams],
        states: Sequence[DreamState],
    ) -> AlgorithmStep:
        masked = block == mask_id
        remaining = masked.sum(-1)
        noise = [state.noise for state in states]
        probs = _probabilities(logits, params)
        tokens = _tokens(logits, probs, mask_id, params, noise)
        ratio, last = _transfer_ratio(params, states, block.device)
        quota = torch.where(last, remaining, (remaining.float() * ratio).long())
        chosen = torch.zeros_like(masked)
        for alg in {p.alg for p in params}:
            rows = [i for i, p in enumerate(params) if p.alg == alg]
            if alg == "origin":
                draw = uniform_rows(noise, rows, (block.shape[1],), block.device, torch.float32)
                chosen[rows] = masked[rows] & ((draw < ratio[rows, None]) | last[rows, None])
                continue
            confidence = masked_confidence(_confidence(alg, probs[rows], tokens[rows]), masked[rows])
            chosen[rows] = top_n(_sampled_keys(confidence, [params[i] for i in rows], [noise[i] for i in rows]),
                                 quota[rows])
        block.copy_(torch.where(chosen, tokens, block))
        return AlgorithmStep(remaining == 0, [state._replace(steps_taken=state.steps_taken + 1) for state in states])


def _probabilities(logits: torch.Tensor, params: Sequence[DreamParams]) -> torch.Tensor:
    """softmax of the tempered logits after Dream's top-p, then top-k filter (float32); the
    mask id keeps its share, as in Dream, so the confidences are Dream's."""
    scaled = logits.float().clone()
    rows, temperature = sampling_rows(params, logits.device)
    if rows:
        scaled[rows] /= temperature[rows, None, None].float()
    for row, p in enumerate(params):
        if p.top_p < 1:
            ordered, order = scaled[row].sort(dim=-1, descending=True)
            probs = ordered.softmax(-1)
            mass_before = probs.cumsum(-1) - probs
            scaled[row] = scaled[row].scatter(-1, order, ordered.masked_fill(mass_before > p.top_p, float("-inf")))
        if p.top_k > 0:
            kth = scaled[row].topk(min(p.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
            scaled[row] = scaled[row].masked_fill(scaled[row] < kth, float("-inf"))
    return scaled.softmax(-1)


def _tokens(logits: torch.Tensor, probs: torch.Tensor, mask_id: int, params: Sequence[DreamParams],
            noise: Sequence[RowNoise | None]) -> torch.Tensor:
    """Argmax, or a categorical draw (inverse CDF) in the rows that sample; never the mask
    id (where the filters left only the mask, the argmax of the other tokens)."""
    tokens = greedy_tokens(logits, mask_id)
    rows, _ = sampling_rows(params, probs.device)
    if rows:
        cdf = probs[rows].index_fill(-1, torch.tensor([mask_id], device=probs.device), 0.0).cumsum(-1)
        draw = uniform_rows(noise, rows, (probs.shape[1],), probs.device, torch.float32)
        pick = (cdf < draw.unsqueeze(-1) * cdf[..., -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)
        tokens[rows] = torch.where(cdf[..., -1] > 0, pick, tokens[rows])
    return tokens


def _confidence(alg: str, probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    if alg == "maskgit_plus":
        return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if alg == "topk_margin":
        top = probs.topk(2, dim=-1).values
        return top[..., 0] - top[..., 1]
    return (probs * torch.log(probs + ENTROPY_EPSILON)).sum(-1)  # entropy


def _transfer_ratio(params: Sequence[DreamParams], states: Sequence[DreamState],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, on ``device``: 1 - s/t of its current step on Dream's float32 time grid, and
    whether the step is its last scheduled one (which unmasks everything left)."""
    ratios, last = [], []
    for p, state in zip(params, states):
        i = min(state.steps_taken, p.steps - 1)
        ratios.append(_transfer_ratios(p.steps, p.eps)[i])
        last.append(i == p.steps - 1)
    return torch.stack(ratios).to(device), torch.tensor(last, device=device)


@functools.lru_cache(maxsize=64)
def _transfer_ratios(steps: int, eps: float) -> torch.Tensor:
    """1 - s/t of every step of Dream's float32 time grid ``linspace(1, eps, steps + 1)``."""
    grid = torch.linspace(1, eps, steps + 1)
    return 1 - grid[1:] / grid[:-1]


def _sampled_keys(confidence: torch.Tensor, params: Sequence[DreamParams],
                  noise: Sequence[RowNoise | None]) -> torch.Tensor:
    """The keys whose top-n is the choice: the confidence, or, in rows with ``alg_temp`` > 0,
    confidence / alg_temp plus Gumbel noise (a draw without replacement from
    softmax(confidence / alg_temp), as Dream's multinomial)."""
    rows = [row for row, p in enumerate(params) if p.alg_temp > 0]
    if not rows:
        return confidence
    alg_temp = per_row(params, "alg_temp", confidence.device, torch.float32)
    keys = confidence.clone()
    u = uniform_rows(noise, rows, (confidence.shape[1],), confidence.device, torch.float32)
    gumbel = -torch.log(-torch.log(u.clamp(min=1e-20)))
    keys[rows] = confidence[rows] / alg_temp[rows, None] + gumbel
    return keys
