import subprocess
import sys
from types import SimpleNamespace

import pytest

from ar_service.prompt import Grid, allowed_token_range, build_t2i_prompt, grid_for_size

IDS = SimpleNamespace(eol_token_id=100, visual_token_start_id=108, visual_token_end_id=172)  # end exclusive


def test_prompt_envelope_is_pinned():
    assert build_t2i_prompt("a red fox", Grid(64, 32)) == (
        "<|im_start|>system\nYou are a helpful image generator.<|im_end|>\n"
        "<|im_start|>user\na red fox<|im_end|>\n"
        "<|im_start|>assistant\n<|image start|>64*32<|image token|>"
    )


@pytest.mark.parametrize(
    ("w", "h", "p", "grid", "tokens"),
    [(1024, 1024, 16, Grid(64, 64), 4161), (512, 512, 16, Grid(32, 32), 1057), (256, 256, 32, Grid(8, 8), 73)],
)
def test_grid_formula(w, h, p, grid, tokens):
    got = grid_for_size(w, h, p)
    assert got == grid
    assert got.decode_tokens == tokens
    assert got.condition_positions == tokens - 1


def test_grid_is_width_by_height():
    grid = grid_for_size(512, 256, 16)
    assert (grid.width, grid.height) == (32, 16)
    assert grid.decode_tokens == 16 * 33 + 1


@pytest.mark.parametrize(("w", "h", "p"), [(1000, 1024, 16), (1024, 1000, 16), (0, 256, 16), (256, 256, 0)])
def test_bad_sizes_raise(w, h, p):
    with pytest.raises(ValueError):
        grid_for_size(w, h, p)


def test_allowed_ranges_follow_columns():
    grid = Grid(3, 2)
    ranges = [allowed_token_range(i, grid, IDS) for i in range(grid.decode_tokens)]
    visual, eol = (108, 171), (100, 100)
    assert ranges == [visual, visual, visual, eol, visual, visual, visual, eol, visual]
    assert ranges[-1] == visual  # the look-ahead token sits at column 0


def test_prompt_module_does_not_import_torch():
    code = "import sys, ar_service, ar_service.prompt; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
