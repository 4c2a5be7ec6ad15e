"""The shapes world, its visual tokenizer and the detector that the evaluator trusts."""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image, ImageFilter

from train.detect import detect
from train.shapes import (
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    Scene,
    all_scenes,
    caption,
    held_out_triples,
    render,
    split_scenes,
)
from train.visual_tokens import LEVELS, NUM_CODES, grid_token_ids, scene_codes


def sample_scenes(count: int, seed: int) -> list[Scene]:
    scenes = all_scenes()
    return random.Random(seed).sample(scenes, count)


def test_detector_reads_every_attribute_of_clean_pictures():
    scenes = sample_scenes(160, seed=1)
    wrong = [(s, detect(render(s))) for s in scenes if not detect(render(s)).scores(s)["all"]]
    assert wrong == []


@pytest.mark.parametrize("shape", SHAPES)
def test_detector_names_each_shape_at_each_size_and_position(shape):
    for size in SIZES:
        for position in POSITIONS:
            scene = Scene(shape, "red", position, size, "white")
            assert detect(render(scene)).scores(scene)["all"], scene


def test_detector_tolerates_blur_and_noise():
    """Generated pictures are softer than the renders: the detector must not need hard edges."""
    rng = np.random.default_rng(0)
    wrong = []
    for scene in sample_scenes(60, seed=2):
        soft = np.asarray(Image.fromarray(render(scene)).filter(ImageFilter.GaussianBlur(1.5))).astype(np.float64)
        noisy = np.clip(soft + rng.normal(0, 8, soft.shape), 0, 255).astype(np.uint8)
        if not detect(noisy).scores(scene)["all"]:
            wrong.append(scene)
    assert wrong == []


def test_detector_reports_a_wrong_picture_as_wrong():
    scene = Scene("circle", "red", "left", "large", "blue")
    other = Scene("star", "green", "right", "large", "yellow")
    scores = detect(render(other)).scores(scene)
    assert not any(scores.values())
    blank = np.full((128, 128, 3), 200, dtype=np.uint8)
    assert detect(blank).shape is None and not detect(blank).scores(scene)["all"]


def test_held_out_triples_never_train_but_their_pairs_do():
    train, held = split_scenes()
    triples = held_out_triples()
    assert len(triples) == 32
    assert {s.triple for s in held} == set(triples)
    assert not {s.triple for s in train} & triples
    for shape, colour, position in triples:
        assert any(s.shape == shape and s.colour == colour for s in train)
        assert any(s.shape == shape and s.position == position for s in train)
        assert any(s.colour == colour and s.position == position for s in train)


def test_captions_vary_in_wording_and_name_every_attribute():
    scene = Scene("circle", "red", "left", "small", "blue")
    rng = random.Random(0)
    wordings = {caption(scene, rng) for _ in range(200)}
    assert len(wordings) > 20
    for text in wordings:
        assert "red" in text and "blue" in text and ("circle" in text or "disc" in text)
        assert any(w in text for w in ("left",)) and any(w in text for w in ("small", "little"))


def test_visual_codes_describe_background_shape_colour_and_coverage():
    scene = Scene("square", "yellow", "centre", "large", "black")
    codes = scene_codes(scene, 16)
    assert codes.shape == (8, 8) and codes.min() >= 0 and codes.max() < NUM_CODES
    colour, level = codes // LEVELS, codes % LEVELS
    assert colour[0, 0] == COLOURS.index("black") and level[0, 0] == 0
    assert colour[4, 4] == COLOURS.index("yellow") and level[4, 4] == LEVELS - 1
    ids = grid_token_ids(codes, visual_start=1000, eol=7)
    assert len(ids) == 8 * 9 and ids[8::9] == [7] * 8 and ids[0] == 1000 + codes[0, 0]


def test_the_outline_table_says_what_each_asked_for_outline_was_read_as():
    from train.detect import Detection
    from train.evaluate import outline_table
    from train.shapes import Scene

    def row(asked: str, read: str | None) -> dict:
        scene = Scene(shape=asked, colour="red", position="left", size="large", background="blue")
        found = Detection(background="blue", shape=read, colour="red", position="left")
        return {"expected": scene, "found": found, **found.scores(scene)}

    table = outline_table([row("star", "star"), row("star", "circle"), row("triangle", None), row("circle", "circle")])
    lines = table.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    by_shape = {cells[0]: dict(zip(header, cells, strict=True))
                for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert by_shape["star"]["right"] == "1/2" and by_shape["star"]["read as circle"] == "1"
    assert by_shape["triangle"]["right"] == "0/1" and by_shape["triangle"]["read as nothing"] == "1"
    assert by_shape["circle"]["right"] == "1/1"
