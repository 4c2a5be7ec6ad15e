"""One tiny AR per test session, written with the same function tools/make_tiny.py uses."""

from __future__ import annotations

import pytest

from ar_service.model.loading import load_ar
from ar_service.model.tiny import write_tiny_ar


@pytest.fixture(scope="session")
def tiny_ar_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny") / "ar"
    write_tiny_ar(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_ar(tiny_ar_dir):
    return load_ar(tiny_ar_dir)
