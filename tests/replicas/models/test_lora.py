"""PEFT LoRA adapters merge into the checkpoint's weights as W + scale * B @ A."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from replicas.models import CheckpointError, load_model

TARGETS = {  # checkpoint parameter -> where our LLaDA implementation keeps it
    "model.transformer.blocks.0.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
    "model.transformer.blocks.1.ff_out.weight": "model.layers.1.mlp.down_proj.weight",
}


def write_adapter(path, targets, rank=4, alpha=8, **extra):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "base_model_name_or_path": "LLaDA-8B-Instruct",
        "target_modules": ["q_proj", "ff_out"], **extra}))
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, shape in targets.items():
        module = "base_model.model." + name.removesuffix(".weight")
        tensors[module + ".lora_A.weight"] = torch.randn(rank, shape[1], generator=generator)
        tensors[module + ".lora_B.weight"] = torch.randn(shape[0], rank, generator=generator)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return tensors


def checkpoint_weights(path):
    weights = {}
    for shard in path.glob("*.safetensors"):
        weights |= load_file(str(shard))
    return weights


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_weights_equal_w_plus_scaled_b_a(checkpoint_dir, tmp_path, rslora):
    base = checkpoint_dir("LLaDAModelLM")
    weights = checkpoint_weights(base)
    adapter = write_adapter(tmp_path / "adapter", {n: weights[n].shape for n in TARGETS}, use_rslora=rslora)
    merged = dict(load_model(base, lora=tmp_path / "adapter").named_parameters())
    plain = dict(load_model(base).named_parameters())
    scale = 8 / 2 if rslora else 8 / 4
    for name, ours in TARGETS.items():
        module = "base_model.model." + name.removesuffix(".weight")
        a, b = adapter[module + ".lora_A.weight"], adapter[module + ".lora_B.weight"]
        torch.testing.assert_close(merged[ours], weights[name] + scale * b @ a)
    untouched = set(plain) - set(TARGETS.values())
    assert all(torch.equal(merged[n], plain[n]) for n in untouched)


def test_adapter_for_missing_parameters_is_a_clear_error(checkpoint_dir, tmp_path):
    write_adapter(tmp_path / "adapter", {"model.transformer.blocks.9.q_proj.weight": (64, 64)})
    with pytest.raises(CheckpointError, match="blocks.9.q_proj"):
        load_model(checkpoint_dir("LLaDAModelLM"), lora=tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="adapter_model.safetensors is missing"):
        load_model(checkpoint_dir("LLaDAModelLM"), lora=tmp_path / "adapter")
