"""Token-for-token reference fixtures from the published generation code of four diffusion LMs.

Run it in a separate virtualenv per model family (see README.md in this folder), pointing
``--sources`` at a directory holding the published files (layout in README.md; the expected
sha256 of every file is pinned in SOURCES below and checked before anything runs).  The script

1. writes the tiny random checkpoint of ``checkpoint_builders.write_checkpoint`` into a temporary
   folder, makes a temporary copy of it beside the published modeling files with an ``auto_map``
   (and the few config fields the published code reads that the builder does not write),
2. loads it with ``AutoModel*.from_pretrained(..., trust_remote_code=True)`` in float32 on the CPU,
3. calls the published generate function with the settings listed in FIXTURES, while a wrapper
   around ``model.forward`` records every forward call (inputs, logits),
4. replays every selection decision from the recorded logits with the rule described in the
   README (a check that the description is right), measures the decision margins, and
5. merges the results of the families it ran into ``fixtures.json``.

Nothing of the published code is contained here: it is imported from ``--sources`` at run time.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.machinery
import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURES_PATH = HERE / "fixtures.json"
BUILDERS_DIR = HERE.parent  # tests/replicas/models, home of checkpoint_builders.py

# Where each published file comes from, and its sha256 (checked before use).
SOURCES = {
    "llada/generate.py": dict(
        repo="ML-GSAI/LLaDA", commit="b7e6c3565f194352da44b38dd12b6970597309f3", path="generate.py",
        sha256="a95b1c67d2f9d6a80f7a2d046d59be215fd0cf010c771e9ec07f5b80eae7a9c7"),
    "llada/modeling_llada.py": dict(
        repo="ZHZisZZ/dllm", commit="03270de7d134f87244f1ffc2ff3653c809beb1d0",
        path="dllm/pipelines/llada/models/modeling_llada.py",
        sha256="2052ade16818c1ae8f7ecf78f3e3fc60739eb430d8612633e88dc25be9f8214b"),
    "llada/configuration_llada.py": dict(
        repo="ZHZisZZ/dllm", commit="03270de7d134f87244f1ffc2ff3653c809beb1d0",
        path="dllm/pipelines/llada/models/configuration_llada.py",
        sha256="d40317935b16a80b60c931e21a88255f51f7c18b75819c34128c6447fef56926"),
    "dream/modeling_dream.py": dict(
        repo="ZHZisZZ/dllm", commit="03270de7d134f87244f1ffc2ff3653c809beb1d0",
        path="dllm/pipelines/dream/models/modeling_dream.py",
        sha256="bce01f2d2c37af1544bc30c7eda5d3e1d6e504bc978e12e30f12e9842279e9fb"),
    "dream/configuration_dream.py": dict(
        repo="ZHZisZZ/dllm", commit="03270de7d134f87244f1ffc2ff3653c809beb1d0",
        path="dllm/pipelines/dream/models/configuration_dream.py",
        sha256="7044b15b49c7a3835c088552b4a77434c73d5ebb1db0232b359d7d3fc7a1663b"),
    "dream/generation_utils.py": dict(
        repo="ZHZisZZ/dllm", commit="03270de7d134f87244f1ffc2ff3653c809beb1d0",
        path="dllm/pipelines/dream/models/generation_utils.py",
        sha256="b635865a96f4a9bc842d10ee0d55e38d8ef82d7e6135f286c73f9c688729d46a"),
    "sdar/generate.py": dict(
        repo="JetAstra/SDAR", commit="c2041a8333333d685f6e15122c84f60f51f85ebd", path="generate.py",
        sha256="2855a9c3e28f77a980ea44186494b546159d8057416457775cfc03430d67cc5e"),
    "sdar/huggingface_bd3.py": dict(
        repo="JetAstra/SDAR", commit="c2041a8333333d685f6e15122c84f60f51f85ebd",
        path="evaluation/opencompass/opencompass/models/huggingface_bd3.py",
        sha256="0e1822d11cd60f47ba0c0e542b6e077681b303d8ca8bb10939ed24f1d7891ba8"),
    "sdar/modeling_sdar.py": dict(
        repo="JetAstra/SDAR", commit="c2041a8333333d685f6e15122c84f60f51f85ebd",
        path="training/model/SDAR-4B-Chat/modeling_sdar.py",
        sha256="ae6c856724088f72e9f52565df6a25637243ecc09acf18dcf28c8a7b0dae5bc5"),
    "sdar/configuration_sdar.py": dict(
        repo="JetAstra/SDAR", commit="c2041a8333333d685f6e15122c84f60f51f85ebd",
        path="training/model/SDAR-4B-Chat/configuration_sdar.py",
        sha256="eb2830b7c5841c05ad4450b8b15a968703afc890e432e12f2b0f1eb1625720c6"),
    "sdar/fused_linear_diffusion_cross_entropy.py": dict(
        repo="JetAstra/SDAR", commit="c2041a8333333d685f6e15122c84f60f51f85ebd",
        path="training/model/SDAR-4B-Chat/fused_linear_diffusion_cross_entropy.py",
        sha256="0779ba8cceb9903c7e8684cc55ad026b92e7be7e0aa7d2667288a3292a706585"),
    "llada2/modeling_llada2_moe.py": dict(
        repo="ZHZisZZ/dllm", commit="ca176752fbceec49c6b4777a2c18ae88e4eb10ed",
        path="dllm/pipelines/llada2/models/modeling_llada2_moe.py",
        sha256="2da5a275f83d71021c0e2b4a2912905808be271b95fc4d9a7d1598c7b2ed59d4"),
    "llada2/configuration_llada2_moe.py": dict(
        repo="ZHZisZZ/dllm", commit="ca176752fbceec49c6b4777a2c18ae88e4eb10ed",
        path="dllm/pipelines/llada2/models/configuration_llada2_moe.py",
        sha256="21c8ae7a3694e7dea425ca7858eac0fdd1276ebf60066bafc2e5665855f5e15a"),
}

FAMILIES = {
    "llada": dict(arch="LLaDAModelLM", modeling=["modeling_llada.py", "configuration_llada.py"],
                  auto_map={"AutoConfig": "configuration_llada.LLaDAConfig",
                            "AutoModel": "modeling_llada.LLaDAModelLM"},
                  auto_class="AutoModel", extra_config={}),
    "dream": dict(arch="DreamModel",
                  modeling=["modeling_dream.py", "configuration_dream.py", "generation_utils.py"],
                  auto_map={"AutoConfig": "configuration_dream.DreamConfig",
                            "AutoModel": "modeling_dream.DreamModel"},
                  auto_class="AutoModel", extra_config={}),
    "sdar": dict(arch="SDARForCausalLM",
                 modeling=["modeling_sdar.py", "configuration_sdar.py",
                           "fused_linear_diffusion_cross_entropy.py"],
                 auto_map={"AutoConfig": "configuration_sdar.SDARConfig",
                           "AutoModel": "modeling_sdar.SDARModel",
                           "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
                 auto_class="AutoModelForCausalLM",
                 # read by SDARForCausalLM.forward, not a default of SDARConfig; value of the published config
                 extra_config={"fuse_cross_entropy": True}),
    "llada2": dict(arch="LLaDA2MoeModelLM",
                   modeling=["modeling_llada2_moe.py", "configuration_llada2_moe.py"],
                   auto_map={"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                             "AutoModel": "modeling_llada2_moe.LLaDA2MoeModelLM",
                             "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
                   auto_class="AutoModelForCausalLM",
                   # LLaDA2MoeConfig defaults pad_token_id to 126081, outside the tiny vocab, and passes it to
                   # nn.Embedding(padding_idx=...); the builder's pad id (only affects gradients, not outputs)
                   extra_config={"pad_token_id": 252}),
}

MASK, EOS = 250, 251
# Checkpoint seeds were chosen (with --seed) so that no run commits the mask id as a token (random
# weights can make it the argmax; the published loops then misbehave) and margins are comfortable.

# The runs.  ``kwargs`` are passed verbatim to the published function (after model and prompt).
FIXTURES = [
    # LLaDA generate.generate(model, prompt, attention_mask=None, **kwargs)
    dict(id="llada_g32_b8_s16", family="llada", seed=7, prompt="Hello world",
         kwargs=dict(steps=16, gen_length=32, block_length=8, temperature=0.0, cfg_scale=0.0,
                     remasking="low_confidence", mask_id=MASK)),
    dict(id="llada_g24_b8_s24", family="llada", seed=7, prompt="Hello world",
         kwargs=dict(steps=24, gen_length=24, block_length=8, temperature=0.0, cfg_scale=0.0,
                     remasking="low_confidence", mask_id=MASK)),
    dict(id="llada_g32_b16_s8", family="llada", seed=7, prompt="Hello world",
         kwargs=dict(steps=8, gen_length=32, block_length=16, temperature=0.0, cfg_scale=0.0,
                     remasking="low_confidence", mask_id=MASK)),
    dict(id="llada_g16_b16_s16_p2", family="llada", seed=7, prompt="The cat sat on",
         kwargs=dict(steps=16, gen_length=16, block_length=16, temperature=0.0, cfg_scale=0.0,
                     remasking="low_confidence", mask_id=MASK)),
    # Dream model.diffusion_generate(prompt, **kwargs)
    dict(id="dream_n8_s8_maskgit", family="dream", seed=5, prompt="Hello world",
         kwargs=dict(max_new_tokens=8, steps=8, alg="maskgit_plus", alg_temp=0.0, temperature=0.0)),
    dict(id="dream_n16_s8_maskgit", family="dream", seed=5, prompt="Hello world",
         kwargs=dict(max_new_tokens=16, steps=8, alg="maskgit_plus", alg_temp=0.0, temperature=0.0)),
    dict(id="dream_n16_s4_margin", family="dream", seed=5, prompt="Hello world",
         kwargs=dict(max_new_tokens=16, steps=4, alg="topk_margin", alg_temp=0.0, temperature=0.0)),
    dict(id="dream_n16_s16_entropy", family="dream", seed=5, prompt="Hello world",
         kwargs=dict(max_new_tokens=16, steps=16, alg="entropy", alg_temp=None, temperature=0.0)),
    dict(id="dream_n8_s4_entropy", family="dream", seed=5, prompt="The cat sat on",
         kwargs=dict(max_new_tokens=8, steps=4, alg="entropy", alg_temp=0.0, temperature=0.0)),
    dict(id="dream_n16_s5_maskgit", family="dream", seed=5, prompt="The cat sat on",
         kwargs=dict(max_new_tokens=16, steps=5, alg="maskgit_plus", alg_temp=None, temperature=0.0)),
    # top_k=None explicitly: no top-k filtering before the softmax (the default resolves to 50)
    dict(id="dream_n16_s8_maskgit_nofilter", family="dream", seed=5, prompt="Hello world",
         kwargs=dict(max_new_tokens=16, steps=8, alg="maskgit_plus", alg_temp=0.0, temperature=0.0, top_k=None)),
    dict(id="dream_n16_s4_margin_nofilter", family="dream", seed=5, prompt="Hello world",
         kwargs=dict(max_new_tokens=16, steps=4, alg="topk_margin", alg_temp=0.0, temperature=0.0, top_k=None)),
    dict(id="dream_n8_s8_entropy_nofilter", family="dream", seed=5, prompt="The cat sat on",
         kwargs=dict(max_new_tokens=8, steps=8, alg="entropy", alg_temp=0.0, temperature=0.0, top_k=None)),
    # SDAR generate.block_diffusion_generate(model, prompt={'input_ids': ...}, **kwargs)
    # temperature 0 divides by zero there; greedy is temperature=1.0 with top_k=1 (confidence is then
    # exactly 1.0 for every position), as in the repository's evaluation configs
    dict(id="sdar_g12_b4_s4_sequential", family="sdar", seed=0, prompt="Hello world", function="generate",
         kwargs=dict(mask_id=MASK, gen_length=12, block_length=4, denoising_steps=4, temperature=1.0,
                     top_k=1, top_p=1.0, remasking_strategy="sequential", stopping_criteria_idx=None)),
    dict(id="sdar_g16_b4_s2_sequential", family="sdar", seed=0, prompt="The cat sat on", function="generate",
         kwargs=dict(mask_id=MASK, gen_length=16, block_length=4, denoising_steps=2, temperature=1.0,
                     top_k=1, top_p=1.0, remasking_strategy="sequential", stopping_criteria_idx=None)),
    dict(id="sdar_g16_b8_s4_dynamic", family="sdar", seed=0, prompt="Hello world", function="generate",
         kwargs=dict(mask_id=MASK, gen_length=16, block_length=8, denoising_steps=4, temperature=1.0,
                     top_k=1, top_p=1.0, remasking_strategy="low_confidence_dynamic",
                     confidence_threshold=0.85, stopping_criteria_idx=[EOS])),
    # SDAR huggingface_bd3.block_diffusion_generate(model, tokenizer, prompt, **kwargs): the
    # repository's evaluation generate; confidence is the softmax probability of the argmax
    dict(id="sdar_bd3_g12_b4_s4_static", family="sdar", seed=0, prompt="Hello world", function="bd3",
         kwargs=dict(mask_id=MASK, gen_length=12, block_length=4, denoising_steps=4, temperature=1.0,
                     top_k=1, top_p=1.0, remasking="low_confidence", threshold=1.0,
                     stopping_criteria_idx=[EOS])),
    dict(id="sdar_bd3_g16_b8_s8_static", family="sdar", seed=0, prompt="Hello world", function="bd3",
         kwargs=dict(mask_id=MASK, gen_length=16, block_length=8, denoising_steps=8, temperature=1.0,
                     top_k=1, top_p=1.0, remasking="low_confidence", threshold=1.0,
                     stopping_criteria_idx=[EOS])),
    dict(id="sdar_bd3_g16_b4_s2_static", family="sdar", seed=0, prompt="The cat sat on", function="bd3",
         kwargs=dict(mask_id=MASK, gen_length=16, block_length=4, denoising_steps=2, temperature=1.0,
                     top_k=1, top_p=1.0, remasking="low_confidence", threshold=1.0,
                     stopping_criteria_idx=[EOS])),
    dict(id="sdar_bd3_g16_b8_s8_static_eos", family="sdar", seed=9, prompt="Hello world", function="bd3",
         kwargs=dict(mask_id=MASK, gen_length=16, block_length=8, denoising_steps=8, temperature=1.0,
                     top_k=1, top_p=1.0, remasking="low_confidence", threshold=1.0,
                     stopping_criteria_idx=[EOS])),
    dict(id="sdar_bd3_g16_b8_s4_dynamic", family="sdar", seed=0, prompt="Hello world", function="bd3",
         kwargs=dict(mask_id=MASK, gen_length=16, block_length=8, denoising_steps=4, temperature=1.0,
                     top_k=1, top_p=1.0, remasking="low_confidence", threshold=0.5,
                     stopping_criteria_idx=[EOS])),
    # LLaDA2.0 model.generate(inputs=prompt, **kwargs)
    dict(id="llada2_g16_b4_s4_thr1", family="llada2", seed=4, prompt="Hello world",
         kwargs=dict(temperature=0.0, block_length=4, steps=4, gen_length=16, threshold=1.0,
                     eos_early_stop=False, eos_id=EOS, mask_id=MASK)),
    dict(id="llada2_g16_b8_s8_thr1", family="llada2", seed=4, prompt="Hello world",
         kwargs=dict(temperature=0.0, block_length=8, steps=8, gen_length=16, threshold=1.0,
                     eos_early_stop=False, eos_id=EOS, mask_id=MASK)),
    dict(id="llada2_g12_b4_s2_thr1", family="llada2", seed=4, prompt="The cat sat on",
         kwargs=dict(temperature=0.0, block_length=4, steps=2, gen_length=12, threshold=1.0,
                     eos_early_stop=False, eos_id=EOS, mask_id=MASK)),
    dict(id="llada2_g16_b8_s4_thr05", family="llada2", seed=4, prompt="Hello world",
         kwargs=dict(temperature=0.0, block_length=8, steps=4, gen_length=16, threshold=0.5,
                     eos_early_stop=False, eos_id=EOS, mask_id=MASK)),
    # seed 14 generates EOS: generation stops after the block holding it, the return ends at the first EOS
    dict(id="llada2_g16_b4_s4_thr1_eos", family="llada2", seed=14, prompt="Hello world",
         kwargs=dict(temperature=0.0, block_length=4, steps=4, gen_length=16, threshold=1.0,
                     eos_early_stop=False, eos_id=EOS, mask_id=MASK)),
    dict(id="llada2_g16_b4_s4_thr1_eos_early_stop", family="llada2", seed=14, prompt="Hello world",
         kwargs=dict(temperature=0.0, block_length=4, steps=4, gen_length=16, threshold=1.0,
                     eos_early_stop=True, eos_id=EOS, mask_id=MASK)),
    dict(id="llada2_g16_b8_s4_thr05_eos", family="llada2", seed=14, prompt="Hello world",
         kwargs=dict(temperature=0.0, block_length=8, steps=4, gen_length=16, threshold=0.5,
                     eos_early_stop=False, eos_id=EOS, mask_id=MASK)),
]


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_sources(sources: Path, families: list[str]) -> dict:
    used = {}
    for rel, meta in SOURCES.items():
        if rel.split("/")[0] not in families:
            continue
        path = sources / rel
        if not path.is_file():
            raise SystemExit(f"missing published file {path} (from {meta['repo']}@{meta['commit']}:{meta['path']})")
        digest = sha256_file(path)
        if digest != meta["sha256"]:
            raise SystemExit(f"{path}: sha256 {digest} differs from the pinned {meta['sha256']}")
        used[rel] = meta
    return used


# --------------------------------------------------------------------------------------------
# CPU stand-ins for the two CUDA-only functions SDAR's modeling file imports from flash_attn.
# They compute the same mathematical function in float32; written here, not taken from flash_attn.

def install_flash_attn_standin():
    import torch
    import torch.nn.functional as F

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **unused):
        # flash_attn layout: (batch, seqlen, heads, head_dim); k/v may have fewer heads (GQA)
        if causal or dropout_p:
            raise NotImplementedError("stand-in covers causal=False, dropout_p=0 only")
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             scale=softmax_scale, enable_gqa=True)
        return out.transpose(1, 2)

    def rms_norm_fn(x, weight, bias=None, residual=None, eps=1e-6, **unused):
        if residual is not None:
            raise NotImplementedError("stand-in covers residual=None only")
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    def unavailable(*args, **kwargs):
        raise NotImplementedError("not needed for inference")

    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__path__ = []
        for key, value in attrs.items():
            setattr(mod, key, value)
        sys.modules[name] = mod
        return mod

    module("flash_attn", flash_attn_func=flash_attn_func, flash_attn_varlen_func=unavailable,
           __version__="0.0.0-cpu-standin")
    module("flash_attn.bert_padding", index_first_axis=unavailable, pad_input=unavailable, unpad_input=unavailable)
    module("flash_attn.ops")
    module("flash_attn.ops.triton")
    module("flash_attn.ops.triton.layer_norm", rms_norm_fn=rms_norm_fn)


def install_sdpa_mask_cast():
    """LLaDA2's generate builds its block mask as a bfloat16 additive tensor (values 0 and -inf), made
    for the bfloat16 model.  In float32, torch's SDPA rejects a bfloat16 mask beside float32 queries, so
    the "sdpa" attention function transformers dispatches to is wrapped to cast a floating mask to the
    query dtype first (exact for 0/-inf).  The eager path is no alternative: it re-inverts 4D masks."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(inner, "_casts_mask", False):
        return

    def sdpa_with_mask_in_query_dtype(module, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.is_floating_point() and attention_mask.dtype != query.dtype:
            attention_mask = attention_mask.to(query.dtype)
        return inner(module, query, key, value, attention_mask, *args, **kwargs)

    sdpa_with_mask_in_query_dtype._casts_mask = True
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_with_mask_in_query_dtype


# --------------------------------------------------------------------------------------------

def load_module_from_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_functions_from_file(path: Path, names: list[str], namespace: dict) -> dict:
    """Executes only the named top-level function definitions of a published file.

    Used for SDAR's opencompass model file, whose module-level imports need opencompass/mmengine;
    the generate function itself only needs torch, numpy and transformers' DynamicCache.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    found = {node.name for node in wanted}
    if found != set(names):
        raise SystemExit(f"{path}: functions {sorted(set(names) - found)} not found")
    code = compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec")
    exec(code, namespace)
    return {name: namespace[name] for name in names}


def prepare_model_dir(tmp: Path, family: str, seed: int, sources: Path, builders) -> tuple[Path, Path]:
    spec = FAMILIES[family]
    ckpt = tmp / f"ckpt_{family}_{seed}"
    builders.write_checkpoint(ckpt, spec["arch"], seed=seed)
    model_dir = tmp / f"model_{family}_{seed}"
    shutil.copytree(ckpt, model_dir)
    # transformers 4.46 refuses safetensors shards without {"format": "pt"} metadata (the builder
    # writes none): re-save the copy's shards with it, tensors unchanged
    from safetensors.torch import load_file, save_file
    for shard in sorted(model_dir.glob("*.safetensors")):
        save_file(load_file(str(shard)), str(shard), metadata={"format": "pt"})
    for name in spec["modeling"]:
        shutil.copy(sources / family / name, model_dir / name)
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = spec["auto_map"]
    config.update(spec["extra_config"])
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    if family == "dream":
        # DreamModel.from_pretrained insists on a generation_config.json; diffusion_generate called
        # without generation_config builds its config from config.json, so its content is inert
        ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id")}
        (model_dir / "generation_config.json").write_text(json.dumps(ids, indent=2))
    return ckpt, model_dir


def load_model(model_dir: Path, family: str):
    import torch
    import transformers

    auto = getattr(transformers, FAMILIES[family]["auto_class"])
    kwargs = dict(trust_remote_code=True, torch_dtype=torch.float32)
    if family == "llada2":
        install_sdpa_mask_cast()
        kwargs["attn_implementation"] = "sdpa"
    model = auto.from_pretrained(str(model_dir), **kwargs)
    model = model.to("cpu").eval()
    for p in model.parameters():
        if p.dtype != torch.float32:
            raise SystemExit(f"{family}: parameter dtype {p.dtype}")
    return model


class Recorder:
    """Wraps model.forward (instance attribute, so both model(...) and self.forward(...) go through it)."""

    def __init__(self, model):
        self.calls = []
        self.model = model
        self.inner = model.forward
        model.forward = self

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        position_ids = kwargs.get("position_ids")
        logits = out.logits if hasattr(out, "logits") else out[0]
        self.calls.append(dict(
            input_ids=input_ids.detach().clone(),
            position_ids=None if position_ids is None else position_ids.detach().clone(),
            store_kv=kwargs.get("store_kv"),
            logits=None if logits is None else logits.detach().clone()))
        return out

    def detach(self):
        self.model.forward = self.inner


# --------------------------------------------------------------------------------------------
# Replay: recompute every selection decision from the recorded logits with the rule the README
# describes, compare it with what the published code committed, and measure margins.

class Replay:
    def __init__(self):
        self.min_margin = math.inf      # selection margin (units of the confidence used)
        self.min_argmax_gap = math.inf  # top1 - top2 logit of every committed token
        self.decisions = 0
        self.mask_commits = 0
        self.mismatches = []
        self.trace = []

    def decide(self, step_label, positions, conf, logits, tokens_before, tokens_after, predicted, threshold=None):
        """positions: absolute positions of the candidates (masked, eligible); conf: float tensor of the
        candidates' confidences (None: the choice does not depend on confidence); logits: (n_candidates, vocab) logits used; predicted: bool tensor over
        candidates (the replayed rule); tokens_after: ids at the candidates after the step."""
        import torch

        argmax = logits.argmax(-1)
        # a committed argmax equal to the mask id leaves the position masked: count such commits
        mask_commits = predicted & (argmax == MASK)
        self.mask_commits += int(mask_commits.sum())
        observed = (tokens_after != MASK) | mask_commits
        if not torch.equal(observed, predicted):
            self.mismatches.append(f"{step_label}: committed {observed.nonzero().flatten().tolist()} "
                                   f"replayed {predicted.nonzero().flatten().tolist()}")
        if observed.any() and not torch.equal(tokens_after[observed], argmax[observed]):
            self.mismatches.append(f"{step_label}: committed tokens are not the argmax")
        self.decisions += 1
        sel, unsel = (None, None) if conf is None else (conf[observed].double(), conf[~observed].double())
        if conf is not None and len(sel) and len(unsel):
            self.min_margin = min(self.min_margin, float(sel.min() - unsel.max()))
        if conf is not None and threshold is not None and threshold < 1.0:
            self.min_margin = min(self.min_margin, float((conf.double() - threshold).abs().min()))
        if observed.any():
            top2 = logits[observed].double().topk(2, dim=-1).values
            self.min_argmax_gap = min(self.min_argmax_gap, float((top2[:, 0] - top2[:, 1]).min()))
        self.trace.append([[int(p), int(t)] for p, t, o in zip(positions.tolist(), tokens_after.tolist(),
                                                               observed.tolist()) if o])

    def summary(self):
        return dict(min_margin=None if math.isinf(self.min_margin) else self.min_margin,
                    min_argmax_logit_gap=None if math.isinf(self.min_argmax_gap) else self.min_argmax_gap,
                    decisions=self.decisions, mask_id_commits=self.mask_commits,
                    replay_matches=not self.mismatches,
                    replay_mismatches=self.mismatches[:10], commits_per_step=self.trace)


def topk_mask(conf, k):
    import torch

    mask = torch.zeros(conf.shape, dtype=torch.bool)
    k = min(k, conf.numel())
    if k > 0:
        mask[torch.topk(conf, k).indices] = True
    return mask


def even_schedule(total: int, steps: int) -> list[int]:
    base, rem = divmod(total, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def replay_llada(calls, prompt_len, output, kw):
    import torch

    rep = Replay()
    block, gen = kw["block_length"], kw["gen_length"]
    steps_per_block = kw["steps"] // (gen // block)
    schedule = even_schedule(block, steps_per_block)
    for t, call in enumerate(calls):
        x = call["input_ids"][0]
        after = calls[t + 1]["input_ids"][0] if t + 1 < len(calls) else output[0]
        b, s = divmod(t, steps_per_block)
        end = prompt_len + (b + 1) * block
        cand = ((x == MASK) & (torch.arange(len(x)) < end)).nonzero().flatten()
        logits = call["logits"][0][cand]
        conf = torch.softmax(call["logits"][0], dim=-1)[cand].gather(-1, logits.argmax(-1, keepdim=True))[:, 0]
        rep.decide(f"call {t}", cand, conf, logits, x[cand], after[cand], topk_mask(conf, schedule[s]))
    return rep


def replay_dream(calls, output, kw, gen_config):
    import torch

    rep = Replay()
    steps, eps = gen_config["steps"], gen_config["eps"]
    top_k, top_p = gen_config["top_k"], gen_config["top_p"]
    if gen_config["temperature"] or gen_config["alg_temp"]:
        raise SystemExit("replay covers temperature 0 and alg_temp None/0 only")
    timesteps = torch.linspace(1, eps, steps + 1)
    for i, call in enumerate(calls):
        x = call["input_ids"][0]
        after = calls[i + 1]["input_ids"][0] if i + 1 < len(calls) else output[0]
        raw = call["logits"][0]
        shifted = torch.cat([raw[:1], raw[:-1]], dim=0)
        cand = (x == MASK).nonzero().flatten()
        logits = shifted[cand]
        filtered = logits
        if top_p is not None and top_p < 1:
            raise SystemExit("replay covers top_p None/1 only")
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            filtered = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
        probs = torch.softmax(filtered, dim=-1)
        if kw["alg"] == "maskgit_plus":
            conf = probs.max(-1).values
        elif kw["alg"] == "topk_margin":
            top2 = probs.sort(dim=-1, descending=True).values
            conf = top2[:, 0] - top2[:, 1]
        else:
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)
        num_mask = torch.tensor(len(cand)) / 1
        k = int(num_mask * (1 - timesteps[i + 1] / timesteps[i])) if i < steps - 1 else int(num_mask)
        rep.decide(f"step {i}", cand, conf, logits, x[cand], after[cand], topk_mask(conf, k))
    return rep


def replay_sdar(calls, kw, variant):
    import torch

    rep = Replay()
    schedule = even_schedule(kw["block_length"], kw["denoising_steps"])
    decisions = [i for i, c in enumerate(calls) if c["store_kv"] is False]
    step_in_block, last_block_start = 0, None
    for i in decisions:
        call, nxt = calls[i], calls[i + 1]
        block_start = int(call["position_ids"][0, 0])
        if int(nxt["position_ids"][0, 0]) != block_start:
            rep.mismatches.append(f"call {i}: next call is not the same block")
            continue
        step_in_block = step_in_block + 1 if block_start == last_block_start else 0
        last_block_start = block_start
        x, after = call["input_ids"][0], nxt["input_ids"][0]
        cand_local = (x == MASK).nonzero().flatten()
        logits = call["logits"][0][cand_local]
        probs = torch.softmax(call["logits"][0], dim=-1)[cand_local]
        argmax = logits.argmax(-1)
        k = schedule[step_in_block]
        threshold = None
        if variant == "generate":
            conf = torch.ones(len(cand_local))  # top_k=1: the filtered distribution is one-hot
            strategy = kw["remasking_strategy"]
            if strategy == "sequential":
                predicted = torch.zeros(len(cand_local), dtype=torch.bool)
                predicted[:k] = True  # masked positions of a block are always a suffix here
                conf = None
            elif strategy == "low_confidence_static":
                predicted = topk_mask(conf, k)
            else:
                threshold = kw["confidence_threshold"]
                high = conf > threshold
                predicted = high if int(high.sum()) >= k else topk_mask(conf, k)
        else:
            conf = probs.gather(-1, argmax[:, None])[:, 0]
            threshold = kw["threshold"]
            if threshold < 1.0:
                high = conf > threshold
                predicted = high if int(high.sum()) >= k else topk_mask(conf, k)
            else:
                predicted = topk_mask(conf, k)
        rep.decide(f"call {i} (block at {block_start}, step {step_in_block})", cand_local + block_start, conf,
                   logits, x[cand_local], after[cand_local], predicted, threshold)
    return rep


def replay_llada2(calls, prompt_len, returned, kw):
    import torch

    rep = Replay()
    block = kw["block_length"]
    steps = min(kw["steps"], kw["gen_length"] // kw.get("minimal_topk", 1))
    schedule = even_schedule(block, steps)
    step_in_block, last_len = 0, None
    for i, call in enumerate(calls):
        x = call["input_ids"][0]
        n = len(x)
        step_in_block = step_in_block + 1 if n == last_len else 0
        last_len = n
        active = x[n - block:]
        cand_local = (active == MASK).nonzero().flatten()
        logits = call["logits"][0][n - block:][cand_local]
        conf = torch.softmax(call["logits"][0][n - block:], dim=-1)[cand_local].gather(
            -1, logits.argmax(-1, keepdim=True))[:, 0]
        k = min(schedule[step_in_block], len(cand_local))
        high = conf > kw["threshold"]
        predicted = high if int(high.sum()) >= schedule[step_in_block] else topk_mask(conf, k)
        if i + 1 < len(calls):
            after = calls[i + 1]["input_ids"][0][n - block:n][cand_local]
        else:  # not observable from a later call: take the replayed commit, checked against the return below
            after = torch.where(predicted, logits.argmax(-1), torch.full_like(predicted, MASK, dtype=torch.long))
        rep.decide(f"call {i} (window {n}, step {step_in_block})", cand_local + n - block, conf, logits,
                   active[cand_local], after, predicted, kw["threshold"])
    # the final block as replayed must agree with what generate returned
    final = calls[-1]["input_ids"][0].clone()
    n = len(final)
    last = rep.trace[-1] if rep.trace else []
    for pos, tok in last:
        final[pos] = tok
    tail = final[prompt_len:].tolist()
    ret = returned[0].tolist()
    if tail[:len(ret)] != ret:
        rep.mismatches.append("replayed final canvas differs from the returned tokens")
    return rep


# --------------------------------------------------------------------------------------------

def run_family(family: str, sources: Path, tmp: Path, builders) -> list[dict]:
    import torch

    torch.manual_seed(0)
    results = []
    tokenizer_cache = {}
    loaded = {}
    for fx in [f for f in FIXTURES if f["family"] == family]:
        seed = fx["seed"]
        if seed not in loaded:
            ckpt, model_dir = prepare_model_dir(tmp, family, seed, sources, builders)
            loaded[seed] = (ckpt, load_model(model_dir, family), builders.weights_sha256(ckpt))
        ckpt, model, wsha = loaded[seed]
        if ckpt not in tokenizer_cache:
            from tokenizers import Tokenizer
            tokenizer_cache[ckpt] = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        prompt_ids = tokenizer_cache[ckpt].encode(fx["prompt"]).ids
        prompt = torch.tensor([prompt_ids], dtype=torch.long)
        kw = fx["kwargs"]
        rec = Recorder(model)
        extra = {}
        torch.manual_seed(0)
        try:
            if family == "llada":
                gen = load_module_from_file("llada_generate", sources / "llada" / "generate.py")
                out = gen.generate(model, prompt, **kw)
                generated = out[0, len(prompt_ids):]
                call = "generate.generate(model, prompt, **kwargs)"
                rep = replay_llada(rec.calls, len(prompt_ids), out, kw)
            elif family == "dream":
                out = model.diffusion_generate(prompt, **kw)
                generated = out[0, len(prompt_ids):]
                call = "model.diffusion_generate(prompt, **kwargs)"
                # what the published code resolves the call to (its defaults come from config.json via
                # transformers' PretrainedConfig generation defaults, e.g. top_k=50 under 4.46)
                resolved = model._prepare_generation_config(None, **kw)
                extra["effective_generation_config"] = {
                    k: getattr(resolved, k) for k in ("temperature", "top_p", "top_k", "eps", "steps", "alg",
                                                      "alg_temp", "mask_token_id")}
                rep = replay_dream(rec.calls, out, kw, extra["effective_generation_config"])
            elif family == "sdar":
                if fx["function"] == "generate":
                    gen = load_module_from_file("sdar_generate", sources / "sdar" / "generate.py")
                    out = gen.block_diffusion_generate(model, prompt={"input_ids": prompt}, **kw)
                    call = "generate.block_diffusion_generate(model, prompt={'input_ids': prompt}, **kwargs)"
                else:
                    from transformers.cache_utils import DynamicCache
                    import numpy as np
                    import torch.nn.functional as F
                    fns = load_functions_from_file(
                        sources / "sdar" / "huggingface_bd3.py",
                        ["add_gumbel_noise", "top_k_logits", "top_p_logits", "sample_with_temperature_topk_topp",
                         "get_num_transfer_tokens", "block_diffusion_generate"],
                        dict(torch=torch, F=F, np=np, DynamicCache=DynamicCache))
                    out = fns["block_diffusion_generate"](
                        model, None, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, **kw)
                    call = ("huggingface_bd3.block_diffusion_generate(model, None, "
                            "{'input_ids': prompt, 'attention_mask': ones}, **kwargs)")
                generated = out[0, len(prompt_ids):]
                rep = replay_sdar(rec.calls, kw, fx["function"])
            elif family == "llada2":
                out = model.generate(inputs=prompt, **kw)
                generated = out[0]
                call = "model.generate(inputs=prompt, **kwargs)"
                rep = replay_llada2(rec.calls, len(prompt_ids), out, kw)
        finally:
            rec.detach()
        summary = rep.summary()
        record = dict(
            id=fx["id"], family=family, arch=FAMILIES[family]["arch"], checkpoint_seed=seed,
            weights_sha256=wsha, prompt_text=fx["prompt"], prompt_ids=prompt_ids, call=call,
            source=("sdar/huggingface_bd3.py" if fx.get("function") == "bd3" else
                    f"{family}/generate.py" if family in ("llada", "sdar") else
                    "dream/generation_utils.py" if family == "dream" else "llada2/modeling_llada2_moe.py"),
            kwargs=kw, generated_ids=generated.tolist(), generated_length=int(generated.numel()),
            forward_calls=len(rec.calls), attn_implementation=getattr(model.config, "_attn_implementation", None),
            **extra, **summary)
        results.append(record)
        flag = "ok" if summary["replay_matches"] else "REPLAY MISMATCH"
        print(f"{fx['id']:32s} {flag:16s} mask_commits={summary['mask_id_commits']} min_margin={summary['min_margin']} "
              f"min_argmax_gap={summary['min_argmax_logit_gap']} gen={record['generated_ids']}", flush=True)
        for m in summary["replay_mismatches"]:
            print("   ", m)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", type=Path, required=True, help="directory of published files (README layout)")
    parser.add_argument("--families", default="llada,dream,sdar,llada2",
                        help="comma-separated subset of llada,dream,sdar,llada2 to run in this environment")
    parser.add_argument("--out", type=Path, default=FIXTURES_PATH)
    parser.add_argument("--seed", type=int, default=None,
                        help="override the checkpoint seed of every fixture run (for choosing seeds)")
    args = parser.parse_args()
    families = [f for f in args.families.split(",") if f]
    for f in families:
        if f not in FAMILIES:
            raise SystemExit(f"unknown family {f}")

    used = check_sources(args.sources.resolve(), families)
    if args.seed is not None:
        for fx in FIXTURES:
            fx["seed"] = args.seed
    tmp = Path(tempfile.mkdtemp(prefix="dllm-parity-"))
    os.environ["HF_MODULES_CACHE"] = str(tmp / "hf_modules")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import torch
    import transformers
    import tokenizers
    import safetensors

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if "sdar" in families:
        install_flash_attn_standin()
    sys.path.insert(0, str(BUILDERS_DIR))
    import checkpoint_builders as builders

    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               tokenizers=tokenizers.__version__, safetensors=safetensors.__version__)
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import einops
        env["einops"] = einops.__version__
    except ImportError:
        pass

    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data.setdefault("format", 1)
    data["mask_id"], data["eos_id"] = MASK, EOS
    data["checkpoint_builder_sha256"] = sha256_file(BUILDERS_DIR / "checkpoint_builders.py")
    data["weights_sha256_method"] = ("sha256 over the checkpoint's tensors sorted by name: for each, the utf-8 "
                                     "name, one NUL byte, then the float32 little-endian bytes (C order)")
    data["margin_definitions"] = dict(
        min_margin="smallest, over all selection decisions of the run, of (lowest confidence among the positions "
                   "committed in that step) - (highest confidence among the eligible masked positions left masked); "
                   "where a threshold < 1 takes part, also of |confidence - threshold| over the eligible positions. "
                   "Units are those of the confidence the algorithm uses. null: no confidence-based choice.",
        min_argmax_logit_gap="smallest top1 - top2 logit gap of any committed token (float32 logits)")
    try:
        tmp_results = {}
        for family in families:
            tmp_results[family] = run_family(family, args.sources.resolve(), tmp, builders)
            data.setdefault("environments", {})[family] = env
            data.setdefault("sources", {})
            for rel, meta in used.items():
                if rel.startswith(family + "/"):
                    data["sources"][rel] = meta
        fixtures = [f for f in data.get("fixtures", []) if f["family"] not in families]
        for family in families:
            fixtures += tmp_results[family]
        order = {f["id"]: i for i, f in enumerate(FIXTURES)}
        data["fixtures"] = sorted(fixtures, key=lambda f: order.get(f["id"], len(order)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    bad = [f["id"] for f in data["fixtures"] if not f["replay_matches"]]
    print(f"wrote {args.out} ({len(data['fixtures'])} fixtures)" + (f"; replay mismatches: {bad}" if bad else ""))


if __name__ == "__main__":
    main()
