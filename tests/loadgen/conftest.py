"""Fixtures of the loadgen tests."""


import pytest

import live_up as cluster_helpers


@pytest.fixture
def closed_url():
    """A 127.0.0.1 URL on a port nothing listens on."""
    return f"http://127.0.0.1:{cluster_helpers.free_port()}"
