"""Registry, published defaults, parameter validation and step bounds."""

import dataclasses

import pytest

import algorithms
from algorithms import AlgorithmError, available_algorithms, get_algorithm

DEFAULTS = {
    "low_confidence": {"threshold": 0.95, "temperature": 0.0, "top_k": 0, "top_p": 1.0},
    "joint_threshold": {
        "threshold": 0.5,
        "edit_threshold": 0.0,
        "max_post_edit_steps": 16,
        "penalty_lambda": 0.0,
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
    },
    "fast_dllm_threshold": {"threshold": 0.9, "temperature": 0.0},
    "fast_dllm_factor": {"factor": 1.0, "temperature": 0.0},
    "fixed_steps": {"steps": 32, "remasking": "low_confidence", "schedule": "masks", "threshold": 1.0,
                    "temperature": 0.0},
    "dream": {"steps": 32, "alg": "entropy", "alg_temp": 0.0, "eps": 1e-3, "temperature": 0.0, "top_k": 0,
              "top_p": 1.0},
    "d2f": {"block_add_threshold": 0.5, "decoded_token_threshold": 0.95, "skip_threshold": 0.9, "temperature": 0.0,
            "top_k": 0, "top_p": 1.0},
}


def test_all_rules_are_registered():
    assert available_algorithms() == sorted(DEFAULTS)
    for name in DEFAULTS:
        assert get_algorithm(name).name == name


def test_unknown_algorithm_is_rejected():
    with pytest.raises(AlgorithmError, match="unknown algorithm"):
        get_algorithm("no_such_rule")


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_published_defaults(name):
    params = get_algorithm(name).make_params()
    values = dataclasses.asdict(params)
    assert values.pop("seed") is None
    assert values == DEFAULTS[name]


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_params_are_frozen_and_overridable(name):
    params = get_algorithm(name).make_params({"temperature": 0.5, "seed": 3})
    assert (params.temperature, params.seed) == (0.5, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_unknown_key_is_rejected(name):
    with pytest.raises(AlgorithmError, match="unknown parameter"):
        get_algorithm(name).make_params({"thresold": 0.5})


BAD_VALUES = [
    ("low_confidence", "threshold", 1.5),
    ("low_confidence", "threshold", -0.1),
    ("low_confidence", "threshold", "high"),
    ("low_confidence", "threshold", float("nan")),
    ("low_confidence", "top_k", -2),
    ("low_confidence", "top_k", 2.5),
    ("low_confidence", "top_p", -0.1),
    ("low_confidence", "top_p", 1.1),
    ("low_confidence", "temperature", -1.0),
    ("low_confidence", "temperature", float("inf")),
    ("low_confidence", "seed", 1.5),
    ("low_confidence", "seed", True),
    ("joint_threshold", "edit_threshold", 2.0),
    ("joint_threshold", "max_post_edit_steps", -1),
    ("joint_threshold", "max_post_edit_steps", 1.0),
    ("joint_threshold", "penalty_lambda", -0.5),
    ("fast_dllm_threshold", "threshold", 1.01),
    ("d2f", "skip_threshold", 1.5),
    ("d2f", "block_add_threshold", -0.1),
    ("fast_dllm_factor", "factor", 0.0),
    ("fast_dllm_factor", "factor", -1.0),
    ("fixed_steps", "steps", 0),
    ("fixed_steps", "steps", True),
    ("fixed_steps", "remasking", "entropy"),
    ("fixed_steps", "schedule", "tokens"),
    ("fixed_steps", "threshold", 1.5),
    ("fixed_steps", "temperature", "hot"),
    ("dream", "alg", "low_confidence"),
    ("dream", "alg_temp", -1.0),
    ("dream", "eps", 0.0),
    ("dream", "steps", 0),
]


@pytest.mark.parametrize(("name", "key", "value"), BAD_VALUES)
def test_bad_values_are_rejected(name, key, value):
    with pytest.raises(AlgorithmError, match=key):
        get_algorithm(name).make_params({key: value})


@pytest.mark.parametrize(
    ("name", "overrides", "block_length", "expected"),
    [
        ("low_confidence", {}, 32, 33),
        ("fast_dllm_threshold", {}, 4, 5),
        ("fast_dllm_factor", {}, 32, 33),
        ("joint_threshold", {}, 32, 49),
        ("joint_threshold", {"max_post_edit_steps": 0}, 4, 5),
        ("fixed_steps", {}, 32, 33),
        ("fixed_steps", {"steps": 8}, 32, 9),
        ("fixed_steps", {}, 4, 5),
        ("dream", {}, 32, 33),
        ("dream", {"steps": 8}, 32, 9),
        ("dream", {"steps": 64}, 32, 65),
    ],
)
def test_max_steps_per_block(name, overrides, block_length, expected):
    algorithm = get_algorithm(name)
    params = algorithm.make_params(overrides)
    assert algorithm.max_steps_per_block(params, block_length) == expected
    assert algorithm.worst_case_steps(params, block_length, fused_commit=False) == expected
    # a fused commit skips the forward after the last fill, unless the rule may edit then
    fused = expected - (name != "joint_threshold")
    assert algorithm.worst_case_steps(params, block_length, fused_commit=True) == fused


def test_package_reexports_base_api():
    for symbol in ("AlgorithmError", "AlgorithmParams", "DllmAlgorithm", "register"):
        assert hasattr(algorithms, symbol)
