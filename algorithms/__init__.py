"""Denoise algorithms: how one step picks tokens. Importing the package registers all rules."""

from . import d2f, dream, fast_dllm_factor, fast_dllm_threshold, fixed_steps, joint_threshold, low_confidence
from .base import (
    AlgorithmError,
    AlgorithmParams,
    AlgorithmStep,
    DllmAlgorithm,
    available_algorithms,
    get_algorithm,
    register,
)

__all__ = [
    "AlgorithmError",
    "AlgorithmParams",
    "AlgorithmStep",
    "DllmAlgorithm",
    "available_algorithms",
    "get_algorithm",
    "register",
    "d2f",
    "dream",
    "fast_dllm_factor",
    "fast_dllm_threshold",
    "fixed_steps",
    "joint_threshold",
    "low_confidence",
]
