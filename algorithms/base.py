"""The interface every denoise algorithm implements, and the registry by name.

An algorithm decides, for one denoise step, which positions of each row's active
block get filled (mask -> token) or edited (token -> token). It is pure tensor code:
it never knows how rows were scheduled (FDFO, sync or static) and never sees the
prompt or committed blocks, so it cannot modify them.

Conventions shared by every implementation:

* ``block`` is ``LongTensor[B, L]``: the tokens of each row's active block exactly as
  they were fed to the forward that produced ``logits`` (``FloatTensor[B, L, V]``).
  ``step`` updates ``block`` in place (the caller's buffer for the step's tokens) and
  returns an ``AlgorithmStep``: ``done``, ``BoolTensor[B]``, True where the row's block is
  done, or None where a block is done exactly when it was fed with no mask (the caller
  knows which before the step, and the step saves the ops that would say it); and the
  rows' states for their next step.
* A block is done when the forward saw it with no mask left, so the KV computed in
  that forward is the block's final KV (algorithms that edit may wait longer).
  ``final_when_filled``: that last forward can change nothing (the rule never edits a
  filled position), so the engine may commit a block at the step that fills its last
  mask and write its final KV in the row's next forward (``EngineConfig.fused_commit``).
  A row that still has masks must get at least one position filled, unless the rule's
  ``fills_every_step`` is False (a schedule that may skip a step, like Dream's, and bounds
  its forwards with ``max_steps_per_block`` instead).
* Per-request parameters are frozen dataclasses made by ``make_params``; per-block
  state comes from ``init_state`` (called when a block starts) and is a value: ``step``
  reads it and returns each row's next one (``AlgorithmStep.states``), which the caller
  keeps for the row's next step (the engine's scheduler, the one writer of request state).
  A state's noise (``sampling.RowNoise``) is a random stream: drawing from it advances it.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import torch


# Bounds every algorithm applies to the common parameters (docs/api.md "Request bounds").
MAX_SEED = 2**63 - 1  # seeds are 63-bit, like the ones the ingress draws
MAX_TEMPERATURE = 100.0  # sampling is as good as uniform long before this
MIN_TEMPERATURE = 1e-4  # the smallest positive temperature (logits / T stays finite in float32); below: greedy


class AlgorithmError(ValueError):
    """An unknown algorithm name or an invalid parameter value; ``param``: the parameter's
    name where one parameter is at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def short_repr(value: Any) -> str:
    """``repr(value)``, shortened (and safe for integers too long to print)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "a number of more than 4300 digits"
    return text if len(text) <= 40 else text[:37] + "..."


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    integer: bool = False,
) -> None:
    """Raise AlgorithmError unless ``value`` is a finite number (an int if ``integer``) in range."""
    kinds = (int,) if integer else (int, float)
    finite = not isinstance(value, float) or math.isfinite(value)
    if isinstance(value, bool) or not isinstance(value, kinds) or not finite:
        kind = "an integer" if integer else "a finite number"
        raise AlgorithmError(f"{name} must be {kind}, got {short_repr(value)}", param=name)
    if minimum is not None and (value <= minimum if exclusive_minimum else value < minimum):
        relation = ">" if exclusive_minimum else ">="
        raise AlgorithmError(f"{name} must be {relation} {minimum}, got {short_repr(value)}", param=name)
    if maximum is not None and value > maximum:
        raise AlgorithmError(f"{name} must be <= {maximum}, got {short_repr(value)}", param=name)


@dataclasses.dataclass(frozen=True)
class AlgorithmParams:
    """Parameters common to every algorithm; subclasses add their own fields."""

    temperature: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, float) and 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # below the smallest supported: greedy (as vLLM's)

    def validate(self) -> None:
        check_number("temperature", self.temperature, minimum=0, maximum=MAX_TEMPERATURE)
        if self.seed is not None:
            check_number("seed", self.seed, minimum=0, maximum=MAX_SEED, integer=True)


class AlgorithmStep(NamedTuple):
    """What one step of a rule returns (see the module docstring)."""

    done: torch.Tensor | None = None  # [B] bool; None: done where the block was fed with no mask
    states: list | None = None  # each row's state for its next step; None: the states stay as they are


UNCHANGED = AlgorithmStep()  # done where fed with no mask, states as they are (the stateless rules' step)


class DllmAlgorithm(ABC):
    """One token-selection rule; subclasses are stateless singletons."""

    name: ClassVar[str]
    params_class: ClassVar[type[AlgorithmParams]] = AlgorithmParams
    final_when_filled: ClassVar[bool] = True  # see the module docstring; False for rules that edit
    fills_every_step: ClassVar[bool] = True  # see the module docstring
    # several blocks of a request decode at once (``d2f``: it says when a block joins and when
    # one is complete, ``adds_block`` and ``completes_next``); the engine commits them in order
    pipelined: ClassVar[bool] = False

    def make_params(self, overrides: Mapping[str, Any] | None = None) -> AlgorithmParams:
        """Published defaults with per-request ``overrides``; rejects unknown keys and bad values."""
        overrides = dict(overrides or {})
        known = {f.name for f in dataclasses.fields(self.params_class)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise AlgorithmError(
                f"unknown parameter(s) {unknown} for algorithm {self.name!r}; "
                f"known: {sorted(known)}",
                param=unknown[0] if len(unknown) == 1 else None,
            )
        try:
            params = self.params_class(**overrides)
        except TypeError as exc:  # pragma: no cover - dataclass signature errors
            raise AlgorithmError(str(exc)) from exc
        params.validate()
        return params

    def init_state(self, params: AlgorithmParams, block_index: int) -> Any | None:
        """Fresh per-row state for a block that starts now; None for stateless rules."""
        return None

    def draws_noise(self, params: AlgorithmParams) -> bool:
        """Whether a block run with ``params`` draws random numbers (seeded by ``params.seed``);
        where it does not, any seed gives the same tokens."""
        return params.temperature > 0

    @abstractmethod
    def max_steps_per_block(self, params: AlgorithmParams, block_length: int) -> int:
        """Worst-case number of forwards one block can take, the one that sees it unmasked
        included (for admission cost)."""

    def worst_case_steps(self, params: AlgorithmParams, block_length: int, fused_commit: bool) -> int:
        """``max_steps_per_block``, less that last forward where a fused commit skips it."""
        return self.max_steps_per_block(params, block_length) - (fused_commit and self.final_when_filled)

    @abstractmethod
    def step(
        self,
        logits: torch.Tensor,
        block: torch.Tensor,
        mask_id: int,
        params: Sequence[AlgorithmParams],
        states: Sequence[Any | None],
    ) -> AlgorithmStep:
        """Fill/edit ``block`` in place from ``logits``, reading the rows' ``states``; the
        rows' done flags and next states (see the module docstring)."""


_REGISTRY: dict[str, DllmAlgorithm] = {}


def register(cls: type[DllmAlgorithm]) -> type[DllmAlgorithm]:
    """Class decorator: make ``cls`` available by its ``name``."""
    _REGISTRY[cls.name] = cls()
    return cls


def get_algorithm(name: str) -> DllmAlgorithm:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise AlgorithmError(
            f"unknown algorithm {name!r}; available: {available_algorithms()}"
        ) from None


def available_algorithms() -> list[str]:
    return sorted(_REGISTRY)
