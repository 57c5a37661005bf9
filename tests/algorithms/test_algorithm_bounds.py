"""Every algorithm parameter is bounded in ``validate``: a value the engine would choke on
(an integer past int64 in a tensor, a temperature that makes logits / T infinite, a
post-edit budget that makes the worst case unbounded) is refused by ``make_params`` with
an ``AlgorithmError`` naming the parameter, and anything accepted runs a step."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo_helpers import step_done
from algorithms import AlgorithmError, available_algorithms, get_algorithm
from algorithms.base import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE
from algorithms.fast_dllm_factor import MAX_FACTOR
from algorithms.fixed_steps import MAX_STEPS
from algorithms.joint_threshold import MAX_PENALTY_LAMBDA, MAX_POST_EDIT_STEPS
from algorithms.sampling import MAX_TOP_K

SAMPLING = ["low_confidence", "joint_threshold", "dream"]  # the rules with top_k / top_p

# (algorithm, parameter, the largest or smallest value accepted, the nearest value refused)
EDGES = [
    *[(name, "seed", MAX_SEED, MAX_SEED + 1) for name in available_algorithms()],
    *[(name, "seed", 0, -1) for name in available_algorithms()],
    *[(name, "temperature", MAX_TEMPERATURE, math.nextafter(MAX_TEMPERATURE, math.inf))
      for name in available_algorithms()],
    *[(name, "temperature", 0, -5e-324) for name in available_algorithms()],
    *[(name, "top_k", MAX_TOP_K, MAX_TOP_K + 1) for name in SAMPLING],
    *[(name, "top_k", -1, -2) for name in SAMPLING],
    *[(name, "top_p", 0, -5e-324) for name in SAMPLING],
    *[(name, "top_p", 1, math.nextafter(1, 2)) for name in SAMPLING],
    ("joint_threshold", "max_post_edit_steps", MAX_POST_EDIT_STEPS, MAX_POST_EDIT_STEPS + 1),
    ("joint_threshold", "penalty_lambda", MAX_PENALTY_LAMBDA, MAX_PENALTY_LAMBDA * 1.001),
    ("fixed_steps", "steps", MAX_STEPS, MAX_STEPS + 1),
    ("fixed_steps", "steps", 1, 0),
    ("dream", "steps", MAX_STEPS, MAX_STEPS + 1),
    ("dream", "alg_temp", 100, 100.001),
    ("dream", "eps", 1, 1.001),
    ("fast_dllm_factor", "factor", MAX_FACTOR, MAX_FACTOR * 1.001),
]


@pytest.mark.parametrize(("name", "key", "accepted", "refused"), EDGES,
                         ids=[f"{n}-{k}-{r}" for n, k, _, r in EDGES])
def test_each_bound_is_inclusive_and_the_next_value_is_refused_naming_the_parameter(name, key, accepted, refused):
    algorithm = get_algorithm(name)
    assert getattr(algorithm.make_params({key: accepted}), key) == accepted
    with pytest.raises(AlgorithmError, match=key) as error:
        algorithm.make_params({key: refused})
    assert error.value.param == key


def test_a_temperature_below_the_smallest_supported_is_greedy():
    """As vLLM takes them: no noise is drawn, and the rule sees temperature 0."""
    for name in available_algorithms():
        algorithm = get_algorithm(name)
        for value in (1e-300, 5e-324, 1e-9, math.nextafter(MIN_TEMPERATURE, 0)):
            params = algorithm.make_params({"temperature": value})
            assert params.temperature == 0 and params == algorithm.make_params({"temperature": 0})
        assert algorithm.make_params({"temperature": MIN_TEMPERATURE}).temperature == MIN_TEMPERATURE


def test_the_issue_case_is_refused_before_it_reaches_a_tensor():
    """joint_threshold, temperature 1, top_k 1e20: was an OverflowError in ``per_row``,
    failing every row of the algorithm in that step."""
    algorithm = get_algorithm("joint_threshold")
    with pytest.raises(AlgorithmError, match="top_k must be <= ") as error:
        algorithm.make_params({"temperature": 1, "top_k": 10 ** 20})
    assert error.value.param == "top_k"
    with pytest.raises(AlgorithmError, match="top_k must be an integer"):
        algorithm.make_params({"temperature": 1, "top_k": 1e20})


def test_an_integer_too_long_to_print_is_refused_with_a_short_message():
    with pytest.raises(AlgorithmError) as error:
        get_algorithm("fixed_steps").make_params({"steps": 10 ** 5000})
    assert error.value.param == "steps" and len(str(error.value)) < 100


def test_unknown_parameter_is_named_when_alone():
    with pytest.raises(AlgorithmError) as error:
        get_algorithm("low_confidence").make_params({"steps": 3})
    assert error.value.param == "steps"


def test_worst_case_steps_are_bounded_by_the_parameter_bounds():
    block = 32
    for name in available_algorithms():
        algorithm = get_algorithm(name)
        worst = {"joint_threshold": {"max_post_edit_steps": MAX_POST_EDIT_STEPS},
                 "fixed_steps": {"steps": MAX_STEPS}, "dream": {"steps": MAX_STEPS}}.get(name, {})
        # Dream's schedule takes all its steps, however few masks a block has
        bound = MAX_STEPS + 1 if name == "dream" else block + MAX_POST_EDIT_STEPS + 1
        assert algorithm.max_steps_per_block(algorithm.make_params(worst), block) <= bound


# Values of every kind for any parameter: boundaries, beyond them, wrong types.
ANY_VALUE = st.one_of(
    st.integers(-(2 ** 70), 2 ** 70),
    st.sampled_from([0, 1, -1, 2, 16, 32, 33, MAX_TOP_K, MAX_TOP_K + 1, MAX_STEPS, MAX_POST_EDIT_STEPS,
                     MAX_POST_EDIT_STEPS + 1, MAX_SEED, MAX_SEED + 1, 2 ** 63, 2 ** 64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, 0.5, 1e-300, MIN_TEMPERATURE, MAX_TEMPERATURE, 1e20, -0.0, 5e-324, 1.7e308]),
    st.sampled_from([None, True, False, "", "random", "low_confidence", [1], {"a": 1}]),
)
# ... and plausible ones, by the type of the parameter's default (seed: an int)
PLAUSIBLE = {float: st.floats(0, 2), int: st.integers(0, 64), str: st.sampled_from(["random", "low_confidence"])}


def _plausible(name: str, key: str):
    default = get_algorithm(name).make_params()
    kind = int if key == "seed" else type(getattr(default, key))
    return PLAUSIBLE[kind]


PARAMETERS = {
    name: sorted(f for f in get_algorithm(name).params_class.__dataclass_fields__) for name in available_algorithms()
}


@st.composite
def overrides(draw):
    name = draw(st.sampled_from(available_algorithms()))
    keys = draw(st.lists(st.sampled_from(PARAMETERS[name]), max_size=4, unique=True))
    return name, {key: draw(ANY_VALUE if draw(st.booleans()) else _plausible(name, key)) for key in keys}


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(overrides())
def test_whatever_make_params_accepts_runs_a_step_beside_a_default_row(case):
    """Accepted parameters never fail the step (nor the other row in it); refused ones
    name a parameter of the algorithm."""
    name, values = case
    algorithm = get_algorithm(name)
    try:
        params = algorithm.make_params(values)
    except AlgorithmError as exc:
        assert exc.param is None or exc.param in PARAMETERS[name]
        return
    rows = [params, algorithm.make_params()]
    vocab, length, mask_id = 11, 8, 10
    block = torch.full((2, length), mask_id)
    block[:, :2] = torch.tensor([1, 2])
    states = [algorithm.init_state(p, 0) for p in rows]
    logits = torch.randn(2, length, vocab, generator=torch.Generator().manual_seed(0)) * 3
    done = step_done(algorithm, logits, block, mask_id, rows, states)
    assert done.shape == (2,) and not done.any()  # both rows had masks
    assert ((block >= 0) & (block < vocab)).all()
    if algorithm.fills_every_step:
        assert (block[:, 2:] != mask_id).any(-1).all()  # each row filled at least one mask
        assert algorithm.max_steps_per_block(params, length) <= length + MAX_POST_EDIT_STEPS + 1
