"""Token-for-token reference fixtures of D2F (Discrete Diffusion Forcing) decoding of LLaDA with a LoRA adapter.

The published D2F code (zhijie-group/Discrete-Diffusion-Forcing, pinned in SOURCES below) is run in a
separate virtualenv (see D2F.md in this folder) with ``--sources`` pointing at a directory holding the
published files; their sha256 is checked before anything runs.  The script

1. writes the tiny random LLaDA checkpoint of ``checkpoint_builders.write_checkpoint`` and a random PEFT
   LoRA adapter for it (``adapter_config.json`` + ``adapter_model.safetensors``, seed-fixed) into a
   temporary folder,
2. loads both with the published loader (``DreamLoRA._create_model_and_tokenizer`` of ``eval_llada.py``:
   the repository's own ``LLaDAModelLM``, then ``PeftModel.from_pretrained``, not merged) in float32 on the
   CPU,
3. runs the published ``DreamLoRA._generate_block_single`` (the generate of the repository's evaluation)
   with the settings in FIXTURES, while a wrapper around the base model's ``forward`` records every
   forward call (input ids, cache length, ``update_kvcache``, attention bias, logits),
4. replays the whole block state machine from the recorded logits with the rules written in D2F.md (an
   independent re-implementation, a check that the description is right): every forward's input range,
   cache length and attention mask, every commit, and the returned sequence must match; it measures the
   decision margins, and
5. writes ``d2f_fixtures.json``.

``eval_llada.py`` imports lm_eval, accelerate and datasets at module level; none of that is needed by the
generate function, so only the functions it needs are taken from the file (by parsing it) and executed.
Nothing of the published code is contained here.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT_PATH = HERE / "d2f_fixtures.json"
BUILDERS_DIR = HERE.parent  # tests/replicas/models, home of checkpoint_builders.py
sys.path.insert(0, str(HERE))
from make_fixtures import MASK, EOS, sha256_file, Recorder as ForwardRecorder  # noqa: E402  (helpers only; no published code there)

REPO, COMMIT = "zhijie-group/Discrete-Diffusion-Forcing", "771f745f6770230dd6ea6a283519b31c5d57e6ed"
SOURCES = {
    "d2f/eval_llada.py": dict(
        repo=REPO, commit=COMMIT, path="D2F-eval/eval_llada.py",
        sha256="cc9b2623da152f174b41de5d7b0b094e15e2797edd113bb18876758238a94181"),
    "d2f/model_cache/llada/modeling_llada.py": dict(
        repo=REPO, commit=COMMIT, path="D2F-eval/model_cache/llada/modeling_llada.py",
        sha256="8448e89ceabe28c06428156c17527da48fabebc5ceebef7b282639ad83c773b2"),
    "d2f/model_cache/llada/configuration_llada.py": dict(
        repo=REPO, commit=COMMIT, path="D2F-eval/model_cache/llada/configuration_llada.py",
        sha256="c947a64d8b735affa69d5adeb416c83ce607c8925270884e4471ae11068e2bfe"),
}

# The random adapter: the LoRA settings of the repository's LLaDA training code
# (D2F-train/utils/model.py get_llada: LoraConfig(r=32, lora_alpha=32, lora_dropout=0.1,
# target_modules=["q_proj", "v_proj", "k_proj", "attn_out"]), no task_type).
ADAPTER_CONFIG = {
    "peft_type": "LORA", "task_type": None, "r": 32, "lora_alpha": 32, "lora_dropout": 0.1,
    "target_modules": ["q_proj", "v_proj", "k_proj", "attn_out"], "bias": "none", "fan_in_fan_out": False,
    "inference_mode": True, "base_model_name_or_path": None, "use_rslora": False,
}
ADAPTER_A_SCALE, ADAPTER_B_SCALE = 0.1, 0.2  # delta = B @ A has entries of about sqrt(32) * 0.02 = 0.11

CHECKPOINT_SEED, ADAPTER_SEED = 0, 101

# DreamLoRA constructor arguments that _generate_block_single reads (attributes of the instance).
# Greedy: temperature 0 (the value of every setting of eval_llada.sh), top_p/top_k None,
# sampling_strategy "default" (confidence = probability of the argmax).
BASE = dict(temperature=0.0, top_p=None, top_k=None, sampling_strategy="default", mask_token_id=MASK,
            max_length=64, dtype="float32")
FIXTURES = [
    # the class defaults (block_add_threshold 0.5, decoded_token_threshold 0.9) except skip_threshold
    dict(id="d2f_g16_b4_add05_dec09_skip003", prompt="Hello world",
         kwargs=dict(BASE, max_new_tokens=16, block_size=4, block_add_threshold=0.5,
                     decoded_token_threshold=0.9, skip_threshold=None)),
    # early block adds, early completion: several blocks decode at once
    dict(id="d2f_g32_b8_add01_dec05_skip003", prompt="Hello world",
         kwargs=dict(BASE, max_new_tokens=32, block_size=8, block_add_threshold=0.1,
                     decoded_token_threshold=0.5, skip_threshold=None)),
    # skip_threshold 1.0 (the DreamLoRA default): nothing passes the threshold, only "complete" blocks
    # commit, one token per block per step
    dict(id="d2f_g24_b4_add025_dec05_skip1", prompt="Hello world",
         kwargs=dict(BASE, max_new_tokens=24, block_size=4, block_add_threshold=0.25,
                     decoded_token_threshold=0.5, skip_threshold=1.0)),
    dict(id="d2f_g32_b8_add025_dec075_skip003_p2", prompt="The cat sat on",
         kwargs=dict(BASE, max_new_tokens=32, block_size=8, block_add_threshold=0.25,
                     decoded_token_threshold=0.75, skip_threshold=None)),
    # max_new_tokens not a multiple of block_size: max_new_tokens // block_size = 4 blocks (16 tokens)
    dict(id="d2f_g18_b4_add05_dec05_skip003_p2", prompt="The cat sat on",
         kwargs=dict(BASE, max_new_tokens=18, block_size=4, block_add_threshold=0.5,
                     decoded_token_threshold=0.5, skip_threshold=None)),
]
# thresholds 0: a block is added every step and every block is "complete" from the start (forced token
# each step); block 3 finishes before block 2 and waits, then both are cached by one forward
FIXTURES.append(
    dict(id="d2f_g16_b4_add0_dec0_skip0024", prompt="Hello world",
         kwargs=dict(BASE, max_new_tokens=16, block_size=4, block_add_threshold=0.0,
                     decoded_token_threshold=0.0, skip_threshold=0.024)))
# skip_threshold None above is filled with SKIP (chosen from the confidence distribution of the random
# checkpoint, so that some masked positions pass it and margins stay comfortable)
SKIP = 0.03

PUBLISHED_FUNCTIONS = ["create_full_block_attention_mask", "extract_attention_mask", "top_p_logits",
                       "top_k_logits", "sample_tokens"]
PUBLISHED_METHODS = ["_create_model_and_tokenizer", "_generate_block_single", "_update_block_completion_states"]


def check_sources(sources: Path) -> dict:
    for rel, meta in SOURCES.items():
        path = sources / rel
        if not path.is_file():
            raise SystemExit(f"missing published file {path} (from {meta['repo']}@{meta['commit']}:{meta['path']})")
        digest = sha256_file(path)
        if digest != meta["sha256"]:
            raise SystemExit(f"{path}: sha256 {digest} differs from the pinned {meta['sha256']}")
    return SOURCES


def get_dtype_standin(dtype):
    """What lm_eval.models.utils.get_dtype does: a torch dtype from its name, anything else unchanged."""
    import torch

    if isinstance(dtype, str) and dtype != "auto":
        return getattr(torch, dtype)
    return dtype


def load_published(sources: Path):
    """The published generate, as methods of a small stand-in for eval_llada.DreamLoRA.

    Parses eval_llada.py and executes only: its module-level helper functions (mask building, sampling)
    and three methods of DreamLoRA (model loading, the block generate, the completion-state update).
    The names those bodies use are provided: torch, F, dists, the repository's LLaDA classes (imported
    from ``model_cache.llada`` exactly like eval_llada.py does), PEFT, AutoTokenizer, get_dtype."""
    import torch
    import torch.distributions as dists
    import torch.nn.functional as F
    from peft import PeftConfig, PeftModel
    from transformers import AutoTokenizer

    sys.path.insert(0, str(sources / "d2f"))
    from model_cache.llada.configuration_llada import LLaDAConfig
    from model_cache.llada.modeling_llada import LLaDAModelLM

    path = sources / "d2f" / "eval_llada.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in PUBLISHED_FUNCTIONS]
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DreamLoRA"]
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in PUBLISHED_METHODS]
    if {n.name for n in functions} != set(PUBLISHED_FUNCTIONS) or {n.name for n in methods} != set(PUBLISHED_METHODS):
        raise SystemExit(f"{path}: expected functions not found")
    namespace = dict(torch=torch, F=F, dists=dists, LLaDAModelLM=LLaDAModelLM, LLaDAConfig=LLaDAConfig,
                     PeftConfig=PeftConfig, PeftModel=PeftModel, AutoTokenizer=AutoTokenizer,
                     get_dtype=get_dtype_standin, eval_logger=logging.getLogger("eval_llada"))
    exec(compile(ast.Module(body=functions + methods, type_ignores=[]), str(path), "exec"), namespace)
    return type("PublishedDreamLoRA", (), {name: namespace[name] for name in PUBLISHED_METHODS})


def make_instance(cls, ckpt: Path, adapter: Path, kw: dict):
    """The attribute assignments of DreamLoRA.__init__ that the generate reads, then its model loading."""
    import torch

    obj = cls()
    obj.device = torch.device("cpu")
    obj.lora_path = str(adapter)
    obj.block_size = kw["block_size"]
    obj.block_add_threshold = kw["block_add_threshold"]
    obj.skip_threshold = kw["skip_threshold"]
    obj.sampling_strategy = kw["sampling_strategy"]
    obj.decoded_token_threshold = kw["decoded_token_threshold"]
    obj.target_dtype = get_dtype_standin(kw["dtype"])
    obj._create_model_and_tokenizer(str(ckpt), kw["dtype"], True)
    obj.max_length = kw["max_length"]
    obj.max_new_tokens = kw["max_new_tokens"]
    obj.temperature = kw["temperature"]
    obj.top_p = kw["top_p"]
    obj.top_k = kw["top_k"]
    obj.mask_token_id = kw["mask_token_id"]
    return obj


# --------------------------------------------------------------------------------------------

def write_adapter(path: Path, ckpt: Path, seed: int) -> dict:
    """A random PEFT LoRA adapter for the checkpoint: lora_A [r, in], lora_B [out, r], both nonzero."""
    import torch
    from safetensors.torch import load_file, save_file

    shapes = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        shapes |= {n: t.shape for n, t in load_file(str(shard)).items()}
    r = ADAPTER_CONFIG["r"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in ADAPTER_CONFIG["target_modules"]:
            continue
        out_dim, in_dim = shapes[name]
        tensors[f"base_model.model.{module}.lora_A.weight"] = ADAPTER_A_SCALE * torch.randn(r, in_dim, generator=generator)
        tensors[f"base_model.model.{module}.lora_B.weight"] = ADAPTER_B_SCALE * torch.randn(out_dim, r, generator=generator)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(ADAPTER_CONFIG, indent=2))
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return tensors


def tensors_sha256(tensors: dict) -> str:
    """Same method as fixtures.json's weights_sha256, over a dict of tensors."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + b"\0")
        digest.update(tensors[name].contiguous().float().numpy().astype("<f4", copy=False).tobytes())
    return digest.hexdigest()


