"""T2I prompt envelope and the grid contract. Deliberately torch-free so the gateway/engine can use it.

Sources (facts, not code): vllm-omni's MammothModa2 prompt builder and its grid logits processor
(ar_w = W // 16, ar_h = H // 16, max_tokens = ar_h * (ar_w + 1) + 1, EOL forced at col == ar_w); the released
MammothModa2 code (bytedance/mammothmoda, qwen25vl branch), which decodes a 32x32 grid whatever the output size
(``processing_mammothmoda2.py`` ar_height = ar_width = 32, ``modeling_mammothmoda2.py`` ``generate_t2i``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from servicekit.checkpoint import SETTING_CHOICES

SYSTEM_PROMPT = "You are a helpful image generator."


class VisualIds(Protocol):
    """The visual-token ids of ``t2i_generation_config.json`` (``T2IGenerationConfig`` has them)."""

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


GRID_RULES = SETTING_CHOICES["grid_rule"]  # the setting's choices; the first is the default
TOKEN_BUDGET, PIXELS_PER_TOKEN = GRID_RULES


class _GridSettings(Protocol):
    @property
    def grid_rule(self) -> str: ...
    @property
    def grid_tokens(self) -> int: ...
    @property
    def pixels_per_token(self) -> int: ...


@dataclass(frozen=True)
class GridRule:
    """THE owner of the rendered size -> grid rule (a checkpoint's ``ardit_serving.json`` ``grid_rule``).

    ``token_budget``: about ``tokens`` visual tokens at the image's aspect ratio, whatever its size:
    ``w = round(sqrt(tokens * W / H))``, ``h = round(sqrt(tokens * H / W))`` (halves up, each at least 1), so every
    square size gets a sqrt(tokens) x sqrt(tokens) grid (32x32 at the default 1024: the released MammothModa2 code)
    and a non-square one keeps its aspect, each token still covering a square patch.
    ``pixels_per_token``: one token per ``pixels_per_token`` pixels along each side (vllm-omni: 16), sizes being
    multiples of it (``grid_for_size``).
    """

    rule: str = TOKEN_BUDGET
    tokens: int = 1024
    pixels_per_token: int = 16

    def __post_init__(self) -> None:
        if self.rule not in GRID_RULES:
            raise ValueError(f"grid rule must be one of {', '.join(GRID_RULES)}; got {self.rule!r}")
        if self.tokens < 1 or self.pixels_per_token < 1:
            raise ValueError(f"grid tokens and pixels per token must be positive; got {self.tokens}, "
                             f"{self.pixels_per_token}")

    @classmethod
    def of(cls, serving: _GridSettings) -> GridRule:
        """The rule a checkpoint's serving settings (servicekit.checkpoint.ServingDefaults) name."""
        return cls(serving.grid_rule, serving.grid_tokens, serving.pixels_per_token)

    @property
    def pixel_multiple(self) -> int:
        """Sizes must be multiples of this for the rule (1: any size)."""
        return self.pixels_per_token if self.rule == PIXELS_PER_TOKEN else 1

    def grid(self, width_px: int, height_px: int) -> Grid:
        """The grid the AR decodes for a picture rendered at ``width_px`` x ``height_px``."""
        if self.rule == PIXELS_PER_TOKEN:
            return grid_for_size(width_px, height_px, self.pixels_per_token)
        if width_px <= 0 or height_px <= 0:
            raise ValueError(f"image size must be positive, got {width_px}x{height_px}")
        return Grid(_nearest_sqrt(self.tokens * width_px, height_px), _nearest_sqrt(self.tokens * height_px, width_px))

    def grids(self, multiple: int, max_side: int, max_pixels: int | None = None) -> set[Grid]:
        """Every grid a rendered size can have whose sides are ``multiple``..``max_side`` in steps of ``multiple``,
        of at most ``max_pixels`` pixels (None: no bound): what sizes the decode cache. Every size is tried
        ((max_side / multiple)^2 of them, 16,384 for MammothModa2's 2048 and 16): under ``token_budget`` the grid
        follows the aspect ratio alone and the rounding makes its token count irregular in it."""
        steps = max_side // multiple
        if multiple < 1 or steps < 1:
            raise ValueError(f"no size of sides multiples of {multiple} fits within {max_side}")
        found = set()
        for a in range(1, steps + 1):
            for b in range(1, steps + 1):
                if max_pixels is not None and a * b * multiple * multiple > max_pixels:
                    break
                found.add(self.grid(a * multiple, b * multiple))
        if not found:
            raise ValueError(f"no size of sides multiples of {multiple} has at most {max_pixels} pixels")
        return found

    def card(self) -> dict[str, str | int]:
        """The rule as the model card states it."""
        if self.rule == PIXELS_PER_TOKEN:
            return {"rule": self.rule, "pixels_per_token": self.pixels_per_token}
        return {"rule": self.rule, "tokens": self.tokens}


def _nearest_sqrt(numerator: int, denominator: int) -> int:
    """round(sqrt(numerator / denominator)), halves up, at least 1, in exact integer arithmetic: the largest n with
    (2n - 1)^2 <= 4 * numerator / denominator."""
    return max(1, (math.isqrt(4 * numerator // denominator) + 1) // 2)


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


#: The placeholder an edit prompt holds for each input image, expanded to that image's MammothTok block
#: (ar_service/edit_image.py; bytedance/mammothmoda main ``processing_mammothmoda2.py`` expands it the same way).
GEN_PLACEHOLDER = "<|gen_placeholder|>"


def build_edit_prompt(instruction: str, grid: Grid, images: int = 1) -> str:
    """The edit envelope: the T2I one with the input images first in the user message, one ``<|gen_placeholder|>``
    each (replaced by the image's MammothTok tokens), then the instruction.

    UNVERIFIED template: the released Dev code renders an ``image_gen`` element through the HF chat template, which is
    not published (../shared/reference/mammothmoda2-dev.md 3e). ardit chooses, from what the code does show:
    ``<|im_start|>system\nYou are a helpful image generator.<|im_end|>\n<|im_start|>user\n<IMAGE BLOCK>{instruction}
    <|im_end|>\n<|im_start|>assistant\n<|image start|>{W}*{H}<|image token|>`` (the system prompt of the released
    negative prompt, the image before the text as the released call sequence orders the message's elements, and the
    generation header the 10-token answer split implies). The unconditional row of AR guidance keeps only the last
    10 prompt tokens, so it never sees the image or the instruction (the released ``attention_mask[:, :-10] = 0``)."""
    if images < 1:
        raise ValueError(f"an edit prompt holds at least one input image, got {images}")
    return build_t2i_prompt(GEN_PLACEHOLDER * images + instruction, grid)


def build_negative_prompt(negative_prompt: str) -> str:
    """The negative (unconditional) envelope as released: the system and user messages through the chat template
    without the generation prompt (bytedance/mammothmoda qwen25vl ``mammothmoda2/model/processing_mammothmoda2.py``
    lines 179-183, ``add_generation_prompt=False``), i.e. no assistant header and no image tokens."""
    return f"{system_prefix()}{negative_prompt}<|im_end|>\n"


def allowed_token_range(generated_len: int, grid: Grid, t2i: VisualIds) -> tuple[int, int]:
    """Inclusive id range the next token may take, given how many tokens were generated so far.

    ``visual_token_end_id`` is exclusive (t2i_generation_config.json semantics; see
    ar_service/model/t2i_config.py), so the last allowed visual id is ``visual_token_end_id - 1``.
    """
    col = generated_len % (grid.width + 1)
    if col == grid.width:
        return t2i.eol_token_id, t2i.eol_token_id
    return t2i.visual_token_start_id, t2i.visual_token_end_id - 1
