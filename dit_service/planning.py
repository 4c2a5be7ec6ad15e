"""dit_service's request planning: a Render header checked against the served model and the service's limits,
and resolved (sizes, seed, knobs with their defaults) into a ``RenderPlan``; then the condition chunks that follow
it, checked one by one into buffers the plan sized (``ConditionAssembler``), and the reference images of an edit
(``ImageChunk`` pieces of each image's file), reassembled, decoded and preprocessed (dit_service/references.py);
with references the picture's size is the last reference's after preprocessing, settled when they have arrived.

Planning is kept apart from scheduling (dit_service/engine.py queues, batches and steps plans; it validates
nothing): everything a caller can get wrong is refused here, with the parameter at fault, before the render takes
a place in the queue.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from dit_service.references import load_reference
from protos.formats import FORMATS
from protos.knobs import KnobTable
from protos.previews import MAX_PARTIAL_IMAGES, preview_steps
from protos.status import RequestRejected
from servicekit.checkpoint import MAX_UPSCALE, ModelIdentity

CONDITION_KINDS = ("text", "image", "negative")
MAX_IMAGES = 10
#: The most pixels of one enlarged picture (RenderHeader.upscale): 8192x8192, 192 MiB of RGB before encoding.
MAX_ANSWERED_PIXELS = 8192 * 8192
#: The most bytes of one reference image's file (the sum of its ImageChunk pieces), unless the service says otherwise.
DEFAULT_MAX_REFERENCE_BYTES = 32 * 1024 * 1024


@dataclass
class RenderPlan:
    """A checked render request, before its condition has arrived."""

    request_id: str
    width: int
    height: int
    n: int
    seed: int
    output_format: str
    output_compression: int | None
    knobs: dict[str, Any]
    hidden_size: int
    dtype: torch.dtype
    positions: dict[str, int]
    index_offset: int = 0
    partial_images: int = 0
    upscale: int = 1  # the pictures sent are width*upscale x height*upscale (imaging.enlarge)
    # Reference images the Render carries (an edit); width and height are 0 until they have arrived and then the last
    # reference's preprocessed size (``ConditionAssembler.complete_references``).
    reference_images: int = 0

    @property
    def answered_size(self) -> tuple[int, int]:
        return self.width * self.upscale, self.height * self.upscale

    @property
    def preview_steps(self) -> list[int]:
        return preview_steps(self.knobs["num_inference_steps"], self.partial_images)


DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class ConditionAssembler:
    """Collects condition chunks into buffers preallocated from the plan, checking each one.

    The buffers are all a Render stream ever makes the DiT allocate: ``precheck`` refuses a chunk
    from its declared dtype, shape, offset and size before its bytes are decoded, so a chunk can
    neither exceed the header's positions nor ``max_chunk_bytes``, and a stream can send at most
    ``max_chunks`` chunks.
    """

    def __init__(
        self, plan: RenderPlan, max_chunk_bytes: int | None = None, max_chunks: int | None = None,
        max_reference_bytes: int = DEFAULT_MAX_REFERENCE_BYTES, settle_size: Any = None,
    ):
        """``settle_size(plan, width, height)``: the planner's check of the size the references give the picture."""
        self.plan = plan
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.max_reference_bytes = max_reference_bytes
        self.settle_size = settle_size
        self.chunks = 0
        # Reference files as their pieces arrive: index -> pieces; an index is closed by its piece with last = true.
        self.reference_pieces: dict[int, list[bytes]] = {}
        self.reference_bytes: dict[int, int] = {}
        self.reference_closed: set[int] = set()
        self.buffers = {
            kind: torch.empty((count, plan.hidden_size), dtype=plan.dtype) for kind, count in plan.positions.items()
        }
        self.filled = {kind: torch.zeros(count, dtype=torch.bool) for kind, count in plan.positions.items()}

    def precheck(self, kind: str, offset: int, dtype: str, shape: list[int], nbytes: int) -> None:
        """Checks a chunk from its metadata alone, before its bytes become a tensor."""
        self.chunks += 1
        if self.max_chunks is not None and self.chunks > self.max_chunks:
            raise RequestRejected(f"a Render stream may send at most {self.max_chunks} condition chunks", param="chunk")
        if self.max_chunk_bytes is not None and nbytes > self.max_chunk_bytes:
            raise RequestRejected(
                f"condition chunk of {nbytes} bytes is over the {self.max_chunk_bytes}-byte limit; send smaller chunks",
                param="chunk.hidden_states",
            )
        if kind not in CONDITION_KINDS:
            raise RequestRejected(f"condition chunk kind must be one of {', '.join(CONDITION_KINDS)}", param="chunk.kind")
        expected = str(self.plan.dtype).removeprefix("torch.")
        if dtype != expected:
            raise RequestRejected(
                f"condition chunk dtype {dtype or 'unset'} differs from the header's {expected}", param="chunk.hidden_states"
            )
        if len(shape) != 2 or shape[1] != self.plan.hidden_size or shape[0] <= 0:
            raise RequestRejected(
                f"condition chunk shape must be [positions >= 1, {self.plan.hidden_size}]; got {list(shape)}",
                param="chunk.hidden_states",
            )
        declared = self.plan.positions[kind]
        if offset + shape[0] > declared:
            raise RequestRejected(
                f"{kind} condition chunk covers positions {offset}..{offset + shape[0] - 1}, but the header declared {declared}",
                param="chunk.offset",
            )
        if nbytes != shape[0] * shape[1] * DTYPE_ITEMSIZE[expected]:
            raise RequestRejected(
                f"condition chunk of shape {list(shape)} and dtype {expected} needs "
                f"{shape[0] * shape[1] * DTYPE_ITEMSIZE[expected]} bytes, got {nbytes}",
                param="chunk.hidden_states",
            )

    def add(self, kind: str, offset: int, hidden: torch.Tensor) -> None:
        if kind not in CONDITION_KINDS:
            raise RequestRejected(f"condition chunk kind must be one of {', '.join(CONDITION_KINDS)}", param="chunk.kind")
        if hidden.dtype != self.plan.dtype:
            raise RequestRejected(
                f"condition chunk dtype {str(hidden.dtype).removeprefix('torch.')} differs from the header's "
                f"{str(self.plan.dtype).removeprefix('torch.')}",
                param="chunk.hidden_states",
            )
        if hidden.dim() != 2 or hidden.shape[1] != self.plan.hidden_size or hidden.shape[0] == 0:
            raise RequestRejected(
                f"condition chunk shape must be [positions >= 1, {self.plan.hidden_size}]; got {list(hidden.shape)}",
                param="chunk.hidden_states",
            )
        declared = self.plan.positions[kind]
        end = offset + hidden.shape[0]
        if end > declared:
            raise RequestRejected(
                f"{kind} condition chunk covers positions {offset}..{end - 1}, but the header declared {declared}",
                param="chunk.offset",
            )
        if bool(self.filled[kind][offset:end].any()):
            raise RequestRejected(f"{kind} condition positions {offset}..{end - 1} were sent twice", param="chunk.offset")
        self.buffers[kind][offset:end] = hidden
        self.filled[kind][offset:end] = True

    def add_reference_piece(self, index: int, data: bytes, last: bool) -> None:
        """One ``ImageChunk`` of reference ``index``'s file: checked against the header's count, the chunk limits and
        the per-image byte limit, and kept until the image is complete."""
        self.chunks += 1
        if self.max_chunks is not None and self.chunks > self.max_chunks:
            raise RequestRejected(f"a Render stream may send at most {self.max_chunks} chunks", param="reference")
        count = self.plan.reference_images
        if count == 0:
            raise RequestRejected(
                "a reference image piece arrived, but the header declares reference_images 0", param="reference_images"
            )
        if index >= count:
            raise RequestRejected(
                f"reference image index {index} is out of range: the header declares {count} reference images "
                f"(indices 0..{count - 1})",
                param="reference.index",
            )
        if index in self.reference_closed:
            raise RequestRejected(
                f"reference image {index} received a piece after its last one (last = true)", param="reference.index"
            )
        if self.max_chunk_bytes is not None and len(data) > self.max_chunk_bytes:
            raise RequestRejected(
                f"reference image piece of {len(data)} bytes is over the {self.max_chunk_bytes}-byte limit; send "
                "smaller pieces",
                param="reference.data",
            )
        total = self.reference_bytes.get(index, 0) + len(data)
        if total > self.max_reference_bytes:
            raise RequestRejected(
                f"reference image {index} is over the {self.max_reference_bytes}-byte limit of one reference file",
                param="reference.data",
            )
        self.reference_bytes[index] = total
        self.reference_pieces.setdefault(index, []).append(bytes(data))
        if last:
            self.reference_closed.add(index)

    def complete_references(self) -> list[torch.Tensor] | None:
        """The reference images, decoded and preprocessed (float32 [3, H, W] in [-1, 1], in index order), once every
        declared one has arrived whole; None without references. Settles the plan's width and height to the last
        one's size (the released rule: t2i_utils.py 337-345) through the planner's checks."""
        count = self.plan.reference_images
        if count == 0:
            return None
        missing = [i for i in range(count) if i not in self.reference_closed]
        if missing:
            partial = [i for i in missing if i in self.reference_pieces]
            what = f"reference image {missing[0]} " + ("is incomplete (no piece with last = true)"
                                                       if missing[0] in partial else "never arrived")
            raise RequestRejected(
                f"the header declares {count} reference images, but {len(missing)} did not arrive whole: {what}",
                param="reference_images",
            )
        images = []
        for i in range(count):
            data = b"".join(self.reference_pieces.pop(i))
            images.append(load_reference(data, i))
        height, width = images[-1].shape[-2:]
        if self.settle_size is not None:
            self.settle_size(self.plan, int(width), int(height))
        else:
            self.plan.width, self.plan.height = int(width), int(height)
        return images

    def complete(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(condition, unconditional condition) once every declared position has arrived."""
        for kind, filled in self.filled.items():
            missing = int((~filled).sum())
            if missing:
                raise RequestRejected(f"{missing} declared {kind} condition positions never arrived", param="chunk")
        condition = torch.cat([self.buffers["text"], self.buffers["image"]], dim=0)
        return condition, self.buffers["negative"]


class RenderPlanner:
    """Checks Render headers against one served model: its pixel size multiple, its condition width and identity,
    whether it needs image-condition rows (``requires_image_condition``: the Dev layout's Q-Former), the service's
    limits and the family's knob table (over the checkpoint's own knob defaults)."""

    def __init__(
        self,
        *,
        size_multiple: int,
        condition_dim: int,
        knob_table: KnobTable,
        requires_image_condition: bool = False,
        max_condition_positions: int,
        max_side: int | None = None,
        max_pixels: int | None = None,
        max_chunk_bytes: int | None = None,
        max_condition_chunks: int | None = None,
        knob_defaults: Mapping[str, Any] | None = None,
        identity: ModelIdentity | None = None,
        max_reference_images: int = 0,
        max_reference_bytes: int = DEFAULT_MAX_REFERENCE_BYTES,
    ):
        """``max_reference_images``: how many reference images (edits) the served DiT takes; 0 refuses them."""
        self.max_reference_images = max_reference_images
        self.max_reference_bytes = max_reference_bytes
        self.size_multiple = size_multiple
        self.condition_dim = condition_dim
        self.requires_image_condition = requires_image_condition
        self.knob_table = knob_table
        self.knob_defaults = knob_table.checkpoint_defaults(knob_defaults or {}, "dit")
        self.max_condition_positions = max_condition_positions
        self.max_side = max_side
        self.max_pixels = max_pixels
        self.max_chunk_bytes = max_chunk_bytes
        self.max_condition_chunks = max_condition_chunks
        self.identity = identity

    def plan(
        self,
        *,
        request_id: str,
        width: int,
        height: int,
        n: int,
        seed: int | None,
        output_format: str,
        output_compression: int | None,
        knobs: dict[str, Any],
        hidden_size: int,
        dtype: str,
        text_positions: int,
        image_positions: int,
        negative_positions: int,
        index_offset: int = 0,
        partial_images: int = 0,
        model: ModelIdentity | None = None,
        upscale: int = 1,
        reference_images: int = 0,
    ) -> RenderPlan:
        """Checks a render header; raises RequestRejected naming the field at fault. With ``reference_images`` the
        header's width and height are ignored (the references give the size: ``settle_size``)."""
        if model is not None and self.identity is not None and model != self.identity:
            # Before anything else: a condition of another model is never rendered, whatever else the header says.
            raise RequestRejected(
                f"model mismatch: this dit_service serves model {self.identity}, but the condition comes from an AR "
                f"serving model {model}; serve the same checkpoint on both stages",
                param="model",
                code=grpc.StatusCode.FAILED_PRECONDITION,
            )
        if reference_images:
            if self.max_reference_images == 0:
                raise RequestRejected(
                    "this model's DiT takes no reference images (editing is served for the MammothModa2-Dev layout)",
                    param="reference_images",
                )
            if reference_images > self.max_reference_images:
                raise RequestRejected(
                    f"reference_images must be at most {self.max_reference_images} (the DiT's image_index_embedding "
                    f"has {self.max_reference_images} rows); got {reference_images}",
                    param="reference_images",
                )
        if not 1 <= upscale <= MAX_UPSCALE:
            raise RequestRejected(f"upscale must be between 1 and {MAX_UPSCALE}; got {upscale}", param="upscale")
        if reference_images:
            width = height = 0  # ignored: the last reference's preprocessed size, once it has arrived
        else:
            self.check_size(width, height, upscale)
        if not 1 <= n <= MAX_IMAGES:
            raise RequestRejected(f"n must be between 1 and {MAX_IMAGES}; got {n}", param="n")
        if seed is not None and seed + n - 1 >= 2**64:
            raise RequestRejected(f"seed + n - 1 must stay below 2**64; got seed {seed} and n {n}", param="seed")
        if index_offset + n - 1 >= 2**32:
            raise RequestRejected(f"index_offset + n - 1 must stay below 2**32; got {index_offset}", param="index_offset")
        if output_format not in FORMATS:
            raise RequestRejected(f"output_format must be one of {', '.join(FORMATS)}", param="output_format")
        if not 0 <= partial_images <= MAX_PARTIAL_IMAGES:
            raise RequestRejected(
                f"partial_images must be between 0 and {MAX_PARTIAL_IMAGES}; got {partial_images}", param="partial_images"
            )
        if output_compression is not None:
            if output_format == "png":
                raise RequestRejected("output_compression applies to jpeg and webp only", param="output_compression")
            if not 0 <= output_compression <= 100:
                raise RequestRejected("output_compression must be between 0 and 100", param="output_compression")
        if hidden_size != self.condition_dim:
            raise RequestRejected(
                f"hidden_size must be {self.condition_dim} for this model; got {hidden_size}", param="hidden_size"
            )
        if dtype not in ("float32", "bfloat16", "float16"):
            raise RequestRejected(f"condition dtype must be float32, bfloat16 or float16; got {dtype!r}", param="dtype")
        positions = {"text": text_positions, "image": image_positions, "negative": negative_positions}
        if text_positions + image_positions == 0:
            raise RequestRejected("the condition is empty: declare text or image positions", param="text_positions")
        if self.requires_image_condition and image_positions == 0:
            raise RequestRejected(
                "this model's DiT conditions on the image rows through its Q-Former (the Dev layout): declare at least "
                "one image position",
                param="image_positions",
            )
        if sum(positions.values()) > self.max_condition_positions:
            raise RequestRejected(
                f"the header declares {sum(positions.values())} condition positions; at most "
                f"{self.max_condition_positions} are accepted",
                param="image_positions",
            )
        resolved = self.knob_table.resolve(knobs, self.knob_defaults, stages=("dit",))
        return RenderPlan(
            request_id=request_id or f"render-{secrets.token_hex(8)}",
            width=width,
            height=height,
            n=n,
            seed=secrets.randbelow(2**32) if seed is None else seed,
            output_format=output_format,
            output_compression=output_compression,
            knobs=resolved,
            hidden_size=hidden_size,
            dtype=getattr(torch, dtype),
            positions=positions,
            index_offset=index_offset,
            partial_images=partial_images,
            upscale=upscale,
            reference_images=reference_images,
        )

    def check_size(self, width: int, height: int, upscale: int, param: str | None = None) -> None:
        """The picture size against the pixel multiple and the service's limits; ``param``: the field to blame
        (default: width/height/upscale)."""
        multiple = self.size_multiple
        for name, side in (("width", width), ("height", height)):
            if side <= 0 or side % multiple:
                raise RequestRejected(f"{name} must be a positive multiple of {multiple}; got {side}", param=param or name)
            if self.max_side is not None and side > self.max_side:
                raise RequestRejected(f"{name} must be at most {self.max_side}; got {side}", param=param or name)
        if self.max_pixels is not None and width * height > self.max_pixels:
            raise RequestRejected(
                f"{width}x{height} is {width * height} pixels; at most {self.max_pixels} are accepted",
                param=param or "width",
            )
        if width * height * upscale**2 > MAX_ANSWERED_PIXELS:
            raise RequestRejected(
                f"{width}x{height} enlarged {upscale} times is {width * upscale}x{height * upscale}; at most "
                f"{MAX_ANSWERED_PIXELS} pixels per picture are sent",
                param=param or "upscale",
            )

    def settle_size(self, plan: RenderPlan, width: int, height: int) -> None:
        """Gives an edit's plan the size of its last reference after preprocessing, checked like a header's size
        (blaming the reference)."""
        try:
            self.check_size(width, height, plan.upscale, param="reference")
        except RequestRejected as exc:
            raise RequestRejected(
                f"the last reference image gives the picture its size, {width}x{height} after preprocessing: "
                f"{exc.message}",
                param="reference",
            ) from None
        plan.width, plan.height = width, height

    def assembler(self, plan: RenderPlan) -> ConditionAssembler:
        """The chunk checker and buffers of ``plan``'s condition and references, under this service's limits."""
        return ConditionAssembler(plan, self.max_chunk_bytes, self.max_condition_chunks, self.max_reference_bytes,
                                  self.settle_size)
