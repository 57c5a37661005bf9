"""The interface every denoise algorithm implements, and the registry by name.

An algorithm decides, for one denoise step, which positions of each row's active
block get filled (mask -> token) or edited (token -> token). It is pure tensor code:
it never knows how rows were scheduled (FDFO, sync or static) and never sees the
prompt or committed blocks, so it cannot modify them.

Conventions shared by every implementation:

* ``block`` is ``LongTensor[B, L]``: the tokens of each row's active block exactly as
  they were fed to the forward that produced ``logits`` (``FloatTensor[B, L, V]``).
  ``step`` updates ``block`` in place and returns ``BoolTensor[B]``: True where the row's
  block is done.
* A block is done when the forward saw it with no mask left, so the KV computed in
  that forward is the block's final KV (algorithms that edit may wait longer).
  A row that still has masks must get at least one position filled.
* Per-request parameters are frozen dataclasses made by ``make_params``; per-block
  state comes from ``init_state`` (called when a block starts) and is mutated by
  ``step``.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch


class AlgorithmError(ValueError):
    """An unknown algorithm name or an invalid parameter value."""


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
        raise AlgorithmError(f"{name} must be {kind}, got {value!r}")
    if minimum is not None and (value <= minimum if exclusive_minimum else value < minimum):
        relation = ">" if exclusive_minimum else ">="
        raise AlgorithmError(f"{name} must be {relation} {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise AlgorithmError(f"{name} must be <= {maximum}, got {value}")


@dataclasses.dataclass(frozen=True)
class AlgorithmParams:
    """Parameters common to every algorithm; subclasses add their own fields."""

    temperature: float = 0.0
    seed: int | None = None

    def validate(self) -> None:
        check_number("temperature", self.temperature, minimum=0)
        if self.seed is not None:
            check_number("seed", self.seed, integer=True)


class DllmAlgorithm(ABC):
    """One token-selection rule; subclasses are stateless singletons."""

    name: ClassVar[str]
    params_class: ClassVar[type[AlgorithmParams]] = AlgorithmParams

    def make_params(self, overrides: Mapping[str, Any] | None = None) -> AlgorithmParams:
        """Published defaults with per-request ``overrides``; rejects unknown keys and bad values."""
        overrides = dict(overrides or {})
        known = {f.name for f in dataclasses.fields(self.params_class)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise AlgorithmError(
                f"unknown parameter(s) {unknown} for algorithm {self.name!r}; "
                f"known: {sorted(known)}"
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

    @abstractmethod
    def max_steps_per_block(self, params: AlgorithmParams, block_length: int) -> int:
        """Worst-case number of forwards one block can take (for admission cost)."""

    @abstractmethod
    def step(
        self,
        logits: torch.Tensor,
        block: torch.Tensor,
        mask_id: int,
        params: Sequence[AlgorithmParams],
        states: Sequence[Any | None],
    ) -> torch.Tensor:
        """Fill/edit ``block`` in place from ``logits``; return done flags per row."""


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
