"""Checkpoint format: a local directory with config.json, *.safetensors and tokenizer files.

Nothing is ever fetched from a hub: every file comes from the directory given.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from replicas.models.tiny import TinyDllmForBlockDiffusion

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "TinyDllmForBlockDiffusion": TinyDllmForBlockDiffusion,
}

TINY_CHECKPOINT = Path(__file__).parent.parent / "tiny" / "checkpoint"


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


def _architecture(path: Path, raw: dict) -> type[nn.Module]:
    arch = (raw.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}/config.json names architecture {arch!r}; supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[arch]


def load_model(model: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """Build the architecture named in config.json and load its safetensors weights."""
    path = resolve_path(model)
    raw = read_config(path)
    cls = _architecture(path, raw)
    arch = cls.__name__
    net = cls(cls.config_class.from_dict(raw))
    weights_file = path / "model.safetensors"
    if not weights_file.is_file():
        raise CheckpointError(f"{weights_file} is missing")
    state = load_file(str(weights_file))
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"{weights_file} does not match {arch}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return net.to(device=device, dtype=dtype).eval()


def save_model(net: nn.Module, path: str | Path) -> None:
    """Write config.json and model.safetensors (tokenizer files are written by their owner)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(net.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in net.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    (path / "model.safetensors").chmod(0o644)  # readable by the serving user, like config.json


def load_tokenizer(model: str | Path):
    """The checkpoint's tokenizer through transformers, from local files only."""
    from transformers import AutoTokenizer

    path = resolve_path(model)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json or tokenizer_config.json")
    from transformers.utils import logging as hf_logging

    # AutoTokenizer also reads config.json and warns that it does not know our model types
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)


def load_model_spec(model: str | Path):
    """The engine-facing facts of a checkpoint (block length, ids, limits) without its weights."""
    path = resolve_path(model)
    raw = read_config(path)
    cls = _architecture(path, raw)
    with torch.device("meta"):
        return cls(cls.config_class.from_dict(raw)).spec
