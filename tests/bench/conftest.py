from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.make_tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "tiny"
    make_tiny(directory)
    return directory


@pytest.fixture(scope="module")
def without_ardit_env():
    """The services a benchmark starts read only its own flags: no ARDIT_* setting of the caller's leaks in."""
    with pytest.MonkeyPatch.context() as patch:
        for key in [key for key in os.environ if key.startswith("ARDIT_")]:
            patch.delenv(key)
        yield
