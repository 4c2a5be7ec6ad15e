"""One tiny AR-only checkpoint root per test session, in the upstream MammothModa2 layout."""

from __future__ import annotations

import pytest

from ar_service.model.loading import load_ar
from ar_service.model.tiny import write_ar_only_root


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return write_ar_only_root(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def tiny_ar(tiny_root):
    return load_ar(tiny_root)