def prepare(tmp: Path, seed: int, adapter_seed: int, builders):
    ckpt = tmp / f"ckpt_llada_{seed}"
    builders.write_checkpoint(ckpt, "LLaDAModelLM", seed=seed)
    wsha = builders.weights_sha256(ckpt)
    model_dir = tmp / f"model_llada_{seed}"
    shutil.copytree(ckpt, model_dir)
    # transformers refuses safetensors shards without {"format": "pt"} metadata (the builder writes none):
    # re-save the copy's shards with it, tensors unchanged
    from safetensors.torch import load_file, save_file
    for shard in sorted(model_dir.glob("*.safetensors")):
        save_file(load_file(str(shard)), str(shard), metadata={"format": "pt"})
    adapter_dir = tmp / f"adapter_{seed}_{adapter_seed}"
    tensors = write_adapter(adapter_dir, ckpt, adapter_seed)
    return ckpt, model_dir, adapter_dir, wsha, tensors_sha256(tensors)


class Recorder(ForwardRecorder):
    """Wraps the base LLaDAModelLM's forward (instance attribute: PeftModel.forward calls
    get_base_model()(...), which goes through it), recording D2F's cache arguments."""

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        past = kwargs.get("past_key_values")
        bias = kwargs.get("attention_bias")
        self.calls.append(dict(
            input_ids=input_ids.detach().clone(),
            past_length=0 if past is None else int(past[0][0].shape[-2]),
            update_kvcache=kwargs.get("update_kvcache"),
            use_cache=kwargs.get("use_cache"),
            attention_bias=None if bias is None else bias.detach().clone(),
            logits=out.logits.detach().clone()))
        return out


