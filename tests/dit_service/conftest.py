"""One tiny DiT stack per test session, written with the same function tools/make_tiny.py uses."""

from __future__ import annotations

import pytest
import torch

from dit_service.model.pipeline import DiTPipeline
from dit_service.model.tiny import write_tiny_dit_stack

CONDITION_DIM = 64


@pytest.fixture(scope="session")
def tiny_dit_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_dit")
    write_tiny_dit_stack(root, condition_dim=CONDITION_DIM)
    return root


@pytest.fixture(scope="session")
def pipeline(tiny_dit_dir):
    return DiTPipeline.from_directory(tiny_dit_dir)


@pytest.fixture(scope="session")
def condition():
    return torch.randn(12, CONDITION_DIM, generator=torch.Generator().manual_seed(123))


@pytest.fixture(scope="session")
def empty_condition():
    return torch.zeros(0, CONDITION_DIM)
