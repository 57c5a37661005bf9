"""Log-probabilities of the tokens a request commits, for the API's ``logprobs``.

A dLLM does not choose its tokens left to right: a block's positions are unmasked over
several steps, each under that step's distribution. A committed token's log-probability is
the model's (log-softmax of the logits, before any temperature or top-k/top-p of the
algorithm) at the position, in the step that wrote the token there: the step that unmasked
it, or, for an algorithm that edits unmasked tokens, the step that last changed it. Only
requests that ask for them pay for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the records cross to the ingress, which needs no torch
    import torch

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability and the ``top`` most likely tokens at its step:
    ``(token id, log-probability)``, the most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def step_logprobs(top_k: list[int], logits: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
                  mask_id: int) -> list[list[tuple[int, TokenLogprob]]]:
    """After a denoise step of some rows: for each row, the positions whose token the step
    wrote (``before`` != ``after``, not a mask) with that token's ``TokenLogprob``.

    ``logits`` [R, L, V] of the step, ``before`` / ``after`` [R, L] the blocks around it,
    ``top_k[row]``: alternatives that row asked for."""
    import torch

    written = (before != after) & (after != mask_id)
    rows, positions = written.nonzero(as_tuple=True)
    found: list[list[tuple[int, TokenLogprob]]] = [[] for _ in top_k]
    if len(rows) == 0:
        return found
    log_probs = torch.log_softmax(logits[rows, positions].float(), dim=-1)
    chosen = log_probs.gather(-1, after[rows, positions].unsqueeze(-1)).squeeze(-1).tolist()
    most = max(top_k[r] for r in rows.tolist())
    top_values, top_ids = log_probs.topk(most, dim=-1) if most else (None, None)
    for i, (row, position) in enumerate(zip(rows.tolist(), positions.tolist())):
        k = top_k[row]
        top = tuple(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist())) if k else ()
        found[row].append((position, TokenLogprob(chosen[i], top)))
    return found
