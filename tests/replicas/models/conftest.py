from pathlib import Path

import pytest

from checkpoint_builders import write_checkpoint


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """``checkpoint_dir(arch)``: one tiny random checkpoint per architecture, built once."""
    built = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = write_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return built[arch]
    return get
