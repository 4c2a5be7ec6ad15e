"""T2I prompt envelope and the grid contract. Deliberately torch-free so the gateway/engine can use it.

Sources (facts, not code): vllm-omni's MammothModa2 prompt builder and its grid logits processor
(ar_w = W // 16, ar_h = H // 16, max_tokens = ar_h * (ar_w + 1) + 1, EOL forced at col == ar_w).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

SYSTEM_PROMPT = "You are a helpful image generator."


class _VisualIds(Protocol):
    @property
    def eol_token_id(self) -> int: ...
    @property
    def visual_token_start_id(self) -> int: ...
    @property
    def visual_token_end_id(self) -> int: ...  # exclusive


@dataclass(frozen=True)
class Grid:
    """Visual-token grid in tokens: each row is `width` visual tokens followed by one EOL."""

    width: int
    height: int

    def __post_init__(self) -> None:
        if self.width < 1 or self.height < 1:
            raise ValueError(f"grid must be at least 1x1 tokens, got {self.width}x{self.height}")

    @property
    def condition_positions(self) -> int:
        """Generated positions that carry a hidden state for the DiT (all rows incl. their EOLs)."""
        return self.height * (self.width + 1)

    def row_start(self, row: int) -> int:
        """Index of row ``row``'s first position within the image condition."""
        return row * (self.width + 1)

    @property
    def decode_tokens(self) -> int:
        """Tokens sampled per image: every row plus one look-ahead token that is dropped."""
        return self.condition_positions + 1


def grid_for_size(width_px: int, height_px: int, pixels_per_token: int) -> Grid:
    """THE owner of the pixels -> grid formula; sizes must be exact multiples of pixels_per_token."""
    if pixels_per_token < 1:
        raise ValueError(f"pixels_per_token must be positive, got {pixels_per_token}")
    if width_px <= 0 or height_px <= 0:
        raise ValueError(f"image size must be positive, got {width_px}x{height_px}")
    if width_px % pixels_per_token or height_px % pixels_per_token:
        raise ValueError(
            f"image size {width_px}x{height_px} is not a multiple of {pixels_per_token} pixels per token"
        )
    return Grid(width=width_px // pixels_per_token, height=height_px // pixels_per_token)


def upscale_for(
    width_px: int, height_px: int, multiple: int, max_side: int, max_upscale: int, render_side: int
) -> int | None:
    """THE owner of the answered size -> rendered size rule. 1 when W x H itself is whole multiples of ``multiple``
    between ``multiple`` and ``max_side``; else the smallest whole factor f <= max_upscale such that W/f x H/f is
    whole multiples of ``multiple`` no larger than ``render_side`` (the size the model draws best: its default);
    None when there is none. The model renders W/f x H/f and the picture is enlarged f times."""
    for factor in range(1, max(1, max_upscale) + 1):
        if width_px % factor or height_px % factor:
            continue
        limit = max_side if factor == 1 else min(render_side, max_side)
        sides = (width_px // factor, height_px // factor)
        if all(side % multiple == 0 and multiple <= side <= limit for side in sides):
            return factor
    return None


def system_prefix() -> str:
    """The part of every T2I prompt before the user text (its K/V are computed once and shared)."""
    return f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"


def build_t2i_prompt(prompt: str, grid: Grid) -> str:
    """Chat envelope ending in the image header the AR continues from (vllm-omni MammothModa2 builder)."""
    return (
        f"{system_prefix()}{prompt}<|im_end|>\n"
        f"<|im_start|>assistant\n<|image start|>{grid.width}*{grid.height}<|image token|>"
    )


def build_negative_prompt(negative_prompt: str) -> str:
    """The negative (unconditional) envelope as released: the system and user messages through the chat template
    without the generation prompt (bytedance/mammothmoda qwen25vl ``mammothmoda2/model/processing_mammothmoda2.py``
    lines 179-183, ``add_generation_prompt=False``), i.e. no assistant header and no image tokens."""
    return f"{system_prefix()}{negative_prompt}<|im_end|>\n"


def allowed_token_range(generated_len: int, grid: Grid, t2i: _VisualIds) -> tuple[int, int]:
    """Inclusive id range the next token may take, given how many tokens were generated so far.

    ``visual_token_end_id`` is exclusive (t2i_generation_config.json semantics; see
    ar_service/model/t2i_config.py), so the last allowed visual id is ``visual_token_end_id - 1``.
    """
    col = generated_len % (grid.width + 1)
    if col == grid.width:
        return t2i.eol_token_id, t2i.eol_token_id
    return t2i.visual_token_start_id, t2i.visual_token_end_id - 1
