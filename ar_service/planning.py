"""ar_service's request planning: a request checked against the served model and the service's limits, and
resolved (size and enlargement, seed, knobs with their defaults, prompt ids, the decoding mode) into an
``ImagePlan``.

Planning is kept apart from scheduling (ar_service/engine.py queues, batches and decodes plans; it validates
nothing): everything a caller can get wrong is refused here, with the parameter at fault, before the request takes
a place in the queue.
"""

from __future__ import annotations

import io
import math
import secrets
import threading
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from ar_service.conditions import (
    DecodeChoices,
    image_condition_positions,
    negative_prompt_ids,
    prompt_ids_for,
    question_end,
    text_condition_mask,
)
from ar_service.decoding import DEFAULT_ROW_WINDOW, DEFAULT_SPEC_WINDOW, MODES, SEQUENTIAL, SPECULATIVE, Decoding
from ar_service.edit_image import (
    DEFAULT_EDIT_IMAGE_POSITIONS,
    MIN_PIXELS,
    ImagePromptIds,
    expand_placeholders,
    placeholder_count,
    reference_output_size,
    smart_resize,
    to_rgb,
    tokenize_edit_image,
)
from ar_service.model.loading import LoadedAR
from ar_service.prompt import Grid, GridRule, build_edit_prompt, upscale_for
from ar_service.sampling import SamplingParams
from protos.formats import FORMATS
from protos.knobs import KnobTable
from protos.previews import MAX_PARTIAL_IMAGES
from protos.status import RequestRejected
from servicekit.checkpoint import PipelineCheckpoint

MAX_IMAGES = 10
#: Input images of one edit: the DiT tells its references apart by ``image_index_embedding``, a parameter of 5 rows in
#: the released Dev checkpoint (../shared/reference/mammothmoda2-dev.md 3b, 5), so a sixth has no index to take.
#: OpenAI accepts up to 16 images for its GPT image models.
MAX_REFERENCE_IMAGES = 5
QUALITIES = ("", "auto", "low", "medium", "high", "standard", "hd")


@dataclass
class ImagePlan:
    """A checked request: everything the worker needs, nothing left to validate."""

    request_id: str
    model: str
    prompt_ids: list[int]
    negative_ids: list[int] | None
    grid: Grid
    width: int  # of the answered pictures: the model renders width // upscale x height // upscale
    height: int
    upscale: int
    n: int
    seed: int
    output_format: str
    output_compression: int | None
    sampling: SamplingParams
    guidance: float  # AR guidance scale; <= 1: off
    dit_knobs: dict[str, Any]
    knobs: dict[str, Any]  # every knob the request runs with, defaults filled in
    text_positions: int
    image_positions: int
    partial_images: int = 0  # previews per image the renderer sends (StreamImage)
    decoding: Decoding = field(default_factory=Decoding)  # how many tokens a forward may decide (ar_decoding)
    #: An edit's input images, as the client sent their files (forwarded to the DiT as its references, in order).
    references: tuple[bytes, ...] = ()
    #: An edit's input images as MammothTok saw them: (width, height, code rows, code columns) each.
    reference_grids: tuple[tuple[int, int, int, int], ...] = ()


@dataclass(frozen=True)
class EditLimits:
    """What an edit's input images may be (ar_service settings ``edit_*``)."""

    max_image_bytes: int = 33_554_432  # dit_service's bound on one reference
    max_total_bytes: int = 67_108_864
    max_image_pixels: int = 40_000_000
    image_positions: int = DEFAULT_EDIT_IMAGE_POSITIONS  # prompt positions for all input images' MammothTok blocks


def prompt_ids_for_edit(tokenizer: Any, instruction: str, grid: Grid, images: int) -> list[int]:
    """The edit envelope's ids (``prompt.build_edit_prompt``) with one ``<|gen_placeholder|>`` per input image."""
    return list(tokenizer(build_edit_prompt(instruction, grid, images), add_special_tokens=False)["input_ids"])


