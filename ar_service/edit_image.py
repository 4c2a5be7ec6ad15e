"""The input image of an edit request, on the AR side: preprocessing for MammothTok and its prompt tokens.

Facts from bytedance/mammothmoda ``main`` (``../shared/reference/mammothmoda2-dev.md`` section 3a), under
``mamoda2/mammothmoda2/``: VIS = ``utils/vision_processor.py``, P = ``model/processing_mammothmoda2.py``,
VP = ``model/mammothmoda2_visual_tokenizers/visual_prompt.py``, M = ``model/modeling_mammothmoda2.py``.

- An ``image_gen`` message element is fetched with ``image_patch_size`` 7 and the spatial merge 2, so the factor is
  14 (VIS ``process_vision_info``, ``fetch_image``): ``to_rgb`` (RGBA composited onto white through its alpha, any
  other mode ``convert("RGB")``), then ``smart_resize(h, w, 14, min_pixels=4 * 14**2, max_pixels=16384 * 14**2)``
  unless the element names its own ``min_pixels`` / ``max_pixels`` (or ``resized_height`` / ``resized_width``, which
  are themselves passed through ``smart_resize`` with the default limits), then ``PIL.Image.resize`` with its
  default filter, BICUBIC.
- ``smart_resize``: an aspect ratio over 200 is refused; each side is rounded (Python's ``round``, half to even) to a
  multiple of the factor, at least one factor; if the area then exceeds the max, both sides are scaled by
  ``1 / sqrt(h * w / max)`` and floored to the factor; if it is under the min, scaled by ``sqrt(min / (h * w))``
  and ceiled. 1024 x 1024 -> 1022 x 1022.
- P: ``ToTensor`` then ``Normalize(0.5, 0.5)``: (1, 3, H, W) float32 in [-1, 1]; the code grid is
  ``h = H // 14`` rows by ``w = W // 14`` columns; the prompt holds ``h * (w + 1) + 5 + digits(h) + digits(w)``
  placeholders for it.
- VP ``create_image_prompt_batch(mode="global", imgstr_mode="split_row")``: ``<|image start|>`` + ``"{h}*{w}"``
  (rows first) + ``<|image token|>`` + the rows of ``<|visual token %06d|>`` joined by ``<|endofline|>`` +
  ``<|endofline|><|endoffile|><|image end|>``. M ``image_generate_preprocess`` tokenises that text without added
  specials and scatters it, in order, over the ``<|gen_placeholder|>`` ids of the prompt (their count must match).

Ids (one owner each): the EOL and the first visual id come from ``t2i_generation_config.json``
(``T2IGenerationConfig``), visual id = ``visual_token_start_id + code``; the image start / token / end, end-of-file
and placeholder ids from the tokenizer by their strings; the header digits and ``*`` from the tokenizer's own split
of ``"{h}*{w}"``. ardit builds the ids directly rather than tokenising the released text, because its tokenizers
spell visual tokens ``<|visual token N|>`` without the released zero padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from PIL import Image

from ar_service.model.tokenizer import EOL_TOKEN, IMAGE_END_TOKEN, IMAGE_START_TOKEN, IMAGE_TOKEN
from ar_service.prompt import VisualIds
from servicekit import released_images
from servicekit.released_images import MAX_TOKENS, MIN_TOKENS, to_rgb

if TYPE_CHECKING:
    from ar_service.model.mammothtok import MammothTok

#: The released patch of MammothTok's input (``image_patch_size`` 7 x spatial merge 2; ``gen_patch_size`` 14).
PATCH_FACTOR = 14
MIN_PIXELS = MIN_TOKENS * PATCH_FACTOR**2  # 784
MAX_PIXELS = MAX_TOKENS * PATCH_FACTOR**2  # 3,211,264
# Token strings of the image block that ar_service.model.tokenizer does not name (its GEN_HEADER_TOKENS holds them).
EOF_TOKEN = "<|endoffile|>"
GEN_PLACEHOLDER_TOKEN = "<|gen_placeholder|>"
#: The released surface form of a visual token in the prompt text (VP ``visual_template``).
RELEASED_VISUAL_TOKEN = "<|visual token {code:06d}|>"


def smart_resize(
    height: int,
    width: int,
    factor: int = PATCH_FACTOR,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> tuple[int, int]:
    """The released ``smart_resize`` (servicekit.released_images, its one owner) at MammothTok's factor by default."""
    return released_images.smart_resize(height, width, factor, min_pixels, max_pixels)


def resize_for_mammothtok(
    image: Image.Image,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    resized: tuple[int, int] | None = None,
    factor: int = PATCH_FACTOR,
) -> Image.Image:
    """``fetch_image`` for an ``image_gen`` element: RGB, then BICUBIC to ``smart_resize``'s size. ``resized``
    (height, width) is the element's ``resized_height`` / ``resized_width``, rounded by the same rule."""
    image = to_rgb(image)
    if resized is not None:
        height, width = smart_resize(resized[0], resized[1], factor)
    else:
        height, width = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
    return image.resize((width, height), Image.Resampling.BICUBIC)


