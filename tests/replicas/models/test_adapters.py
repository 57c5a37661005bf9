"""Unmerged LoRA adapters served per row: rows of several adapters and of the base model in
one forward give the logits of PEFT's merged models, an engine's answers equal those of
engines over the merged checkpoints, and an adapter that does not fit is refused by name."""

import copy
import json

import numpy as np
import pytest
import torch

from replicas.adapters import enable_adapters
from replicas.attention import DenseAttentionContext
from replicas.engine import Engine
from replicas.engine_config import EngineConfig
from replicas.messages import GenerateRequest, RequestError, SamplingParams
from replicas.models.checkpoint import load_model, our_name
from replicas.models.lora import LoraError
from tests.replicas.models.checkpoint_builders import OVERRIDES
from tests.replicas.models.test_lora import checkpoint_weights, write_adapter

TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 250, 250, 250, 7, 8, 9],
                       [11, 12, 13, 14, 250, 250, 250, 250, 1, 2, 3, 4],
                       [200, 100, 50, 25, 12, 6, 250, 250, 250, 250, 30, 31]])
# two adapters of different ranks and modules; LLaDA2.0's MLP is a mixture of experts (not adapted unmerged)
TARGETS = {"dense": (["q_proj", "v_proj", "down_proj"], ["k_proj", "o_proj", "gate_proj", "up_proj"]),
           "LLaDA2MoeModelLM": (["qkv_proj"], ["o_proj"])}


def peft_adapter(net, path, modules, rank, seed):
    """Write a random PEFT adapter of ``net`` (B not zero) to ``path``; PEFT's merged model."""
    from peft import LoraConfig, get_peft_model  # here: importing PEFT takes seconds, collecting the suite pays none

    torch.manual_seed(seed)
    adapted = get_peft_model(copy.deepcopy(net), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                                           init_lora_weights=False))
    adapted.save_pretrained(path)
    return adapted.merge_and_unload()


def logits(net, tokens):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.ones(tokens.shape[0], 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool)
    with torch.inference_mode():
        return net(tokens, positions, DenseAttentionContext(mask))


@pytest.mark.parametrize("arch", ["LLaDAModelLM", "SDARForCausalLM", "LLaDA2MoeModelLM"])
def test_rows_of_two_adapters_and_the_base_give_the_logits_of_pefts_merged_models(checkpoint_dir, tmp_path, arch):
    net = load_model(checkpoint_dir(arch), overrides=OVERRIDES[arch])
    first, second = TARGETS.get(arch, TARGETS["dense"])
    merged = {"a": peft_adapter(net, tmp_path / "a", first, 4, 1), "b": peft_adapter(net, tmp_path / "b", second, 8, 2)}
    expected = [logits(net, TOKENS[:1])] + [logits(merged[name], TOKENS[i:i + 1]) for i, name in ((1, "a"), (2, "b"))]
    bank = enable_adapters(net)
    loaded = {name: bank.load(name, tmp_path / name, lambda n: our_name(net, n)) for name in "ab"}
    assert {len(adapter.deltas) for adapter in loaded.values()} == {len(first) * 2, len(second) * 2}  # 2 layers
    rows = np.repeat(np.arange(3), TOKENS.shape[1])
    bank.begin(rows, np.arange(rows.size), [None, loaded["a"], loaded["b"]], torch.device("cpu"))
    served = logits(net, TOKENS)
    bank.end()
    for row in range(3):
        scale = expected[row].abs().max()
        assert (served[row] - expected[row][0]).abs().max() <= 1e-5 * scale
    assert (expected[1] - expected[0]).abs().max() > 1e-2 * scale  # the adapters change the logits
    assert torch.equal(logits(net, TOKENS[:1]), expected[0])  # no group: the base model, bit for bit


def run(engine, requests):
    """Each request's answer ids, all run in one closed batch."""
    return [chunk.token_ids for chunk in engine.generate(requests)]


@pytest.mark.parametrize("arch, canvas", [("LLaDAModelLM", "full"), ("SDARForCausalLM", None)])
def test_an_engine_serving_two_adapters_answers_as_engines_over_the_merged_checkpoints(
        checkpoint_dir, tmp_path, arch, canvas):
    checkpoint = checkpoint_dir(arch)
    weights = checkpoint_weights(checkpoint)
    names = sorted(name for name in weights if weights[name].dim() == 2 and (".blocks." in name or ".layers." in name))
    paths = {"a": tmp_path / "a", "b": tmp_path / "b"}
    write_adapter(paths["a"], {n: weights[n].shape for n in names[::2]}, rank=4, alpha=8)
    write_adapter(paths["b"], {n: weights[n].shape for n in names[1::2]}, rank=2, alpha=8)
    prompts = [[5, 17, 42, 99, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7, 8], [200, 100, 50, 25, 12, 6]] * 2
    adapters = [None, "a", "b", "a", "b", None, "b", "a"]
    config = dict(model_overrides=OVERRIDES[arch], max_batch=8, canvas=canvas)
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def requests(adapter_of):
        return [GenerateRequest(f"r{i}", prompt, params, adapter=adapter_of(i)) for i, prompt in enumerate(prompts)]

    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(adapters={k: str(v) for k, v in paths.items()},
                                                                  max_adapters=1, **config))
    served = run(engine, requests(lambda i: adapters[i]))
    expected = {None: run(Engine.from_pretrained(str(checkpoint), EngineConfig(**config)), requests(lambda i: None))}
    for name, path in paths.items():
        expected[name] = run(Engine.from_pretrained(str(checkpoint), EngineConfig(lora=str(path), **config)),
                             requests(lambda i: None))
    assert served == [expected[adapter][i] for i, adapter in enumerate(adapters)]
    assert len({tuple(expected[name][0]) for name in expected}) == 3  # each adapter answers otherwise
    assert engine.adapters.loaded == ["a"]  # one resident at most: the last used
    with pytest.raises(RequestError, match="adapter 'c' is not served"):
        engine.make_request(GenerateRequest("c", [5, 6], params, adapter="c"))