class RequestPlanner:
    """Checks requests against the served model. ``decodes`` says whether the engine's decoder runs a decoding
    mode (the planner refuses the ones it does not, naming those it does)."""

    def __init__(
        self,
        loaded: LoadedAR,
        checkpoint: PipelineCheckpoint,
        knob_table: KnobTable,
        decodes: Callable[[Decoding], bool],
        model_id: str | None = None,
        max_prompt_tokens: int = 1024,
        max_pixels: int | None = None,
        edit_limits: EditLimits | None = None,
    ):
        self.loaded = loaded
        self.checkpoint = checkpoint
        self.serving = checkpoint.serving
        self.knob_table = knob_table
        self.decodes = decodes
        self.model_id = model_id or checkpoint.name
        self.max_prompt_tokens = max_prompt_tokens
        self.max_pixels = max_pixels  # None: the largest side squared is the only bound
        # How the grid follows the size is a serving fact (ardit_serving.json grid_rule: by default the released
        # code's ~1,024-token grid, 32x32 for a square), not a model one; pixels_per_token adds its multiple.
        self.grid_rule = GridRule.of(checkpoint.serving)
        self.size_multiple = math.lcm(self.grid_rule.pixel_multiple, checkpoint.size_multiple)
        # AR sampling defaults come from the checkpoint's generation config, then its ardit_serving.json knob
        # defaults (which may also set the DiT's: guidance, steps) over the family's.
        self.ar_defaults = {**loaded.t2i.sampling_defaults,
                            **knob_table.checkpoint_defaults(checkpoint.serving.knob_defaults, "ar")}
        self.dit_defaults = knob_table.checkpoint_defaults(checkpoint.serving.knob_defaults, "dit")
        # Where the released code and ardit's defaults differ, the checkpoint's ardit_serving.json picks (see
        # servicekit.checkpoint.ServingDefaults): the visual range, which rows become the image condition, the
        # negative prompt used when a request gives none.
        self.choices = DecodeChoices.from_serving(loaded.t2i, loaded.config, loaded.tokenizer, self.serving)
        # Strings the tokenizer turns into control tokens: inside a prompt they would rewrite the envelope.
        self._control_tokens = tuple(sorted(loaded.tokenizer.get_added_vocab(), key=len, reverse=True))
        if self.choices.default_negative_prompt.strip():
            try:
                self._check_text(self.choices.default_negative_prompt, "negative_prompt")
            except RequestRejected as exc:
                raise ValueError(f"default_negative_prompt in the checkpoint's serving settings: {exc}") from exc
        self.edit_limits = edit_limits or EditLimits()
        self._mammothtok_lock = threading.Lock()  # one input image is tokenised at a time
        self.edit_refusal = loaded.edit_refusal
        self.edit_positions = 0  # prompt positions an edit's input images may take in all (0: no edits)
        self._image_ids: ImagePromptIds | None = None
        self._max_positions: int | None = None
        if loaded.mammothtok is not None:
            self._setup_edits()

    def _setup_edits(self) -> None:
        """Edits on: the input images' ids and their share of the prompt, the ``image_positions`` setting (each
        request bounds it further by what the decode's positions leave beside its prompt and grid)."""
        try:
            tokenizer: Any = self.loaded.tokenizer  # a fast tokenizer: the protocol's methods, wider types
            self._image_ids = ImagePromptIds.from_tokenizer(tokenizer, self.loaded.t2i)
        except ValueError as exc:
            self.edit_refusal = f"the served model cannot tokenise an input image: {exc}"
            return
        if self.loaded.mammothtok.config.codebook_size > self._image_ids.num_visual_tokens:
            self.edit_refusal = (f"the served model's MammothTok has {self.loaded.mammothtok.config.codebook_size} codes "
                                 f"but its t2i config only {self._image_ids.num_visual_tokens} visual tokens")
            return
        self.edit_positions = self.edit_limits.image_positions

    @property
    def edits(self) -> bool:
        """Whether the served model edits images (a Dev checkpoint with its MammothTok)."""
        return self.edit_positions > 0

    def _text_and_grid_positions(self) -> int:
        grids = self.grid_rule.grids(self.size_multiple, self.serving.max_side, self.max_pixels)
        decode = max(grid.decode_tokens for grid in grids)
        header = Grid(max(grid.width for grid in grids), max(grid.height for grid in grids))
        envelope = len(prompt_ids_for(self.loaded.tokenizer, "", header))
        return envelope + self.max_prompt_tokens + decode

    def max_positions(self) -> int:
        """Positions the longest accepted request needs (longest prompt + largest grid) plus one scratch position.

        The largest grid is the one of most decode tokens over every size the planner accepts (rendered sizes: an
        enlarged picture renders within max_side); the envelope is counted with the widest and tallest grid
        sides, whose ``{w}*{h}`` header has at least as many digits as any grid's."""
        if self._max_positions is None:
            needed = self._text_and_grid_positions() + self.edit_positions
            self._max_positions = min(needed, self.loaded.config.max_position_embeddings) + 1
        return self._max_positions

    def model_card(self) -> dict[str, Any]:
        defaults = {**self.ar_defaults, **self.dit_defaults}
        knobs = [{"knob": knob, "default": defaults.get(knob.name, knob.default)} for knob in self.knob_table.knobs]
        return {
            "id": self.model_id,
            "family": self.checkpoint.family,
            "member": self.checkpoint.member,
            "default_width": self.serving.default_width,
            "default_height": self.serving.default_height,
            "max_side": self.serving.max_side,
            "size_multiple": self.size_multiple,
            "max_prompt_tokens": self.max_prompt_tokens,
            "knobs": knobs,
            "quality_steps": dict(self.knob_table.quality_steps),
            "max_upscale": self.serving.max_upscale,
            "grid": self.grid_rule.card(),
        }

    def plan(
        self,
        *,
        request_id: str = "",
        model: str = "",
        prompt: str,
        negative_prompt: str = "",
        width: int = 0,
        height: int = 0,
        n: int = 1,
        seed: int | None = None,
        output_format: str = "png",
        output_compression: int | None = None,
        quality: str = "",
        knobs: dict[str, Any] | None = None,
        partial_images: int = 0,
        images: Sequence[bytes] = (),
    ) -> ImagePlan:
        """Checks a request against the model; raises RequestRejected naming the parameter at fault. ``images``: an
        edit's input images (encoded files), which the prompt then holds as MammothTok tokens and the DiT receives
        as its references; width/height 0 then mean the output size the last one gives."""
        if model and model != self.model_id:
            raise RequestRejected(
                f"model '{model}' is not served here; served models: {self.model_id}",
                param="model",
                code=grpc.StatusCode.NOT_FOUND,
            )
        if not prompt or not prompt.strip():
            raise RequestRejected("'prompt' must be a non-empty string", param="prompt")
        if not 1 <= n <= MAX_IMAGES:
            raise RequestRejected(f"'n' must be between 1 and {MAX_IMAGES}; got {n}", param="n")
        pictures = self._edit_images(images) if images else []
        if pictures:
            width, height, grid = self._edit_size(width, height, pictures[-1])
            upscale = 1
        else:
            width, height, upscale = self._check_size(width, height)
            grid = self.grid_rule.grid(width // upscale, height // upscale)
        if output_format not in FORMATS:
            raise RequestRejected(f"'output_format' must be one of {', '.join(FORMATS)}", param="output_format")
        if output_compression is not None:
            if output_format == "png":
                raise RequestRejected("'output_compression' applies to jpeg and webp only", param="output_compression")
            if not 0 <= output_compression <= 100:
                raise RequestRejected("'output_compression' must be between 0 and 100", param="output_compression")
        if quality not in QUALITIES:
            raise RequestRejected(f"'quality' must be one of {', '.join(q for q in QUALITIES if q)}", param="quality")
        if not 0 <= partial_images <= MAX_PARTIAL_IMAGES:
            raise RequestRejected(
                f"'partial_images' must be between 0 and {MAX_PARTIAL_IMAGES}; got {partial_images}", param="partial_images"
            )

        given = self.knob_table.validate(knobs or {})
        if "seed" in given:
            if seed is not None and seed != given["seed"]:
                raise RequestRejected("'seed' given twice with different values", param="seed")
            seed = given.pop("seed")
        if seed is None:
            seed = secrets.randbelow(2**32)
        elif not 0 <= seed < 2**63:
            raise RequestRejected("'seed' must be between 0 and 2**63 - 1", param="seed")
        ar_given = {k: v for k, v in given.items() if k in self.knob_table.names(("ar",))}
        dit_given = {k: v for k, v in given.items() if k in self.knob_table.names(("dit",))}
        ar_knobs = self.knob_table.resolve(ar_given, self.ar_defaults, stages=("ar",))
        preset = self.knob_table.steps_for_quality(quality)
        if preset is not None and "num_inference_steps" not in dit_given:
            dit_given["num_inference_steps"] = preset
        dit_knobs = self.knob_table.resolve(dit_given, self.dit_defaults, stages=("dit",))

        reference_grids: tuple[tuple[int, int, int, int], ...] = ()
        if pictures:
            prompt_ids, reference_grids = self._edit_prompt_ids(prompt, grid, pictures)
        else:
            prompt_ids = self._prompt_ids(prompt, grid, "prompt")
        negative_ids = self._negative_ids(negative_prompt, dit_knobs)
        longest = max(len(prompt_ids), len(negative_ids or ()))
        if longest + grid.decode_tokens > self.loaded.config.max_position_embeddings:
            raise RequestRejected(
                f"prompt and a {grid.width}x{grid.height}-token grid need {longest + grid.decode_tokens} positions; "
                f"the model holds {self.loaded.config.max_position_embeddings}: shorten the prompt or the size",
                param="size",
            )
        config, scope = self.loaded.config, self.choices.condition_scope
        end = question_end(len(prompt_ids), grid, scope, config.text_condition_with_answer)
        text_positions = int(text_condition_mask(prompt_ids, config, end).sum())
        decoding = self._decoding(ar_knobs, ar_given)
        return ImagePlan(
            request_id=request_id or f"img-{uuid.uuid4().hex}",
            model=self.model_id,
            prompt_ids=prompt_ids,
            negative_ids=negative_ids,
            grid=grid,
            width=width,
            height=height,
            upscale=upscale,
            n=n,
            seed=seed,
            output_format=output_format,
            output_compression=output_compression,
            sampling=SamplingParams(ar_knobs["temperature"], ar_knobs["top_k"], ar_knobs["top_p"]),
            guidance=ar_knobs["ar_cfg_scale"],
            dit_knobs=dit_knobs,
            knobs={**ar_knobs, **dit_knobs},
            text_positions=text_positions,
            image_positions=image_condition_positions(prompt_ids, grid, scope, config),
            partial_images=partial_images,
            decoding=decoding,
            references=self._references(images, pictures, width, height),
            reference_grids=reference_grids,
        )

    # -- edits --------------------------------------------------------------------------------

    def _edit_images(self, images: Sequence[bytes]) -> list[Any]:
        """The input images decoded (PIL), each checked against the limits; refused with INVALID_ARGUMENT naming the
        image at fault, or the model when it cannot edit."""
        from PIL import Image

        if not self.edits:
            # INVALID_ARGUMENT (400): the client asked the wrong model; FAILED_PRECONDITION on "model" means a
            # deployment fault to the gateway (an AR and a DiT of different models: 503).
            raise RequestRejected(f"this model does not edit images: {self.edit_refusal}", param="model")
        limits = self.edit_limits
        if len(images) > MAX_REFERENCE_IMAGES:
            raise RequestRejected(
                f"an edit takes at most {MAX_REFERENCE_IMAGES} input images (the DiT's image_index_embedding has "
                f"{MAX_REFERENCE_IMAGES} rows); got {len(images)}", param="image")
        total = sum(len(image) for image in images)
        if total > limits.max_total_bytes:
            raise RequestRejected(f"the input images are {total} bytes together; at most {limits.max_total_bytes} are "
                                  "accepted", param="image")
        pictures = []
        for index, data in enumerate(images):
            what = f"input image {index}"
            if not data:
                raise RequestRejected(f"{what} is empty", param="image")
            if len(data) > limits.max_image_bytes:
                raise RequestRejected(f"{what} is {len(data)} bytes; at most {limits.max_image_bytes} are accepted",
                                      param="image")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", Image.DecompressionBombWarning)
                    picture = Image.open(io.BytesIO(data))
                    width, height = picture.size
                    if width < 1 or height < 1:
                        raise RequestRejected(f"{what} is {width}x{height} pixels: it has no pixels", param="image")
                    if width * height > limits.max_image_pixels:
                        raise RequestRejected(
                            f"{what} is {width}x{height} = {width * height} pixels; at most {limits.max_image_pixels} "
                            "are accepted (a larger one may be a decompression bomb)", param="image")
                    picture.load()
            except RequestRejected:
                raise
            except Exception as exc:  # PIL raises many kinds for a file it cannot read
                raise RequestRejected(f"{what} is not a readable PNG, JPEG or WebP image: {type(exc).__name__}: {exc}",
                                      param="image") from None
            pictures.append(picture)
        return pictures

    @staticmethod
    def _references(images: Sequence[bytes], pictures: list[Any], width: int, height: int) -> tuple[bytes, ...]:
        """The files the DiT gets: the client's, but the last one resized to the size asked for when it would give
        another (a lossless PNG)."""
        from PIL import Image

        references = tuple(bytes(image) for image in images)
        if pictures and reference_output_size(*pictures[-1].size) != (width, height):
            buffer = io.BytesIO()
            to_rgb(pictures[-1]).resize((width, height), Image.Resampling.BICUBIC).save(buffer, format="PNG")
            references = (*references[:-1], buffer.getvalue())
        return references

    def _edit_size(self, width: int, height: int, last: Any) -> tuple[int, int, Grid]:
        """(width, height) of an edit's output and the grid the AR decodes for it. The DiT renders the size its last
        reference gives (``reference_output_size``); a size asked for must be one such size (the AR then resizes
        the last image to it before forwarding it). The grid is the rule's for that size, or for the size scaled
        down into the served sides when it is larger (the released code's grid does not follow the output size)."""
        if width == 0 and height == 0:
            try:
                width, height = reference_output_size(*last.size)
            except ValueError as exc:  # an aspect ratio over the released 200
                raise RequestRejected(f"the last input image ({last.width}x{last.height}) cannot be an edit's "
                                      f"reference: {exc}", param="image") from None
            try:
                self._check_size(width, height)
            except RequestRejected as exc:
                raise RequestRejected(
                    f"the last input image ({last.width}x{last.height}) gives the output its size, {width}x{height}, "
                    f"which this model does not draw: {exc.message}", param="image") from None
        else:
            self._check_size(width, height)
            if reference_output_size(width, height) != (width, height):
                raise RequestRejected(
                    f"'size' {width}x{height} cannot be an edit's output size: the DiT renders its last reference at "
                    "multiples of 16 pixels, at most 1024x1024 pixels in all; use 'auto' (the input image's size) or "
                    "such a size", param="size")
        scale = min(1.0, self.serving.max_side / max(width, height))
        if self.max_pixels is not None:
            scale = min(scale, math.sqrt(self.max_pixels / (width * height)))
        multiple = self.size_multiple
        grid_w = max(multiple, int(width * scale) // multiple * multiple)
        grid_h = max(multiple, int(height * scale) // multiple * multiple)
        return width, height, self.grid_rule.grid(grid_w, grid_h)

    def _edit_prompt_ids(self, instruction: str, grid: Grid, pictures: list[Any]) -> tuple[list[int], tuple]:
        """The edit prompt's ids (``prompt.build_edit_prompt``) with each placeholder replaced by its image's
        MammothTok block; each image gets an equal share of ``edit_positions``."""
        self._check_text(instruction, "prompt")
        assert self._image_ids is not None and self.loaded.mammothtok is not None
        ids = prompt_ids_for_edit(self.loaded.tokenizer, instruction, grid, len(pictures))
        # The images share what the decode's positions leave beside the text and the grid, at most edit_positions.
        room = min(self.edit_positions, self.max_positions() - 1 - (len(ids) - len(pictures)) - grid.decode_tokens)
        share = room // len(pictures)
        if share < placeholder_count(2, 2):
            raise RequestRejected(
                f"the prompt and a {grid.width}x{grid.height}-token grid leave {max(room, 0)} of the model's positions "
                f"for {len(pictures)} input image(s), too few: shorten the prompt, give fewer images or a smaller size",
                param="image")
        blocks, grids = [], []
        for index, picture in enumerate(pictures):
            max_pixels = self._pixels_for(picture.width, picture.height, share)
            if max_pixels is None:
                raise RequestRejected(
                    f"input image {index} ({picture.width}x{picture.height}) does not fit the {share} prompt positions "
                    "an input image may take here (its aspect ratio is too far from square)", param="image")
            try:
                with self._mammothtok_lock:
                    tokens = tokenize_edit_image(picture, self.loaded.mammothtok, self._image_ids, max_pixels=max_pixels)
            except ValueError as exc:
                raise RequestRejected(f"input image {index}: {exc}", param="image") from None
            blocks.append(tokens.ids)
            grids.append((tokens.width, tokens.height, tokens.grid[0], tokens.grid[1]))
        return expand_placeholders(ids, self._image_ids.placeholder, blocks), tuple(grids)

    def _pixels_for(self, width: int, height: int, positions: int) -> int | None:
        """The largest ``max_pixels`` (MammothTok's resize bound, at most the released 16384 patches) whose grid's
        block fits ``positions``; None when not even the smallest does."""
        factor = self.loaded.mammothtok.config.patch_size
        tokens = min(positions, 16384)
        while tokens * factor**2 >= MIN_PIXELS:
            try:
                rows, cols = (side // factor for side in smart_resize(height, width, factor, max_pixels=tokens * factor**2))
            except ValueError:
                return None
            if placeholder_count(rows, cols) <= positions:
                return tokens * factor**2
            tokens = int(tokens * 0.9)
        return None

    def _decoding(self, ar_knobs: dict[str, Any], given: dict[str, Any]) -> Decoding:
        """The request's decoding mode (knobs ``ar_decoding``, ``ar_decoding_window``), checked against the decoder."""
        mode, window = ar_knobs["ar_decoding"], ar_knobs["ar_decoding_window"]
        if mode == SEQUENTIAL:
            if window > 1 and "ar_decoding_window" in given:
                raise RequestRejected(
                    "'ar_decoding_window' applies to ar_decoding 'speculative' and 'row_parallel'; sequential decoding "
                    "feeds one token per forward", param="ar_decoding_window",
                )
            return Decoding()
        decoding = Decoding(mode, window or (DEFAULT_SPEC_WINDOW if mode == SPECULATIVE else DEFAULT_ROW_WINDOW))
        if not self.decodes(decoding):
            accepted = [m for m in MODES if self.decodes(Decoding(m))]
            raise RequestRejected(
                f"'ar_decoding' {mode!r} is not available on this server: its decoder feeds one token per image and "
                f"forward; accepted here: {', '.join(repr(m) for m in accepted)}", param="ar_decoding",
            )
        return decoding

    def _check_size(self, width: int, height: int) -> tuple[int, int, int]:
        """(width, height, factor) of the answer: the model renders width/factor x height/factor (prompt.upscale_for)."""
        if width == 0 and height == 0:
            return self.serving.default_width, self.serving.default_height, 1
        limit, multiple, most = self.serving.max_side, self.size_multiple, self.serving.max_upscale
        render_side = max(self.serving.default_width, self.serving.default_height)
        factor = upscale_for(width, height, multiple, limit, most, render_side)
        if factor is None:
            accepted = f"multiples of {multiple} between {multiple} and {limit}"
            if most > 1:
                accepted += (
                    f", or a size of sides at most {min(render_side, limit)} times a whole factor up to {most} "
                    f"(drawn at that size and enlarged), e.g. {render_side * most}x{render_side * most}"
                )
            raise RequestRejected(
                f"'size' {width}x{height} is not accepted: width and height must be {accepted}", param="size"
            )
        rendered = (width // factor) * (height // factor)
        if self.max_pixels is not None and rendered > self.max_pixels:
            raise RequestRejected(
                f"'size' {width}x{height} renders {rendered} pixels; at most {self.max_pixels} per image are accepted",
                param="size",
            )
        return width, height, factor

    def _check_text(self, text: str, param: str) -> None:
        for token in self._control_tokens:
            if token in text:
                raise RequestRejected(f"'{param}' must not contain the model's control token {token!r}", param=param)
        count = len(self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
        if count > self.max_prompt_tokens:
            raise RequestRejected(
                f"'{param}' is {count} tokens long; at most {self.max_prompt_tokens} are accepted", param=param
            )

    def _prompt_ids(self, text: str, grid: Grid, param: str) -> list[int]:
        self._check_text(text, param)
        return prompt_ids_for(self.loaded.tokenizer, text, grid)

    def _negative_ids(self, negative_prompt: str, dit_knobs: dict[str, Any]) -> list[int] | None:
        """The negative envelope's ids: the request's negative prompt, else the model's default one (the released
        README's unless the checkpoint's serving settings say otherwise); None when that is empty (the DiT then
        guides against the empty condition) or when the DiT will not guide at all."""
        if negative_prompt.strip():
            self._check_text(negative_prompt, "negative_prompt")
            text = negative_prompt
        else:
            text = self.choices.default_negative_prompt
        if not text.strip() or dit_knobs["text_guidance_scale"] <= 1.0:
            return None
        return negative_prompt_ids(self.loaded.tokenizer, text)