# --------------------------------------------------------------------------------------------
# Replay: the D2F state machine as described in D2F.md, re-implemented here, run on the recorded logits.

def expected_mask(prompt_len: int, block: int, start: int, length: int, cache_len: int):
    """Block-causal additive mask for the rows start..start+length-1 over the columns 0..cache_len-1
    (the cache) followed by start..start+length-1 (the input)."""
    import torch

    def blk(p):  # 0 for the prompt, b >= 1 for the b-th generated block
        return 0 if p < prompt_len else 1 + (p - prompt_len) // block

    cols = list(range(cache_len)) + list(range(start, start + length))
    rows = [blk(p) for p in range(start, start + length)]
    allowed = torch.tensor([[blk(c) <= r for c in cols] for r in rows])
    return torch.where(allowed, 0.0, float("-inf"))[None, None]


def replay(calls, prompt_ids, returned, kw):
    import torch

    P, B = len(prompt_ids), kw["block_size"]
    skip, add_thr, dec_thr = kw["skip_threshold"], kw["block_add_threshold"], kw["decoded_token_threshold"]
    nblocks = kw["max_new_tokens"] // B
    x = list(prompt_ids)
    blocks = [dict(start=0, end=P, total=P, masks=0, state="to_cache", complete=True)]
    cache_len, n_active, eos = 0, 0, False
    mismatches, steps = [], []
    margins = dict(threshold=math.inf, forced=math.inf, argmax_gap=math.inf)
    mask_commits = 0
    t = 0
    while True:
        # 1. add one block if the last block's decoded fraction reached block_add_threshold
        if len(blocks) - 1 < nblocks and not eos:
            last = blocks[-1]
            if (last["total"] - last["masks"]) / last["total"] >= add_thr:
                blocks.append(dict(start=len(x), end=len(x) + B, total=B, masks=B, state="active", complete=False))
                x += [MASK] * B
                n_active += 1
        # 2. a block whose decoded fraction reached decoded_token_threshold makes the next one "complete"
        for i, b in enumerate(blocks):
            if (b["total"] - b["masks"]) / b["total"] >= dec_thr and i + 1 < len(blocks):
                blocks[i + 1]["complete"] = True
        # 3. stop when nothing is masked and no block is active
        if MASK not in x and n_active == 0:
            break
        # 4. the forward's input: from the first block to cache (caching forward) or the first active block
        to_cache = [i for i, b in enumerate(blocks) if b["state"] == "to_cache"]
        update = 0
        if to_cache:
            update = blocks[max(to_cache)]["end"] - blocks[min(to_cache)]["start"]
            start = blocks[min(to_cache)]["start"]
        else:
            starts = [b["start"] for b in blocks if b["state"] == "active" and b["start"] >= cache_len]
            if not starts:
                mismatches.append(f"step {t}: no block to forward")
                break
            start = min(starts)
        if t >= len(calls):
            mismatches.append(f"step {t}: the published run made only {len(calls)} forward calls")
            break
        call = calls[t]
        if call["input_ids"][0].tolist() != x[start:]:
            mismatches.append(f"call {t}: input differs (replayed start {start})")
        if call["past_length"] != cache_len or call["update_kvcache"] != update + cache_len:
            mismatches.append(f"call {t}: cache length {call['past_length']} / update_kvcache "
                              f"{call['update_kvcache']}, replayed {cache_len} / {update + cache_len}")
        if not torch.equal(call["attention_bias"].float(), expected_mask(P, B, start, len(x) - start, cache_len)):
            mismatches.append(f"call {t}: attention bias is not the block-causal mask")
        logits = call["logits"][0]
        record = dict(call=t, input_start=start, input_length=len(x) - start, cache_length=cache_len,
                      cached_blocks=[i for i in to_cache], new_cache_length=cache_len + update,
                      active_blocks=[], waiting_blocks=[], complete_blocks=[], forced_blocks=[], commits={})
        for i in to_cache:
            blocks[i]["state"] = "in_cache"
        # 5. decisions in every active block, all from this one forward
        finished = []
        for i, b in enumerate(blocks):
            if b["state"] != "active":
                continue
            masked = [p for p in range(b["start"], b["end"]) if x[p] == MASK]
            if not masked:
                record["waiting_blocks"].append(i)
                finished.append(i)
                continue
            record["active_blocks"].append(i)
            if b["complete"]:
                record["complete_blocks"].append(i)
            block_logits = logits[[p - start for p in masked]]
            probs = torch.softmax(block_logits, dim=-1)
            conf, x0 = probs.max(dim=-1)
            high = (conf > skip).nonzero().flatten().tolist()
            margins["threshold"] = min(margins["threshold"], float((conf.double() - skip).abs().min()))
            chosen = high
            if b["complete"] and not high:
                chosen = [int(torch.topk(conf, 1).indices[0])]
                record["forced_blocks"].append(i)
                if len(masked) > 1:
                    top2 = conf.double().topk(2).values
                    margins["forced"] = min(margins["forced"], float(top2[0] - top2[1]))
            commits = []
            for j in sorted(chosen):
                tok = int(x0[j])
                x[masked[j]] = tok
                commits.append([masked[j], tok])
                mask_commits += tok == MASK
                top2 = block_logits[j].double().topk(2).values
                margins["argmax_gap"] = min(margins["argmax_gap"], float(top2[0] - top2[1]))
                if tok == 126081:  # the EOS id eval_llada.py checks (outside this vocabulary)
                    eos = True
            b["masks"] -= len(chosen)  # counts commits (what the add/complete fractions use)
            if commits:
                record["commits"][str(i)] = commits
            if MASK not in x[b["start"]:b["end"]]:  # finished: judged on the canvas, not on the count
                finished.append(i)
        # 6. a finished block goes to "to_cache" once no earlier block is active
        for i in finished:
            if blocks[i]["state"] == "active" and all(blocks[k]["state"] != "active" for k in range(i)):
                blocks[i]["state"] = "to_cache"
                n_active -= 1
        cache_len += update
        steps.append(record)
        t += 1
    if t != len(calls):
        mismatches.append(f"replay made {t} forward calls, the published run {len(calls)}")
    if x[P:] != returned:
        mismatches.append("replayed final canvas differs from the returned tokens")
    return dict(steps=steps, mismatches=mismatches, margins=margins, mask_commits=mask_commits)


