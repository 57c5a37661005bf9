"""The shipped tiny model through the engine: mode parity, accuracy, the benchmark's report."""

import pytest

from algorithms import available_algorithms, get_algorithm
from replicas.engine import Engine, EngineConfig
from replicas.models import load_model, load_tokenizer
from replicas.messages import SamplingParams
from replicas.batching import SchedulerMode
from replicas.tiny import task
from tools.bench.engine import BENCH_SEED, SEPARATE_KV, WORKLOADS, bench_engine
from tools.bench.evaluation import evaluate_tiny
from replicas.tiny.task import MAX_TOKENS as TINY_MAX_TOKENS

ALGORITHM_CASES = {
    "low_confidence": {},
    "joint_threshold": {},
    "fast_dllm_threshold": {},
    "fast_dllm_factor": {},
    "fixed_steps": {"steps": 4},
    "dream": {"steps": 8, "alg": "topk_margin"},
    "d2f": {"block_add_threshold": 0.25, "decoded_token_threshold": 0.5, "skip_threshold": 0.6},
    "low_confidence (sampled)": {"temperature": 0.8, "top_p": 0.9, "seed": 11},
    "fixed_steps (sampled)": {"steps": 4, "temperature": 0.7, "seed": 5},
}
PARITY_PROMPTS = 12
REQUESTS = 100  # of one or two puzzles: 2 to 4 blocks each


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny"), load_tokenizer("tiny")


def test_every_algorithm_is_covered():
    assert {name.split(" ")[0] for name in ALGORITHM_CASES} == set(available_algorithms())


@pytest.mark.parametrize("case", ALGORITHM_CASES)
def test_modes_are_byte_identical_at_batch_1(tiny, case):
    """Every scheduler mode produces the same tokens for 12 prompts at batch size 1, and so
    does fdfo with a separate forward to write each block's KV (``fused_commit=False``),
    which takes one more step per block, unless the rule may edit after the last fill."""
    net, tokenizer = tiny
    requests = [r for r in task.heldout_requests() if len(r.puzzles) <= 2][:PARITY_PROMPTS]
    name = case.split(" ")[0]
    params = SamplingParams(max_tokens=TINY_MAX_TOKENS, algorithm=name, algorithm_params=ALGORITHM_CASES[case])
    configs = {mode.value: EngineConfig(mode=mode.value, max_batch=1) for mode in SchedulerMode}
    configs["fdfo, separate KV write"] = EngineConfig(max_batch=1, fused_commit=False)
    outputs = {label: Engine(net, tokenizer, config).generate([r.prompt for r in requests], params)
               for label, config in configs.items()}
    tokens = {label: [o.token_ids for o in runs] for label, runs in outputs.items()}
    assert len(tokens["fdfo"]) == PARITY_PROMPTS and all(tokens["fdfo"])
    assert all(tokens[label] == tokens["fdfo"] for label in configs)
    steps = {label: sum(o.steps for o in outputs[label]) for label in ("fdfo", "fdfo, separate KV write")}
    blocks = sum(len(o.block_steps) for o in outputs["fdfo"])
    saved = blocks if get_algorithm(name).final_when_filled else 0
    if get_algorithm(name).pipelined:  # the blocks decoded ahead go on during the write: at most one a block
        assert 0 < steps["fdfo, separate KV write"] - steps["fdfo"] <= saved
    else:
        assert steps["fdfo, separate KV write"] - steps["fdfo"] == saved


def test_generate_tokenizes_its_texts_in_one_call_as_each_alone(tiny):
    """``generate`` encodes its text prompts in one tokenizer call: the same ids as a call
    each, with Chinese, emoji, special-token look-alikes and empty text among them, and id
    prompts beside them kept as they are."""
    engine = Engine(*tiny, EngineConfig(max_batch=4))
    texts = [r.prompt for r in task.make_requests(6, 3)] + ["你好，世界 🌍🚀", "<|mask|> [MASK] <eos>", "", " a  b "]
    assert engine.encode(texts) == [engine.encode(text) for text in texts]
    params = SamplingParams(max_tokens=engine.block_length, ignore_eos=True)
    ids = engine.encode(texts[0])
    outputs = engine.generate([texts[1], ids, texts[5]], params)
    assert [o.prompt_tokens for o in outputs] == [len(engine.encode(texts[1])), len(ids), len(engine.encode(texts[5]))]
    assert outputs[1].token_ids == engine.generate([texts[0]], params)[0].token_ids


@pytest.mark.bench
def test_accuracy_in_both_modes_at_batch_1_and_16():
    """At least 90 % of 100 held-out requests right in either mode and batch size, and the
    modes within one point (one request) of each other."""
    report = evaluate_tiny("tiny", modes=("fdfo", "sync"), batch_sizes=(1, 16), num_requests=REQUESTS)
    for run in report["runs"]:
        assert run["request_accuracy"] >= 0.90, run
        assert run["requests"] == REQUESTS
    assert report["max_mode_gap_points"] <= 1.0
    histogram = report["runs"][0]["steps_per_block_histogram"]
    assert len(histogram) >= 4  # steps per block spread over at least four levels


@pytest.mark.bench
@pytest.mark.parametrize("workload", ["default", "hard"])
def test_bench_engine_report_is_consistent(workload):
    result = bench_engine("tiny", num_requests=32, max_batch=16, rounds=2, workload=workload)
    labels = ("fdfo", "sync", "static", SEPARATE_KV)
    for label in labels:
        assert result[f"{label}_tokens_per_s"] > 0
        assert 0 < result["tokens_per_forward"][label] <= 16  # at most a block per row-forward
    for baseline in ("sync", "static"):
        assert result[f"fdfo_over_{baseline}"] > 0 and result[f"fdfo_over_{baseline}_spread"] >= 0
        # the baselines keep idle rows in their forwards: fewer tokens per row-forward
        assert result["tokens_per_forward"]["fdfo"] >= result["tokens_per_forward"][baseline]
        assert result[f"ideal_fdfo_over_{baseline}"] >= 1  # fdfo never computes an idle row
        assert result["efficiency_vs_ideal"][f"fdfo_over_{baseline}"] > 0
    # the separate KV write is one more forward for every block (at batch 16 a borderline
    # block may tip either way between the two runs: only the cheapest level is compared)
    fused, separate = (result["forwards_per_block_histogram"][k] for k in ("fdfo", SEPARATE_KV))
    assert min(fused) == 1 and min(separate) == 2
    assert result["tokens_per_forward"]["fdfo"] > result["tokens_per_forward"][SEPARATE_KV]
    assert result["fused_commit_speedup"] > 0
    assert 0 < result["compute_ratio"] <= 1
    assert result["overhead_ms_per_step_p50"] > 0
    assert result["replayed_host_ms_per_step_p50_at_full_batch"] > 0  # its replays gave the recorded tokens


def test_the_hard_workload_has_8_to_12_blanks_a_puzzle():
    puzzles = [p for r in task.make_requests(64, BENCH_SEED, blank_weights=WORKLOADS["hard"]) for p in r.puzzles]
    blanks = {p.count(task.BLANK) for p in puzzles}
    assert blanks <= set(range(8, 13)) and len(blanks) >= 4, blanks