def test_an_adapter_that_does_not_fit_the_model_is_refused_naming_the_module(checkpoint_dir, tmp_path):
    checkpoint = checkpoint_dir("LLaDAModelLM")
    net = load_model(checkpoint, overrides=OVERRIDES["LLaDAModelLM"])
    bank = enable_adapters(net)
    rename = lambda n: our_name(net, n)  # noqa: E731
    write_adapter(tmp_path / "shape", {"model.transformer.blocks.1.up_proj.weight": (64, 32)})
    with pytest.raises(LoraError, match=r"model.transformer.blocks.1.up_proj is \[128, 64\] in the model"):
        bank.load("shape", tmp_path / "shape", rename)
    write_adapter(tmp_path / "missing", {"model.transformer.blocks.7.q_proj.weight": (64, 64)})
    with pytest.raises(LoraError, match="targets model.transformer.blocks.7.q_proj"):
        bank.load("missing", tmp_path / "missing", rename)
    write_adapter(tmp_path / "rank", {"model.transformer.blocks.0.q_proj.weight": (64, 64)}, rank=4)
    config = json.loads((tmp_path / "rank" / "adapter_config.json").read_text())
    (tmp_path / "rank" / "adapter_config.json").write_text(json.dumps(config | {"r": 8}))
    with pytest.raises(LoraError, match="blocks.0.q_proj has A.4, 64. and B.64, 4., not the rank r=8"):
        bank.load("rank", tmp_path / "rank", rename)


def test_up_takes_named_adapters_and_refuses_one_that_does_not_fit_before_starting(checkpoint_dir, tmp_path, capsys):
    from cluster.cli import up_config
    from tools.cli import build_parser, main

    checkpoint = checkpoint_dir("LLaDAModelLM")
    write_adapter(tmp_path / "good", {"model.transformer.blocks.0.q_proj.weight": (64, 64)})
    write_adapter(tmp_path / "bad", {"model.transformer.blocks.1.up_proj.weight": (64, 32)})
    argv = ["up", "--model", str(checkpoint), "--lora", f"good={tmp_path / 'good'}", "--lora", f"bad={tmp_path / 'bad'}"]
    config = up_config(build_parser().parse_args(argv))
    assert config.replica.adapters == {"good": str(tmp_path / "good"), "bad": str(tmp_path / "bad")}
    assert config.replica.lora is None
    merged = up_config(build_parser().parse_args(["up", "--lora", str(tmp_path / "good")])).replica
    assert (merged.lora, merged.adapters) == (str(tmp_path / "good"), {})
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "adapter 'bad'" in err and "model.transformer.blocks.1.up_proj is [128, 64] in the model" in err
    assert "Traceback" not in err
    with pytest.raises(SystemExit, match="serve several unmerged as --lora NAME=DIR"):
        up_config(build_parser().parse_args(["up", "--lora", "/a", "--lora", "/b"]))
    assert main(argv[:3] + ["--lora", f"good={tmp_path / 'good'}", "--lora", str(tmp_path / "good")]) == 2
    assert "served without lora (merged)" in capsys.readouterr().err


def test_the_prefix_cache_keeps_each_adapters_kv_apart(checkpoint_dir, tmp_path):
    checkpoint = checkpoint_dir("SDARForCausalLM")
    weights = checkpoint_weights(checkpoint)
    write_adapter(tmp_path / "a", {name: weights[name].shape for name in weights if name.endswith("proj.weight")})
    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(
        model_overrides=OVERRIDES["SDARForCausalLM"], max_batch=2, adapters={"a": str(tmp_path / "a")}))
    prompt = list(range(10, 30))  # 5 pages of 4
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    totals = engine.pool.cache.totals
    hits = []
    for i, adapter in enumerate([None, "a", "a", None]):
        run(engine, [GenerateRequest(f"r{i}", prompt, params, adapter=adapter)])
        hits.append(totals.pages_hit)
    assert hits == [0, 0, 5, 10]  # each model's second request finds its own pages only
