"""Fill timeouts: how long a batch may wait for arrivals (derivation: tools/capacity/FILL_TIMEOUT.md).

Pure functions of the arrival rate λ (requests per second), the step cost c0 + c1·b
seconds, and the steps-per-block and blocks-per-request distributions ({level: weight}).
numpy only; the fixed-fill model is cached per (rounded) input, so the engine may call
``optimal_fill_timeout`` at every batch start.

* ``optimal_fill_timeout``: the τ of fixed-fill synchronized batching that minimizes the
  modelled mean latency (an embedded Markov chain at batch ends, ``modelled_mean_latency``).
* ``fdfo_hold``: how long an under-filled FDFO step may wait for arrivals.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Mapping

import numpy as np

MAX_LOAD = 0.95  # the model is evaluated at min(λ, MAX_LOAD x capacity)
TIE = 0.005  # the least τ whose modelled mean latency is within 0.5% of the minimum wins
_GRID = np.concatenate([[0.0], np.geomspace(1 / 256, 2.0, 28)])  # τ / expected fill time
_MAX_STATES = 600  # queue lengths the chain tracks at most
_LAMBDA_STEP = 1.02  # λ is rounded to this geometric grid, so repeated calls hit the cache


def _frozen(dist: Mapping[int, float] | None) -> tuple[tuple[int, float], ...]:
    pairs = [(int(k), float(v)) for k, v in (dist or {}).items() if float(v) > 0 and int(k) > 0]
    total = sum(v for _, v in pairs)
    return tuple(sorted((k, v / total) for k, v in pairs))


@lru_cache(maxsize=32)
def _rounds(max_batch: int, steps: tuple, blocks: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps of a batch-synchronous batch of b = 0..max_batch requests: mean and variance
    of the batch's steps (sum over block rounds of the max over rows still running; the
    variance treats rounds as independent), and the mean steps until a member finishes."""
    s_levels, s_p = np.array(steps).T
    k_levels, k_p = np.array(blocks).T
    tail = np.array([s_p[s_levels >= x].sum() for x in range(1, int(s_levels.max()) + 1)])  # P(s >= x)
    reach = np.array([k_p[k_levels >= j].sum() for j in range(1, int(k_levels.max()) + 1)])  # P(k >= j)
    miss = 1.0 - reach[:, None] * tail[None, :]  # P(a row is not at step x of round j)
    b = np.arange(max_batch + 1)[:, None, None]
    at_least = 1.0 - miss[None] ** b  # P(round j lasts >= x steps)
    x = np.arange(1, len(tail) + 1)
    round_mean = at_least.sum(axis=2)
    round_square = (at_least * (2 * x - 1)).sum(axis=2)
    member = (reach[:, None] * (1.0 - (1.0 - tail) * miss ** np.maximum(b - 1, 0))).sum(axis=(1, 2))
    member[0] = 0.0
    return round_mean.sum(axis=1), (round_square - round_mean ** 2).sum(axis=1), member


def batch_capacity(max_batch: int, c0: float, c1: float, steps_per_block: Mapping[int, float],
                   blocks_per_request: Mapping[int, float]) -> float:
    """Requests per second of a replica running full batch-synchronous batches back to back
    (inf when a batch costs nothing or the distributions are empty)."""
    steps, blocks = _frozen(steps_per_block), _frozen(blocks_per_request)
    if max_batch < 1 or not steps or not blocks:
        return math.inf
    busy = (c0 + c1 * max_batch) * _rounds(max_batch, steps, blocks)[0][max_batch]
    return max_batch / busy if busy > 0 else math.inf


def _counts(mean: np.ndarray, var: np.ndarray, n: int) -> np.ndarray:
    """pmf over 0..n (P(>= n) at n) of Poisson arrivals during a gamma-distributed time of
    that mean and variance of the Poisson mean: negative binomial, or Poisson if var = 0."""
    k = np.arange(n)[None, :]
    mean, var = mean[:, None], var[:, None]
    over = var > 1e-12 * np.maximum(mean, 1e-300) ** 2
    shape = np.where(over, mean ** 2 / np.where(over, var, 1.0), 1.0)
    p = mean / (shape + mean)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(over, (k + shape) / (k + 1) * p, mean / (k + 1))
        first = np.where(over, np.exp(shape * np.log1p(-np.minimum(p, 1 - 1e-300))), np.exp(-mean))
    pmf = first * np.concatenate([np.ones_like(mean), np.cumprod(ratio, axis=1)[:, :-1]], axis=1)
    pmf[pmf < 1e-30] = 0.0  # subnormal numbers would slow every solve down a hundredfold
    return np.concatenate([pmf, np.maximum(0.0, 1.0 - pmf.sum(axis=1, keepdims=True))], axis=1)


