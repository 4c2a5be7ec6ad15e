"""The synthetic world the small model learns: one flat shape on a flat background, and captions that say so.

A scene is (shape, colour, position, size, background). It renders deterministically with PIL at 128x128 and
is described by captions from a small grammar with varied wording ("a small red circle on the left, blue
background", "blue backdrop with a little red disc at the left", ...). Held-out captions are those whose
(shape, colour, position) triple never occurs in training; every pair inside a held-out triple still does,
so the model must compose what it has seen.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from itertools import product

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 128

# Well separated in RGB, so the nearest-palette-colour rule of the detector is unambiguous.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (245, 215, 30),
    "purple": (140, 50, 180),
    "orange": (245, 130, 20),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
COLOURS = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle", "star")
# Centre of the shape's bounding box for each position word.
POSITIONS: dict[str, tuple[int, int]] = {
    "left": (36, 64),
    "right": (92, 64),
    "top": (64, 36),
    "bottom": (64, 92),
    "centre": (64, 64),
}
SIZES: dict[str, int] = {"small": 36, "large": 56}  # bounding-box side in pixels
STAR_INNER_RATIO = 0.45

SHAPE_WORDS = {"circle": ("circle", "disc"), "square": ("square", "box"), "triangle": ("triangle",), "star": ("star",)}
SIZE_WORDS = {"small": ("small", "little"), "large": ("large", "big")}
POSITION_WORDS = {
    "left": ("on the left", "at the left", "to the left"),
    "right": ("on the right", "at the right", "to the right"),
    "top": ("at the top", "near the top", "on top"),
    "bottom": ("at the bottom", "near the bottom", "low down"),
    "centre": ("in the centre", "in the center", "in the middle"),
}
TEMPLATES = (
    "a {size} {colour} {shape} {pos}, {bg} background",
    "{bg} backdrop with a {size} {colour} {shape} {pos}",
    "a {size} {colour} {shape} {pos} on a {bg} background",
    "{size} {colour} {shape} {pos} against a {bg} background",
    "on a {bg} background, a {size} {colour} {shape} {pos}",
)
HELD_OUT_TRIPLES = 32


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    position: str
    size: str
    background: str

    @property
    def triple(self) -> tuple[str, str, str]:
        return self.shape, self.colour, self.position


def all_scenes() -> list[Scene]:
    """Every scene the world holds (the shape's colour always differs from the background's)."""
    return [
        Scene(shape, colour, position, size, bg)
        for shape, colour, position, size, bg in product(SHAPES, COLOURS, POSITIONS, SIZES, COLOURS)
        if colour != bg
    ]


def held_out_triples(count: int = HELD_OUT_TRIPLES, seed: int = 0) -> frozenset[tuple[str, str, str]]:
    """(shape, colour, position) triples kept out of training, chosen so that each of their three pairs still
    occurs in at least two training triples. Fixed for a seed."""
    triples = list(product(SHAPES, COLOURS, POSITIONS))
    random.Random(seed).shuffle(triples)
    pairs: dict[tuple, int] = {}

    def keys(t):
        return (("sc", t[0], t[1]), ("sp", t[0], t[2]), ("cp", t[1], t[2]))

    for t in triples:
        for k in keys(t):
            pairs[k] = pairs.get(k, 0) + 1
    held: set[tuple[str, str, str]] = set()
    for t in triples:
        if len(held) == count:
            break
        if all(pairs[k] > 2 for k in keys(t)):
            held.add(t)
            for k in keys(t):
                pairs[k] -= 1
    return frozenset(held)


def split_scenes(seed: int = 0) -> tuple[list[Scene], list[Scene]]:
    """(training scenes, held-out scenes)."""
    held = held_out_triples(seed=seed)
    scenes = all_scenes()
    return [s for s in scenes if s.triple not in held], [s for s in scenes if s.triple in held]


def caption(scene: Scene, rng: random.Random) -> str:
    """One wording of ``scene``, drawn from the grammar."""
    return rng.choice(TEMPLATES).format(
        size=rng.choice(SIZE_WORDS[scene.size]),
        colour=scene.colour,
        shape=rng.choice(SHAPE_WORDS[scene.shape]),
        pos=rng.choice(POSITION_WORDS[scene.position]),
        bg=scene.background,
    )


def _polygon(scene: Scene) -> list[tuple[float, float]] | None:
    cx, cy = POSITIONS[scene.position]
    half = SIZES[scene.size] / 2
    if scene.shape == "triangle":  # apex up, base at the bottom of the box
        return [(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)]
    if scene.shape == "star":  # five points, scaled so its bounding box is the size's square
        outer = [(math.sin(2 * math.pi * k / 5), -math.cos(2 * math.pi * k / 5)) for k in range(5)]
        points = []
        for k in range(10):
            r = 1.0 if k % 2 == 0 else STAR_INNER_RATIO
            a = math.pi * k / 5
            points.append((r * math.sin(a), -r * math.cos(a)))
        xs, ys = [p[0] for p in outer], [p[1] for p in outer]
        sx, sy = (max(xs) - min(xs)) / 2, (max(ys) - min(ys)) / 2
        oy = (max(ys) + min(ys)) / 2
        return [(cx + half * x / sx, cy + half * (y - oy) / sy) for x, y in points]
    return None


def shape_mask(scene: Scene) -> np.ndarray:
    """Boolean [128, 128] mask of the shape's pixels."""
    image = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 0)
    draw = ImageDraw.Draw(image)
    cx, cy = POSITIONS[scene.position]
    half = SIZES[scene.size] / 2
    box = (cx - half, cy - half, cx + half - 1, cy + half - 1)
    if scene.shape == "circle":
        draw.ellipse(box, fill=255)
    elif scene.shape == "square":
        draw.rectangle(box, fill=255)
    else:
        draw.polygon(_polygon(scene), fill=255)
    return np.asarray(image) > 127


def cell_coverage(scene: Scene, cell: int) -> np.ndarray:
    """float [rows, cols]: the share of each ``cell`` x ``cell`` pixel block that the shape covers."""
    mask = shape_mask(scene).astype(np.float64)
    rows, cols = mask.shape[0] // cell, mask.shape[1] // cell
    return mask[: rows * cell, : cols * cell].reshape(rows, cell, cols, cell).mean(axis=(1, 3))


def render(scene: Scene) -> np.ndarray:
    """uint8 [128, 128, 3] picture of ``scene``."""
    pixels = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    pixels[:] = PALETTE[scene.background]
    pixels[shape_mask(scene)] = PALETTE[scene.colour]
    return pixels


@dataclass(frozen=True)
class Example:
    scene: Scene
    caption: str


def examples(scenes: list[Scene], count: int, seed: int) -> list[Example]:
    """``count`` (scene, caption) pairs: scenes cycled in a seeded order, each with a freshly drawn wording."""
    rng = random.Random(seed)
    order: list[Scene] = []
    while len(order) < count:
        batch = list(scenes)
        rng.shuffle(batch)
        order.extend(batch)
    return [Example(scene, caption(scene, rng)) for scene in order[:count]]
