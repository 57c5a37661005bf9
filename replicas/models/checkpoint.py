"""Checkpoint format: a local directory with config.json, *.safetensors and tokenizer files.

Nothing is ever fetched from a hub: every file comes from the directory given.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from replicas.models.defaults import ModelSettingsError, apply_overrides, listed_ids, with_stop_ids
from replicas.models.dream import DreamModel
from replicas.models.llada import LLaDAModelLM
from replicas.models.llada2_moe import LLaDA2MoeModelLM
from replicas.models.lora import LoraError, adapter_on, merge_delta, read_adapter
from replicas.models.parallel import SINGLE, ShardingError, TensorParallel, shard_of
from replicas.models.sdar import SDARForCausalLM
from replicas.models.spec import ModelSpec
from replicas.models.tiny import TinyDllmForBlockDiffusion

ARCHITECTURES: dict[str, type[nn.Module]] = {
    cls.__name__: cls
    for cls in (TinyDllmForBlockDiffusion, LLaDAModelLM, DreamModel, LLaDA2MoeModelLM, SDARForCausalLM)
}

TINY_CHECKPOINT = Path(__file__).parent.parent / "tiny" / "checkpoint"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names what is wrong."""


def resolve_path(model: str | Path) -> Path:
    """``"tiny"`` names the checkpoint shipped with the package; anything else is a directory."""
    path = TINY_CHECKPOINT if str(model) == "tiny" else Path(model).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    return path


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file} is missing")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from exc


@contextlib.contextmanager
def _weights_left_uninitialised() -> Iterator[None]:
    """``torch.nn.init``'s initialisers as no-ops: a model built on the meta device gets its
    weights from the checkpoint, and running them there costs seconds per process (their
    first call on meta loads torch's Python reference kernels)."""
    names = [name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _build(path: Path, overrides: dict | None, tp: TensorParallel = SINGLE) -> nn.Module:
    """The architecture named in config.json, on the meta device (no memory), with the
    per-model defaults and ``overrides`` applied to its spec (``tp``: one rank's share)."""
    raw = read_config(path)
    arch = (raw.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}/config.json names architecture {arch!r}; supported: {sorted(ARCHITECTURES)}"
        )
    cls = ARCHITECTURES[arch]
    if tp.size > 1 and cls is TinyDllmForBlockDiffusion:
        raise CheckpointError(f"{arch} has no tensor-parallel layers; serve it with tensor_parallel_size 1")
    try:
        with torch.device("meta"), _weights_left_uninitialised():
            config = cls.config_class.from_dict(raw)
            net = cls(config, tp) if tp.size > 1 else cls(config)
    except ShardingError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}/config.json does not describe a {arch}: {exc}") from exc
    generation = path / "generation_config.json"
    if generation.is_file():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise CheckpointError(f"{generation} is not a valid JSON object: {exc}") from exc
        net.spec = with_stop_ids(net.spec, listed_ids(eos))
    try:
        net.spec = apply_overrides(net.spec, overrides)
    except ModelSettingsError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    return net


def weight_files(path: Path) -> dict[str, Path]:
    """Checkpoint parameter name -> the safetensors file that holds it (sharded or not)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} has no valid weight_map: {exc}") from exc
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"shard {shard} named in {index} is missing")
        return files
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{path} has neither {INDEX_FILE} nor model.safetensors")
    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}


def our_name(net: nn.Module, name: str) -> str:
    """A checkpoint parameter name under ``net``'s own naming (its ``checkpoint_renames``)."""
    for pattern, replacement in getattr(net, "checkpoint_renames", ()):
        renamed, count = re.subn(pattern, replacement, name)
        if count:
            return renamed
    return name


