"""Tiny DiT-stage checkpoints in the upstream MammothModa2 layout, loaded through the real checkpoint path."""

from __future__ import annotations

import json

import pytest
import torch

from dit_service.model.pipeline import DiTPipeline
from dit_service.model.tiny import tiny_gen_parts
from servicekit.checkpoint import open_checkpoint, save_tensors

CONDITION_DIM = 64
#: The tiny Dev DiT's LLM width: unlike the Preview tiny's, not the DiT's 64, so that a row of the wrong width fails.
DEV_CONDITION_DIM = 48


def write_root(root, with_refiner: bool = False, mutate=None, dev: bool = False):
    """A checkpoint root holding only the DiT-stage parts (the AR's are not needed to open it); ``dev``: the tiny DiT
    in the Dev layout (Q-Former inside it) behind a Qwen3-VL llm_config of width DEV_CONDITION_DIM."""
    width = DEV_CONDITION_DIM if dev else CONDITION_DIM
    parts, tensors = tiny_gen_parts(width, with_refiner=with_refiner, dev=dev)
    llm_type = "mammothmoda2_qwen3_vl" if dev else "mammothmoda2_qwen2_5_vl"
    config = {"model_type": "mammothmoda2", "architectures": ["Mammothmoda2Model"],
              "llm_config": {"model_type": llm_type, "text_config": {"hidden_size": width}},
              **parts}
    if mutate is not None:
        mutate(config, tensors)
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_tensors(root, tensors)
    return root


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return write_root(tmp_path_factory.mktemp("tiny_dit"))


@pytest.fixture(scope="session")
def refiner_root(tmp_path_factory):
    return write_root(tmp_path_factory.mktemp("tiny_dit_refiner"), with_refiner=True)


@pytest.fixture(scope="session")
def dev_root(tmp_path_factory):
    return write_root(tmp_path_factory.mktemp("tiny_dit_dev"), dev=True)


@pytest.fixture(scope="session")
def dev_pipeline(dev_root):
    return DiTPipeline.from_checkpoint(open_checkpoint(dev_root))


@pytest.fixture(scope="session")
def pipeline(tiny_root):
    return DiTPipeline.from_checkpoint(open_checkpoint(tiny_root))


@pytest.fixture(scope="session")
def refiner_pipeline(refiner_root):
    return DiTPipeline.from_checkpoint(open_checkpoint(refiner_root))


@pytest.fixture(scope="session")
def text():
    return torch.randn(5, CONDITION_DIM, generator=torch.Generator().manual_seed(123))


@pytest.fixture(scope="session")
def image():
    return torch.randn(12, CONDITION_DIM, generator=torch.Generator().manual_seed(321))


@pytest.fixture(scope="session")
def empty():
    return torch.zeros(0, CONDITION_DIM)
