"""The Dev member's DiT condition: what ardit streams equals what the released Dev code builds.

The released code (bytedance/mammothmoda main, ``mamoda2/mammothmoda2/utils/t2i_utils.py`` 89-160 and 302-314)
re-encodes prompt + grid + ``<|image end|>`` in one fresh forward, averages the hidden states at
``gen_condition_layers``, splits question from answer 10 positions before the prompt's end, and keeps the question's
text ids as the text condition and the answer's generation ids as the image condition. ardit streams the decode's own
states row by row instead; both must give the same tensors (up to float reordering)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ar_service.conditions import PROMPT_TAIL, image_condition_positions, prompt_ids_for
from ar_service.generation import generate_grid
from ar_service.model.loading import load_ar
from ar_service.model.tokenizer import IMAGE_END_TOKEN
from ar_service.planning import RequestPlanner
from ar_service.prompt import Grid
from ar_service.sampling import SamplingParams
from protos.knobs import FAMILIES
from servicekit.checkpoint import SERVING_FILE, open_checkpoint
from tools.make_tiny import make_tiny_dev

SPLIT = 10  # t2i_utils.py 310: answer_start_index = prompt_ids.shape[1] - 10


@pytest.fixture(scope="module")
def dev_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("dev") / "tiny-dev"
    make_tiny_dev(root)
    return root


@pytest.fixture(scope="module")
def dev(dev_root):
    return load_ar(dev_root)


def test_the_dev_directory_is_served_as_dev_with_its_released_split(dev_root, dev) -> None:
    checkpoint = open_checkpoint(dev_root)
    assert checkpoint.member == "dev"
    assert checkpoint.serving.condition_scope == PROMPT_TAIL
    assert dev.model.config.condition_layers is not None  # the layer mean, not the final norm


def _released_condition(model, ids: list[int], prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain reading of t2i_utils.py: one forward over every id, the layer mean, the masks, the compaction."""
    config = model.config
    with torch.inference_mode():
        _, states = model(torch.tensor([ids]))
    states = states[0]
    ids_t = torch.tensor(ids)
    gen = ids_t >= config.gen_vocab_start_index
    visual = torch.isin(ids_t, torch.tensor(config.vision_placeholder_ids))
    question = torch.arange(len(ids)) < prompt_len - SPLIT
    text = question & ~(visual | gen)
    image = ~question & gen
    return states[text], states[image]


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_streamed_condition_equals_the_released_re_encode(dev, guidance) -> None:
    model, tokenizer = dev.model, dev.tokenizer
    grid = Grid(3, 2)
    prompt_ids = prompt_ids_for(tokenizer, "a red circle on a blue square", grid)
    image_end = tokenizer.convert_tokens_to_ids(IMAGE_END_TOKEN)
    result = generate_grid(model, prompt_ids, grid, dev.t2i, SamplingParams(), seed=7, guidance=guidance,
                           condition_scope=PROMPT_TAIL, image_end_id=image_end)
    assert result.token_ids[-1] == image_end  # the look-ahead is <|image end|>, fed for its state
    text, image = _released_condition(model, prompt_ids + result.token_ids, len(prompt_ids))
    # the image condition: <|image start|>, <|image token|>, every grid position, <|image end|>
    assert image.shape[0] == 2 + grid.condition_positions + 1
    assert image.shape[0] == image_condition_positions(prompt_ids, grid, PROMPT_TAIL, model.config)
    assert result.image_condition.shape == image.shape
    torch.testing.assert_close(result.image_condition, image, rtol=1e-4, atol=1e-4)
    # the text condition: the question only (no assistant header, no grid digits)
    assert result.text_condition.shape == text.shape
    assert text.shape[0] < sum(1 for t in prompt_ids if t < model.config.gen_vocab_start_index)
    torch.testing.assert_close(result.text_condition, text, rtol=1e-4, atol=1e-4)


def test_dev_plans_its_released_16x16_grid_and_split(dev_root, dev, tmp_path) -> None:
    """Without grid settings of its own a Dev directory decodes the released 16x16 grid for every square, with the
    header the AR continues from and the condition rows of the released split."""
    root = tmp_path / "dev"
    shutil.copytree(dev_root, root)
    (root / SERVING_FILE).write_text(json.dumps({"default_negative_prompt": ""}))
    checkpoint = open_checkpoint(root)
    planner = RequestPlanner(dev, checkpoint, FAMILIES[checkpoint.family], lambda decoding: True)
    for side in (512, 1024):
        plan = planner.plan(prompt="a red circle", width=side, height=side)
        assert plan.grid == Grid(16, 16)
        text = dev.tokenizer.decode(plan.prompt_ids)
        assert text.endswith("<|im_start|>assistant\n<|image start|>16*16<|image token|>")
        assert plan.image_positions == 2 + 16 * 17 + 1
        prompt_text = sum(1 for t in plan.prompt_ids if t < dev.config.gen_vocab_start_index)
        assert plan.text_positions == prompt_text - 8  # the split's 8 text ids: "<|im_start|>assistant\n16*16"