def _read_state(path: Path, net: nn.Module, dtype: torch.dtype, device: str,
                lora: str | Path | None, tp: TensorParallel = SINGLE) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, LoRA merged, under our parameter names; with
    ``tp``, only this rank's part of each (``replicas.models.parallel.shard_of``), read as
    such from the files, and merged with its part of the LoRA delta (B's rows of a column
    split, A's columns of a row split)."""
    scale, deltas = read_adapter(lora) if lora else (0.0, {})
    qkv = experts = None
    if tp.size > 1:  # a decoder stack (``_build`` refuses the others)
        shape = net.shape
        qkv = (shape.num_heads * shape.head_dim,) + (shape.num_kv_heads * shape.head_dim,) * 2
        experts = getattr(net.config, "num_experts", None)
    unused = set(deltas)
    by_file = defaultdict(list)
    for name, file in weight_files(path).items():
        by_file[file].append(name)
    tied = getattr(getattr(net, "shape", None), "tie_word_embeddings", False)
    state = {}
    for file, names in by_file.items():
        with safe_open(str(file), "pt") as f:
            for name in names:
                if tied and name == "lm_head.weight":
                    continue  # a tied head is the embedding; some checkpoints store a copy
                ours = our_name(net, name)
                shard = None
                if tp.size == 1:
                    tensor = f.get_tensor(name)
                else:
                    piece = f.get_slice(name)
                    shape = tuple(piece.get_shape())
                    shard = shard_of(ours, shape, tp, qkv, experts)
                    if shard is None:
                        unused.discard(name)  # another rank's (and its adapter delta's)
                        continue
                    tensor = shard.read(piece, len(shape)) if shard.ranges else f.get_tensor(name)
                if name in deltas:
                    tensor = merge_delta(tensor, *_delta_share(deltas[name], shard), scale)
                    unused.discard(name)
                state[ours] = tensor.to(
                    device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    if unused:
        raise LoraError(f"LoRA adapter {lora} targets parameters the checkpoint lacks: {sorted(unused)[:5]}")
    return state


def _delta_share(pair: tuple[torch.Tensor, torch.Tensor], shard) -> tuple[torch.Tensor, torch.Tensor]:
    """The LoRA (A, B) whose product is a rank's ``shard`` of the whole delta B @ A (None or
    no ranges: all of it)."""
    a, b = pair
    if shard is None or not shard.ranges:
        return a, b
    return (a, shard.read(b, 2)) if shard.dim == 0 else (shard.read(a, 2), b)


def load_model(model: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               lora: str | Path | None = None, overrides: dict | None = None,
               tp: TensorParallel = SINGLE) -> nn.Module:
    """Build the architecture named in config.json and load its safetensors weights
    (``lora``: a PEFT adapter directory merged into them; ``overrides``: model defaults;
    ``tp``: this tensor-parallel rank's share only)."""
    path = resolve_path(model)
    net = _build(path, overrides, tp)
    try:
        state = _read_state(path, net, dtype, device, lora, tp)
    except LoraError as exc:
        raise CheckpointError(str(exc)) from exc
    expected = set(net.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"the weights in {path} do not match {type(net).__name__}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    net.load_state_dict(state, strict=True, assign=True)
    return net.eval()


def save_model(net: nn.Module, path: str | Path) -> None:
    """Write config.json and model.safetensors (tokenizer files are written by their owner)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(net.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in net.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    (path / "model.safetensors").chmod(0o644)  # readable by the serving user, like config.json


def _check_tokenizer_files(path: Path) -> None:
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json or tokenizer_config.json")


def _tokenizer_class(path: Path) -> str | None:
    """The ``tokenizer_class`` that tokenizer_config.json names, if it names one."""
    try:
        named = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return named if isinstance(named, str) else None


def load_tokenizer(model: str | Path):
    """The checkpoint's tokenizer through transformers, from local files only.

    A tokenizer of transformers' generic fast class (the tiny model's, LLaDA's) is loaded by
    that class itself, as AutoTokenizer would: importing AutoTokenizer costs about 2 s more
    per process (it indexes every model transformers knows)."""
    path = resolve_path(model)
    _check_tokenizer_files(path)
    from transformers.utils import logging as hf_logging

    if _tokenizer_class(path) == "PreTrainedTokenizerFast":
        from transformers import PreTrainedTokenizerFast as loader
    else:
        from transformers import AutoTokenizer as loader
    # AutoTokenizer also reads config.json and warns that it does not know our model types
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return loader.from_pretrained(str(path), local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)


def load_model_spec(model: str | Path, overrides: dict | None = None) -> ModelSpec:
    """The engine-facing facts of a checkpoint (block length, ids, limits) without its weights."""
    return _build(resolve_path(model), overrides).spec


def check_checkpoint(model: str | Path, lora: str | Path | None = None, overrides: dict | None = None,
                     tensor_parallel_size: int = 1, expert_parallel_size: int | None = None,
                     adapters: dict[str, str] | None = None) -> ModelSpec:
    """Everything ``load_model`` and ``load_tokenizer`` would find wrong short of reading the
    weights (config, architecture, overrides, a split over ``tensor_parallel_size`` ranks
    and its experts over ``expert_parallel_size`` parts, shards, tokenizer and adapter
    files, and every unmerged adapter's modules, rank and shapes): a server checks this
    before it starts any process."""
    path = resolve_path(model)
    net = _build(path, overrides)
    if expert_parallel_size is not None and not hasattr(net.config, "num_experts"):
        raise CheckpointError(f"{path} is not a mixture of experts: expert_parallel_size applies to MoE models "
                              "(LLaDA2.0) only")
    if tensor_parallel_size > 1:
        try:
            tp = TensorParallel(0, tensor_parallel_size, expert_size=expert_parallel_size)
        except ShardingError as exc:
            raise CheckpointError(str(exc)) from exc
        _build(path, overrides, tp)
    weight_files(path)
    _check_tokenizer_files(path)
    if lora:
        try:
            read_adapter(lora)
        except LoraError as exc:
            raise CheckpointError(str(exc)) from exc
    if adapters:
        _check_adapters(net, adapters)
    return net.spec


def _check_adapters(net: nn.Module, adapters: dict[str, str]) -> None:
    """Raise CheckpointError, naming the adapter and the module, for an unmerged adapter
    ``net`` (on the meta device) cannot take."""
    from replicas.adapters import enable_adapters

    try:
        bank = enable_adapters(net)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    for name, directory in adapters.items():
        try:
            adapter_on(bank.linears, directory, lambda n: our_name(net, n))
        except LoraError as exc:
            raise CheckpointError(f"adapter {name!r}: {exc}") from exc
