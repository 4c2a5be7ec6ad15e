"""The visual tokenizer of the shapes model: one code per grid cell, 64 codes = 8 palette colours x 8 coverage levels.

The AR's grid has one token per ``pixels_per_token`` x ``pixels_per_token`` cell (16 px: an 8x8 grid for a
128x128 image, ``ar_service.prompt.grid_for_size``). A cell's code is ``colour * 8 + level``:

- level 0: the cell shows no shape (under 1/16 of its pixels), and ``colour`` is the background's;
- level k in 1..7: the shape covers about k/7 of the cell (coverage rounded to sevenths), and ``colour`` is
  the shape's.

So the grid says the background colour (in empty cells), the shape colour (in covered cells), the position
and a coarse silhouette (coverage per cell). Code c is the tokenizer's ``<|visual token c|>``, id
``visual_token_start_id + c``. The DiT never sees codes, only the AR's hidden states at those positions.
"""

from __future__ import annotations

import numpy as np

from train.shapes import COLOURS, Scene, cell_coverage

LEVELS = 8
NUM_CODES = len(COLOURS) * LEVELS  # 64: the tiny tokenizer's visual vocabulary
EMPTY_BELOW = 1 / 16


def scene_codes(scene: Scene, cell: int) -> np.ndarray:
    """int64 [rows, cols] codes of ``scene`` on a grid of ``cell``-pixel cells."""
    return coverage_codes(scene, cell_coverage(scene, cell))


def coverage_codes(scene: Scene, coverage: np.ndarray) -> np.ndarray:
    """int64 codes of cells whose shape coverage (share of the cell, 0..1) is ``coverage``, in ``scene``'s colours."""
    level = np.clip(np.rint(coverage * (LEVELS - 1)), 1, LEVELS - 1).astype(np.int64)
    empty = coverage < EMPTY_BELOW
    colour = np.where(empty, COLOURS.index(scene.background), COLOURS.index(scene.colour))
    return colour * LEVELS + np.where(empty, 0, level)


def grid_token_ids(codes: np.ndarray, visual_start: int, eol: int) -> list[int]:
    """Codes [rows, cols] -> the AR's generated ids: each row's visual tokens, then its EOL."""
    ids: list[int] = []
    for row in codes:
        ids.extend(int(visual_start + c) for c in row)
        ids.append(eol)
    return ids