class _Chain:
    """The embedded chain at batch ends for one λ: the τ-free parts, ready for many τ.

    State: Q, requests waiting when a batch ends. From Q >= B the next batch is full at
    once; from Q < B it forms (first arrival, then until B wait or the oldest has waited
    τ). Per cycle (batch end to batch end) the rewards are [waiting integral, cycle
    length, batch size, batch size x mean in-batch latency].
    """

    def __init__(self, lam: float, max_batch: int, c0: float, c1: float, rounds):
        mean, var, member = rounds
        B = max_batch
        b = np.arange(B + 1)
        step = c0 + c1 * b
        self.lam, self.B = lam, B
        self.T = step * mean  # mean service of a batch of b
        T2 = step ** 2 * (var + mean ** 2)
        arrivals_var = lam * self.T + lam ** 2 * step ** 2 * var
        spare = B - lam * self.T[B]
        n = min(_MAX_STATES, 2 * B + 20 + math.ceil(6 * arrivals_var[B] / spare))
        self.A = _counts(lam * self.T, lam ** 2 * step ** 2 * var, n)  # [b, Q'] arrivals in service
        self.per_batch = np.stack([lam * T2 / 2, self.T, b.astype(float), b * step * member], axis=1)
        # Q >= B: a full batch at once, the rest (Q - B) carried over
        left = np.arange(n + 1 - B)
        shift = np.arange(n + 1)[None, :] - left[:, None]  # arrivals that lead from B + i to Q'
        full = np.where(shift >= 0, self.A[B, np.clip(shift, 0, n)], 0.0)
        full[:, n] = 1.0 - full[:, :n].sum(axis=1)
        full_rewards = np.outer(np.ones_like(left), self.per_batch[B])
        full_rewards[:, 0] += left * self.T[B]
        # an excursion above B: where it comes back below B, and what it collects on the way
        back = np.linalg.solve(np.eye(n + 1 - B) - full[:, B:], np.hstack([full[:, :B], full_rewards]))
        self.to_low, self.excursion = back[:, :B], back[:, B:]

    def latency(self, taus: np.ndarray) -> np.ndarray:
        """Modelled mean latency for each τ (renewal reward over the censored chain Q < B)."""
        B = self.B
        q = np.arange(B)
        # the Q waiting arrived during the last batch, most likely Q/λ long (clipped to what
        # a batch can last); Q uniform arrivals in it make the oldest this old on average
        age = np.clip(q / self.lam, self.T[1], self.T[B]) * q / (q + 1)
        remaining = np.maximum(0.0, taus[:, None] - age)
        remaining[:, 0] = taus
        batch, rewards = self._formation(remaining)
        low = batch @ self.A  # [tau, Q, Q']
        censored = low[:, :, :B] + low[:, :, B:] @ self.to_low
        totals = rewards + low[:, :, B:] @ self.excursion
        sigma = _stationary(censored)
        wait, cycle, size, inside = (sigma[:, None, :] @ totals)[:, 0].T
        return wait / (self.lam * cycle) + inside / size

    def _formation(self, remaining: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Batch-size pmf [tau, Q, b] and cycle rewards [tau, Q, 4] from Q < B waiting with
        ``remaining`` seconds left on the oldest's timer (Q = 0: idle until an arrival)."""
        B, lam = self.B, self.lam
        first = np.maximum(np.arange(B), 1)
        mu = lam * remaining[:, :, None]
        m = np.arange(B)
        pmf = np.exp(-mu) * np.concatenate(
            [np.ones_like(mu), np.cumprod(mu / np.maximum(m[1:], 1), axis=2)], axis=2)  # N(r) = m
        short = m[None, None, :] < (B - first)[None, :, None]  # still below B after m arrivals
        pmf = pmf * short
        batch = np.zeros(remaining.shape + (B + 1,))
        for Q in range(B):
            batch[:, Q, first[Q]:B] = pmf[:, Q, :B - first[Q]]
        batch[:, :, B] = np.maximum(0.0, 1.0 - pmf.sum(axis=2))
        beyond = (1.0 - np.cumsum(pmf, axis=2)) * short / lam  # integrand of P(N(t) >= m + 1)
        rewards = batch @ self.per_batch
        rewards[:, :, 0] += (beyond * (first[:, None] + m)).sum(axis=2)
        rewards[:, :, 1] += beyond.sum(axis=2)
        rewards[:, 0, 1] += 1.0 / lam
        return batch, rewards


def _stationary(P: np.ndarray) -> np.ndarray:
    """Stationary distributions of a stack of row-stochastic matrices."""
    size = P.shape[-1]
    system = np.swapaxes(P, -1, -2) - np.eye(size)
    system[:, -1, :] = 1.0
    rhs = np.zeros(P.shape[:-1])
    rhs[:, -1] = 1.0
    return np.maximum(np.linalg.solve(system, rhs[..., None])[..., 0], 0.0)


@lru_cache(maxsize=256)
def _chain(lam: float, max_batch: int, c0: float, c1: float, steps: tuple, blocks: tuple) -> _Chain:
    return _Chain(lam, max_batch, c0, c1, _rounds(max_batch, steps, blocks))


def modelled_mean_latency(taus, arrival_rate: float, max_batch: int, c0: float, c1: float,
                          steps_per_block: Mapping[int, float],
                          blocks_per_request: Mapping[int, float]) -> np.ndarray:
    """Mean latency (seconds) of fixed-fill batching at each fill timeout in ``taus``
    under Poisson arrivals of ``arrival_rate``; inf at or beyond capacity."""
    taus = np.atleast_1d(np.asarray(taus, dtype=float))
    steps, blocks = _frozen(steps_per_block), _frozen(blocks_per_request)
    if not steps or not blocks or max_batch < 1 or not arrival_rate > 0:
        raise ValueError("the model needs a positive arrival rate, max_batch >= 1 and both distributions")
    if arrival_rate >= batch_capacity(max_batch, c0, c1, steps_per_block, blocks_per_request):
        return np.full(taus.shape, math.inf)
    return _chain(float(arrival_rate), int(max_batch), float(c0), float(c1), steps, blocks).latency(taus)


def optimal_fill_timeout(arrival_rate: float, max_batch: int, c0: float, c1: float,
                         steps_per_block: Mapping[int, float],
                         blocks_per_request: Mapping[int, float]) -> float:
    """Fill timeout τ (seconds) of fixed-fill batching that minimizes the modelled mean
    latency: the least τ on a grid of 0 and 28 steps up to twice the expected fill time
    (B−1)/λ within 0.5% of the best. λ is capped at 95% of the full-batch capacity and
    rounded to a 2% geometric grid (so repeated calls hit the cache). 0 when there is
    nothing to wait for: λ <= 0 or not finite, max_batch <= 1, empty distributions."""
    steps, blocks = _frozen(steps_per_block), _frozen(blocks_per_request)
    if not (arrival_rate > 0 and math.isfinite(arrival_rate)) or max_batch <= 1 or not steps or not blocks:
        return 0.0
    capacity = batch_capacity(max_batch, c0, c1, steps_per_block, blocks_per_request)
    if not math.isfinite(capacity):
        return 0.0
    lam = _LAMBDA_STEP ** round(math.log(min(arrival_rate, MAX_LOAD * capacity), _LAMBDA_STEP))
    return _best_tau(lam, int(max_batch), float(c0), float(c1), steps, blocks)


@lru_cache(maxsize=1024)
def _best_tau(lam: float, max_batch: int, c0: float, c1: float, steps: tuple, blocks: tuple) -> float:
    taus = _GRID * (max_batch - 1) / lam
    latency = _chain(lam, max_batch, c0, c1, steps, blocks).latency(taus)
    return float(taus[np.argmax(latency <= latency.min() * (1 + TIE))])


def fdfo_hold(arrival_rate: float, rows: int, max_batch: int, c0: float, c1: float) -> float:
    """Seconds an FDFO step with ``rows`` ready rows may wait for arrivals, counted from the
    step boundary: max(0, c0 + c1·rows − rows/λ); 0 with no rows or no free row."""
    if rows < 1 or rows >= max_batch or not arrival_rate > 0 or not math.isfinite(arrival_rate):
        return 0.0
    return max(0.0, c0 + c1 * rows - rows / arrival_rate)