# --------------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", type=Path, required=True, help="directory of published files (D2F.md layout)")
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    parser.add_argument("--seed", type=int, default=CHECKPOINT_SEED, help="checkpoint seed (for choosing seeds)")
    parser.add_argument("--adapter-seed", type=int, default=ADAPTER_SEED)
    parser.add_argument("--skip", type=float, default=SKIP, help="skip_threshold where FIXTURES leave it open")
    parser.add_argument("--check-merged", action="store_true",
                        help="also rerun every fixture with the adapter merged (peft merge_and_unload) and report "
                             "whether the tokens are the same (not part of the published code path)")
    args = parser.parse_args()

    used = check_sources(args.sources.resolve())
    tmp = Path(tempfile.mkdtemp(prefix="dllm-d2f-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import torch
    import transformers
    import tokenizers
    import safetensors
    import peft
    import numpy

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    sys.path.insert(0, str(BUILDERS_DIR))
    import checkpoint_builders as builders

    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               peft=peft.__version__, tokenizers=tokenizers.__version__, safetensors=safetensors.__version__,
               numpy=numpy.__version__)
    try:
        import accelerate
        env["accelerate"] = accelerate.__version__
    except ImportError:
        pass

    published = load_published(args.sources.resolve())
    results = []
    try:
        ckpt, model_dir, adapter_dir, wsha, asha = prepare(tmp, args.seed, args.adapter_seed, builders)
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        for fx in FIXTURES:
            kw = dict(fx["kwargs"])
            if kw["skip_threshold"] is None:
                kw["skip_threshold"] = args.skip
            prompt_ids = tokenizer.encode(fx["prompt"]).ids
            prompt = torch.tensor([prompt_ids], dtype=torch.long)
            runs = {}
            for variant in ["published"] + (["merged"] if args.check_merged else []):
                obj = make_instance(published, model_dir, adapter_dir, kw)
                for p in obj.model.parameters():
                    if p.dtype != torch.float32:
                        raise SystemExit(f"parameter dtype {p.dtype}")
                if variant == "merged":
                    obj.model = obj.model.merge_and_unload()
                base = obj.model.get_base_model() if hasattr(obj.model, "get_base_model") else obj.model
                rec = Recorder(base)
                torch.manual_seed(0)
                try:
                    generated = obj._generate_block_single(prompt)
                finally:
                    rec.detach()
                runs[variant] = (generated, rec.calls, obj)
            generated, calls, obj = runs["published"]
            lora_layers = sum(1 for n, _ in obj.model.named_modules() if n.endswith(".lora_A.default"))
            rep = replay(calls, prompt_ids, generated, kw)
            steps = rep["steps"]
            multi = sum(1 for s in steps if len(s["active_blocks"]) > 1)
            record = dict(
                id=fx["id"], checkpoint_seed=args.seed, adapter_seed=args.adapter_seed, weights_sha256=wsha,
                adapter_sha256=asha, prompt_text=fx["prompt"], prompt_ids=prompt_ids,
                call="eval_llada.DreamLoRA(pretrained, lora_path, **kwargs)._generate_block_single(prompt)",
                kwargs=kw, generated_ids=generated, generated_length=len(generated),
                forward_calls=len(calls), forwards_with_several_active_blocks=multi,
                max_active_blocks=max(len(s["active_blocks"]) for s in steps),
                forwards_with_waiting_blocks=sum(1 for s in steps if s["waiting_blocks"]),
                forwards_caching_several_blocks=sum(1 for s in steps if len(s["cached_blocks"]) > 1),
                forced_commits=sum(len(s["forced_blocks"]) for s in steps),
                threshold_commits=sum(len(c) for s in steps for c in s["commits"].values())
                - sum(len(s["forced_blocks"]) for s in steps),
                threshold_commits_in_incomplete_blocks=sum(
                    len(c) for s in steps for b, c in s["commits"].items() if int(b) not in s["complete_blocks"]),
                lora_layers=lora_layers,
                min_threshold_margin=rep["margins"]["threshold"],
                min_forced_margin=None if math.isinf(rep["margins"]["forced"]) else rep["margins"]["forced"],
                min_argmax_logit_gap=rep["margins"]["argmax_gap"], mask_id_commits=rep["mask_commits"],
                replay_matches=not rep["mismatches"], replay_mismatches=rep["mismatches"][:10], steps=steps)
            if "merged" in runs:
                record["same_tokens_with_merged_adapter"] = runs["merged"][0] == generated
            results.append(record)
            flag = "ok" if record["replay_matches"] else "REPLAY MISMATCH"
            print(f"{fx['id']:36s} {flag} calls={len(calls)} multi={multi} max_active={record['max_active_blocks']} "
                  f"forced={record['forced_commits']} thr={record['threshold_commits']}/"
                  f"{record['threshold_commits_in_incomplete_blocks']} mask_commits={rep['mask_commits']} "
                  f"thr_margin={rep['margins']['threshold']:.3g} forced_margin={record['min_forced_margin']} "
                  f"gap={rep['margins']['argmax_gap']:.3g} merged_same={record.get('same_tokens_with_merged_adapter')}"
                  f"\n    gen={generated}", flush=True)
            for m in rep["mismatches"][:10]:
                print("   ", m)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    data = dict(
        format=1, mask_id=MASK, eos_id=EOS, published_eos_id=126081,
        checkpoint_builder_sha256=sha256_file(BUILDERS_DIR / "checkpoint_builders.py"),
        weights_sha256_method=("sha256 over the tensors sorted by name: for each, the utf-8 name, one NUL byte, "
                               "then the float32 little-endian bytes (C order); adapter_sha256: the same over "
                               "adapter_model.safetensors"),
        adapter=dict(config=ADAPTER_CONFIG, a_scale=ADAPTER_A_SCALE, b_scale=ADAPTER_B_SCALE,
                     tensor_names="base_model.model.model.transformer.blocks.N.<module>.lora_A.weight [r, in] / "
                                  "lora_B.weight [out, r], modules in sorted order of the checkpoint's weight names",
                     generation=("torch.Generator().manual_seed(adapter_seed); for each target weight in sorted "
                                 "name order: A = a_scale * randn(r, in), then B = b_scale * randn(out, r)")),
        margin_definitions=dict(
            min_threshold_margin="smallest |confidence - skip_threshold| over every masked position of every "
                                 "active block at every forward (confidence = softmax probability of the argmax)",
            min_forced_margin="smallest top1 - top2 confidence among the masked positions of a complete block "
                              "where no position passed skip_threshold and the most confident one was forced",
            min_argmax_logit_gap="smallest top1 - top2 logit gap of any committed token"),
        step_fields=dict(
            call="index of the forward call", input_start="absolute position of the first input token",
            input_length="input tokens (input_start to the end of the canvas)",
            cache_length="KV positions already cached (0..cache_length-1) before the call",
            cached_blocks="blocks (0 = prompt) whose KV this call stores (input_start..new_cache_length-1)",
            active_blocks="blocks in state active with masked positions: each gets a decision from this call",
            waiting_blocks="blocks in state active without masks (waiting for an earlier block to finish)",
            complete_blocks="active blocks in the 'complete' (fully activated) state at this call",
            forced_blocks="complete blocks where nothing passed skip_threshold: the argmax-confidence position "
                          "was committed",
            commits="block id -> [absolute position, token] committed from this call"),
        environment=env, sources=used, fixtures=results)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    bad = [f["id"] for f in results if not f["replay_matches"]]
    print(f"wrote {args.out} ({len(results)} fixtures)" + (f"; replay mismatches: {bad}" if bad else ""))


if __name__ == "__main__":
    main()
