"""A deterministic detector of what a shapes picture shows: background, shape, shape colour, position.

- background: the median colour of a 3-pixel border ring, named by the nearest palette colour;
- the shape: pixels farther from that median than half the distance from the background's palette colour to the
  nearest other palette colour (orange on yellow is the closest pair), largest 4-connected component;
- shape colour: the component's median colour, nearest palette colour;
- position: the component's bounding-box centre, nearest position anchor;
- shape: solidity (area / convex-hull area) separates the star (concave) from the convex shapes, then the
  fill of the bounding box separates square (~1), circle (~0.79) and triangle (~0.5).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from train.shapes import PALETTE, POSITIONS, Scene

BORDER = 3
MIN_AREA = 40
STAR_SOLIDITY = 0.82
SQUARE_FILL = 0.9
CIRCLE_FILL = 0.64

_NAMES = list(PALETTE)
_RGB = np.array([PALETTE[n] for n in _NAMES], dtype=np.float64)
_FOREGROUND_DISTANCE = {
    name: 0.5 * min(float(np.linalg.norm(_RGB[i] - _RGB[j])) for j in range(len(_NAMES)) if j != i)
    for i, name in enumerate(_NAMES)
}


@dataclass(frozen=True)
class Detection:
    background: str
    shape: str | None
    colour: str | None
    position: str | None

    def scores(self, scene: Scene) -> dict[str, bool]:
        """Which of the four attributes match ``scene``, and whether all do."""
        got = {
            "background": self.background == scene.background,
            "shape": self.shape == scene.shape,
            "colour": self.colour == scene.colour,
            "position": self.position == scene.position,
        }
        got["all"] = all(got.values())
        return got


def nearest_colour(rgb: np.ndarray) -> str:
    return _NAMES[int(np.argmin(((_RGB - rgb) ** 2).sum(axis=1)))]


def _largest_component(mask: np.ndarray) -> np.ndarray | None:
    """[N, 2] (row, col) pixels of the largest 4-connected component of ``mask``."""
    seen = np.zeros_like(mask, dtype=bool)
    best: list[tuple[int, int]] = []
    h, w = mask.shape
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        seen[start] = True
        queue, component = deque([start]), []
        while queue:
            r, c = queue.popleft()
            component.append((r, c))
            for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
                if 0 <= nr < h and 0 <= nc < w and mask[nr, nc] and not seen[nr, nc]:
                    seen[nr, nc] = True
                    queue.append((nr, nc))
        if len(component) > len(best):
            best = component
    return np.array(best) if best else None


def _hull_area(points: np.ndarray) -> float:
    """Area of the convex hull of pixel squares given as (row, col) centres (monotone chain over corners)."""
    corners = np.concatenate([points + d for d in ((-0.5, -0.5), (-0.5, 0.5), (0.5, -0.5), (0.5, 0.5))])
    pts = sorted({(float(x), float(y)) for y, x in corners})

    def cross(o, a, b):
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    lower: list = []
    for p in pts:
        while len(lower) >= 2 and cross(lower[-2], lower[-1], p) <= 0:
            lower.pop()
        lower.append(p)
    upper: list = []
    for p in reversed(pts):
        while len(upper) >= 2 and cross(upper[-2], upper[-1], p) <= 0:
            upper.pop()
        upper.append(p)
    hull = lower[:-1] + upper[:-1]
    return 0.5 * abs(sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(hull, hull[1:] + hull[:1], strict=True)))


def _row_extremes(pixels: np.ndarray) -> np.ndarray:
    """The leftmost and rightmost pixel of every row: enough points for the hull, far fewer than all."""
    out = []
    for r in np.unique(pixels[:, 0]):
        cols = pixels[pixels[:, 0] == r, 1]
        out.extend([(r, cols.min()), (r, cols.max())])
    return np.array(out, dtype=np.float64)


def classify_shape(pixels: np.ndarray) -> str:
    area = len(pixels)
    (r0, c0), (r1, c1) = pixels.min(axis=0), pixels.max(axis=0)
    fill = area / ((r1 - r0 + 1) * (c1 - c0 + 1))
    solidity = area / max(_hull_area(_row_extremes(pixels)), 1.0)
    if solidity < STAR_SOLIDITY:
        return "star"
    if fill >= SQUARE_FILL:
        return "square"
    if fill >= CIRCLE_FILL:
        return "circle"
    return "triangle"


def detect(image: np.ndarray) -> Detection:
    """``image``: uint8 [H, W, 3] (the evaluated size is 128x128; positions are scaled to the image)."""
    pixels = np.asarray(image, dtype=np.float64)[..., :3]
    h, w, _ = pixels.shape
    ring = np.concatenate([
        pixels[:BORDER].reshape(-1, 3), pixels[-BORDER:].reshape(-1, 3),
        pixels[:, :BORDER].reshape(-1, 3), pixels[:, -BORDER:].reshape(-1, 3),
    ])
    bg_rgb = np.median(ring, axis=0)
    background = nearest_colour(bg_rgb)
    mask = np.sqrt(((pixels - bg_rgb) ** 2).sum(axis=-1)) > _FOREGROUND_DISTANCE[background]
    component = _largest_component(mask)
    if component is None or len(component) < MIN_AREA:
        return Detection(background, None, None, None)
    colour = nearest_colour(np.median(pixels[component[:, 0], component[:, 1]], axis=0))
    (r0, c0), (r1, c1) = component.min(axis=0), component.max(axis=0)
    centre = np.array([(c0 + c1) / 2 * 128 / w, (r0 + r1) / 2 * 128 / h])
    position = min(POSITIONS, key=lambda p: float(((np.array(POSITIONS[p]) - 0.5 - centre) ** 2).sum()))
    return Detection(background, classify_shape(component), colour, position)
