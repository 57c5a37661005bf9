from pathlib import Path

import pytest

from checkpoint_builders import OVERRIDES, write_checkpoint
from replicas.engine import Engine, EngineConfig


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """``checkpoint_dir(arch)``: one tiny random checkpoint per architecture, built once."""
    built = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = write_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return built[arch]
    return get


@pytest.fixture
def checkpoint_engine(checkpoint_dir):
    """``checkpoint_engine(arch, **config)``: an engine over ``arch``'s tiny checkpoint, with
    the id overrides it needs."""
    def make(arch: str, **config) -> Engine:
        return Engine.from_pretrained(str(checkpoint_dir(arch)), EngineConfig(model_overrides=OVERRIDES[arch], **config))
    return make