def pixels_from_image(image: Image.Image) -> torch.Tensor:
    """``ToTensor`` + ``Normalize(0.5, 0.5)`` of an RGB image: (1, 3, H, W) float32 in [-1, 1]."""
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode}")
    array = np.array(image, dtype=np.uint8, copy=True)
    pixels = torch.from_numpy(array).permute(2, 0, 1).contiguous().float().div(255)
    return pixels.sub(0.5).div(0.5).unsqueeze(0)


def grid_of(pixels: torch.Tensor, patch: int = PATCH_FACTOR) -> tuple[int, int]:
    """(rows, columns) of the code grid of (B, 3, H, W) pixels: ``H // patch``, ``W // patch``."""
    return pixels.shape[-2] // patch, pixels.shape[-1] // patch


def placeholder_count(rows: int, cols: int) -> int:
    """Prompt positions of one input image (P): every row and its EOL, 5 specials, the header's digits and ``*``
    (the 5 counts ``*`` with boi, img_token, eof and eoi)."""
    return rows * (cols + 1) + 5 + len(str(rows)) + len(str(cols))


def released_positions(height: int, width: int) -> int:
    """Prompt positions of a ``height`` x ``width`` input at the released resize (smart_resize at factor 14 within
    MAX_PIXELS): 1024 x 1024 -> 1022 x 1022 -> 73 x 73 codes -> 5,411 positions."""
    rows, cols = (side // PATCH_FACTOR for side in smart_resize(height, width))
    return placeholder_count(rows, cols)


#: ``edit_image_positions``' default: a 1024 x 1024 input tokenised at the released resolution, not scaled down. The
#: released code caps one image at MAX_TOKENS codes and the prompt not at all; ardit bounds the prompt (its decode
#: memory is sized for it), so larger inputs, or several, share these positions.
DEFAULT_EDIT_IMAGE_POSITIONS = released_positions(1024, 1024)


def image_prompt_text(codes: torch.Tensor | Sequence[Sequence[int]]) -> str:
    """The released prompt text of a code grid (rows, cols), visual tokens in the released zero-padded form."""
    grid = _as_rows(codes)
    body = EOL_TOKEN.join("".join(RELEASED_VISUAL_TOKEN.format(code=c) for c in row) for row in grid)
    return f"{IMAGE_START_TOKEN}{len(grid)}*{len(grid[0])}{IMAGE_TOKEN}{body}{EOL_TOKEN}{EOF_TOKEN}{IMAGE_END_TOKEN}"


def _as_rows(codes: torch.Tensor | Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(codes, torch.Tensor):
        if codes.dim() != 2:
            raise ValueError(f"codes must be one (rows, cols) grid, got shape {tuple(codes.shape)}")
        grid = [[int(c) for c in row] for row in codes.tolist()]
    else:
        grid = [[int(c) for c in row] for row in codes]
    if not grid or not grid[0] or any(len(row) != len(grid[0]) for row in grid):
        raise ValueError("codes must be a non-empty rectangular grid")
    return grid


class _Tokenizer(Protocol):
    unk_token_id: int | None

    def convert_tokens_to_ids(self, tokens: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class ImagePromptIds:
    """Builds the id block of one input image from its code grid; the header split comes from the tokenizer."""

    image_start: int
    image_token: int
    image_end: int
    eol: int
    eof: int
    placeholder: int
    visual_token_start: int
    num_visual_tokens: int
    tokenizer: _Tokenizer

    @classmethod
    def from_tokenizer(cls, tokenizer: _Tokenizer, t2i: VisualIds) -> ImagePromptIds:
        """Ids from the tokenizer (image specials, EOF, placeholder) and the t2i config (EOL, visual range);
        a token the tokenizer lacks is named in the error."""
        found: dict[str, int] = {}
        missing = []
        for token in (IMAGE_START_TOKEN, IMAGE_TOKEN, IMAGE_END_TOKEN, EOF_TOKEN, GEN_PLACEHOLDER_TOKEN):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == tokenizer.unk_token_id:
                missing.append(token)
            else:
                found[token] = int(token_id)
        if missing:
            raise ValueError(f"the tokenizer lacks {missing}, which an input image's prompt tokens need")
        return cls(
            image_start=found[IMAGE_START_TOKEN],
            image_token=found[IMAGE_TOKEN],
            image_end=found[IMAGE_END_TOKEN],
            eol=int(t2i.eol_token_id),
            eof=found[EOF_TOKEN],
            placeholder=found[GEN_PLACEHOLDER_TOKEN],
            visual_token_start=int(t2i.visual_token_start_id),
            num_visual_tokens=int(t2i.visual_token_end_id) - int(t2i.visual_token_start_id),
            tokenizer=tokenizer,
        )

    def header_ids(self, rows: int, cols: int) -> list[int]:
        """The tokenizer's ids of ``"{rows}*{cols}"``: one per digit and one for ``*``, as the released count assumes."""
        text = f"{rows}*{cols}"
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if len(ids) != len(text):
            raise ValueError(f"the tokenizer splits the image header {text!r} into {len(ids)} ids, not one per "
                             f"character ({len(text)}): the prompt would not fill its {placeholder_count(rows, cols)} "
                             "placeholders")
        return ids

    def ids(self, codes: torch.Tensor | Sequence[Sequence[int]]) -> list[int]:
        """The block that replaces one image's placeholders: ``placeholder_count(rows, cols)`` ids."""
        grid = _as_rows(codes)
        rows, cols = len(grid), len(grid[0])
        bad = sorted({c for row in grid for c in row if not 0 <= c < self.num_visual_tokens})
        if bad:
            raise ValueError(f"codes {bad[:8]} lie outside the {self.num_visual_tokens} visual tokens of the t2i config")
        out = [self.image_start, *self.header_ids(rows, cols), self.image_token]
        for row in grid:
            out.extend(self.visual_token_start + c for c in row)
            out.append(self.eol)
        out.extend((self.eof, self.image_end))
        if len(out) != placeholder_count(rows, cols):  # cannot happen once header_ids has checked its split
            raise AssertionError(f"image block of {len(out)} ids for {placeholder_count(rows, cols)} placeholders")
        return out

    def placeholders(self, rows: int, cols: int) -> list[int]:
        """What the prompt holds for an input image before its codes are known."""
        return [self.placeholder] * placeholder_count(rows, cols)


def splice_image_ids(prompt_ids: Sequence[int], placeholder_id: int, blocks: Sequence[Sequence[int]]) -> list[int]:
    """Fill the prompt's placeholder positions with the images' id blocks, in order (M ``masked_scatter``): the
    number of placeholders must equal the blocks' total length."""
    total = sum(len(b) for b in blocks)
    slots = sum(1 for t in prompt_ids if t == placeholder_id)
    if slots != total:
        raise ValueError(f"the prompt has {slots} image placeholders; the input images need {total}")
    fill = iter(t for block in blocks for t in block)
    return [next(fill) if t == placeholder_id else int(t) for t in prompt_ids]


@dataclass(frozen=True)
class EditImageTokens:
    """One input image, tokenised: its resized size, code grid and prompt ids."""

    height: int
    width: int
    codes: torch.Tensor  # (rows, cols) int64
    ids: list[int]

    @property
    def grid(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])


def tokenize_edit_image(
    image: Image.Image,
    model: MammothTok,
    prompt_ids: ImagePromptIds,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    released_bf16_distances: bool | None = None,
) -> EditImageTokens:
    """Resize, normalise, encode with ``model`` (on its device) and build the prompt ids of one input image.
    ``released_bf16_distances`` None: as the released bf16-autocast run rounds them when ``model`` is bf16 (the codes
    the released tokenizer gives, which the Dev AR learnt from; mammothtok.py "Numerics"), float32 otherwise."""
    factor = model.config.patch_size
    resized = resize_for_mammothtok(image, min_pixels, max_pixels, factor=factor)
    weight = model.quant_conv.weight
    pixels = pixels_from_image(resized).to(weight.device)
    if released_bf16_distances is None:
        released_bf16_distances = weight.dtype == torch.bfloat16
    codes = model.encode(pixels, released_bf16_distances=released_bf16_distances)[0].cpu()
    return EditImageTokens(height=resized.height, width=resized.width, codes=codes, ids=prompt_ids.ids(codes))


def reference_output_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) of an edit's output for a last input image of ``width`` x ``height``: what dit_service renders
    (servicekit.released_images.reference_size, the rule both services share)."""
    h, w = released_images.reference_size(height, width)
    return w, h


def expand_placeholders(prompt_ids: Sequence[int], placeholder_id: int, blocks: Sequence[Sequence[int]]) -> list[int]:
    """The prompt with its i-th ``<|gen_placeholder|>`` (one per image) replaced by image i's id block: what the
    released processor's expansion to ``placeholder_count`` placeholders followed by ``splice_image_ids`` gives."""
    slots = [i for i, t in enumerate(prompt_ids) if t == placeholder_id]
    if len(slots) != len(blocks):
        raise ValueError(f"the prompt has {len(slots)} image placeholders for {len(blocks)} input images")
    expanded = [placeholder_id if t == placeholder_id else int(t) for t in prompt_ids]
    out: list[int] = []
    start = 0
    for slot, block in zip(slots, blocks, strict=True):
        out.extend(expanded[start:slot])
        out.extend([placeholder_id] * len(block))
        start = slot + 1
    out.extend(expanded[start:])
    return splice_image_ids(out, placeholder_id, blocks)
