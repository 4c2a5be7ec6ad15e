from __future__ import annotations

from pathlib import Path

import pytest

from tools.make_tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "tiny"
    make_tiny(directory)
    return directory
