"""Model implementations, chosen by ``architectures[0]`` of a local checkpoint's config.json."""

from replicas.models.checkpoint import CheckpointError, check_checkpoint, load_model, load_model_spec, load_tokenizer, save_model
from replicas.models.spec import ModelSpec

__all__ = ["CheckpointError", "check_checkpoint", "ModelSpec", "load_model", "load_model_spec", "load_tokenizer", "save_model"]
