"""How much GPU memory the fast decoder needs, and how many images fit the memory ar_service may use.

The fast decoder (``static_decode.StaticDecoder``) allocates its K/V cache up front for every slot, then captures its
step graphs, whose intermediates come from one memory pool they share. Both grow with the slot count, so the engine
sizes them against the device before allocating anything (``fit_batch``): the batch asked for when it fits, fewer
images when they do not, a refusal when not even one image does. The arithmetic here is over plain numbers, so it
runs (and is tested) without a GPU (it reads the triton attention kernel's split count from ``decode_kernels``, its
owner); ``cuda_memory`` reads the device's figures where there is one.

What one configuration needs, in bytes (``s``: the model dtype's bytes per element; ``P``: decode rows, two per
image; ``B``: the longest attention length a step may take, the cache's ``max_positions``)::

    needed(images)   = slots * decode_bytes_per_slot + decode_workspace_bytes(rows = slots)
    slots            = ROWS_PER_IMAGE * images
    per slot         = 2 (K and V) * layers * kv_heads * max_positions * head_dim * s
    workspace(P)     = WARM_UP_COPIES * step_workspace_bytes(P, B) + WORKSPACE_MARGIN

``step_workspace_bytes`` is the sum of a step's largest intermediates (see its docstring): an upper bound of what
one step holds at once, since they are not all alive together. The graphs run one at a time and share one pool,
so the pool holds about one step's worth; the eager warm-up runs before each capture allocate the same again
outside the pool (``WARM_UP_COPIES``), and ``WORKSPACE_MARGIN`` covers the rest: cuBLAS and Triton workspaces, the
graphs' kept outputs, the caching allocator's rounding and a prefill's activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ar_service.model import decode_kernels

#: Copies of one step's intermediates that start-up holds: the graphs' shared pool, and the eager warm-up runs
#: before each capture (on a side stream, outside the pool, kept by the caching allocator).
WARM_UP_COPIES = 2
#: Fixed memory beside the step's intermediates: cuBLAS and Triton workspaces, the graphs' kept outputs, the caching
#: allocator's rounding, the activations of a prefill between two steps.
WORKSPACE_MARGIN = 1 << 30
#: float32 buffers the size of a row's logits that the sampler (``sampling.sample_rows``) makes along the way:
#: the float copy, scaled and masked scores, the sorted copy and its two masked versions, softmax, cumsum and its
#: difference, the noise and its gathered copy, the noisy scores.
SAMPLER_FLOAT_COPIES = 12


class DecodeShapes(Protocol):
    """What the arithmetic reads of the model's configuration (``ARConfig`` has these)."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def gen_vocab_size(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def qk_norm(self) -> bool: ...


def decode_bytes_per_slot(config: DecodeShapes, max_positions: int, dtype_bytes: int) -> int:
    """K and V of one decode slot: 2 * layers * kv_heads * max_positions * head_dim * dtype_bytes (the shape
    ``StaticDecoder`` allocates, ``(layers, slots, kv_heads, max_positions, head_dim)`` for each of K and V)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * max_positions * config.head_dim * dtype_bytes


def step_workspace_bytes(
    config: DecodeShapes,
    rows: int,
    bucket: int,
    *,
    dtype_bytes: int,
    shared_slots: bool = False,
    kernels: str = "torch",
    fp8: bool = False,
) -> int:
    """The largest intermediates of one decode step over ``rows`` rows attending over ``bucket`` positions, summed.

    Per row (``s``: bytes per element of the model dtype; H hidden, D head_dim, Q = heads * D, K = kv_heads * D,
    F the FFN width, V the generation vocabulary):

    - the residual stream: its input and output, the attention output and the normalised input (4 H s) and
      RMSNorm's float32 temporaries (2 H * 4);
    - the fused q/k/v projection ((Q + 2 K) s) and RoPE's rotated q and k with their halves (3 (Q + K) s); with
      Dev's per-head q/k RMSNorm (``qk_norm``) on the torch kernels, its float32 temporaries and its normalised q
      and k ((Q + K) (2 * 4 + 2 s)); the triton kernels normalise inside the RoPE launch, in registers. (Q is
      heads * head_dim, which in Dev is not the hidden size; q/k/v biases and the norms' weights are weights, held
      before the decoder is sized, not a step's intermediates);
    - attention, torch kernels: the float32 scores, masked scores and softmax (3 heads * bucket * 4) and the
      probabilities in the model dtype (heads * bucket * s); with ``shared_slots`` the larger of the rows' K and V
      gathered over the bucket (2 kv_heads * bucket * D * s) and the triton attention's partial results (below),
      whichever way a step of lanes reads its rows' slots (``StaticDecoder``'s ``lane_attention``). Triton kernels:
      the split-K partial results in float32 (kv_heads * decode_kernels.ATTENTION_SPLITS * (G D + 2 G) * 4, G the
      query group padded to 16 or more);
    - the MLP: the fused gate/up output (2 F s), SiLU(gate) and the product (2 F s);
    - the generation head's logits (V s) and the sampler's copies of them (SAMPLER_FLOAT_COPIES float32 copies,
      the int64 sort order, two boolean masks).

    With FP8 weights on the torch kernels each linear dequantizes its weight for the step: two of the largest
    (gate/up, 2 F H s) are added once. ``bucket`` is the longest step the decoder may run (its max_positions): the
    torch kernels capture a graph per length bucket as streams reach it.
    """
    s = dtype_bytes
    h, d = config.hidden_size, config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    q, kv, f, v = heads * d, kv_heads * d, config.intermediate_size, config.gen_vocab_size
    stream = 4 * h * s + 2 * h * 4
    projections = (q + 2 * kv) * s + 3 * (q + kv) * s
    if config.qk_norm and kernels != "triton":
        projections += (q + kv) * (2 * 4 + 2 * s)
    splits = decode_kernels.attention_workspace_bytes(1, kv_heads, heads // kv_heads, d)
    if kernels == "triton":
        attention = splits
    else:
        attention = 3 * heads * bucket * 4 + heads * bucket * s
        if shared_slots:
            attention += max(2 * kv_heads * bucket * d * s, splits)
    mlp = 4 * f * s
    sampler = v * s + SAMPLER_FLOAT_COPIES * v * 4 + v * 8 + 2 * v
    per_row = stream + projections + attention + mlp + sampler
    dequantized = 2 * (2 * f * h * s) if fp8 and kernels != "triton" else 0
    return rows * per_row + dequantized


def decode_workspace_bytes(config: DecodeShapes, rows: int, bucket: int, **step: Any) -> int:
    """What the step graphs need beside the K/V cache: ``WARM_UP_COPIES`` steps' intermediates
    (``step_workspace_bytes``, which takes ``step``'s keywords) plus ``WORKSPACE_MARGIN``."""
    return WARM_UP_COPIES * step_workspace_bytes(config, rows, bucket, **step) + WORKSPACE_MARGIN


@dataclass(frozen=True)
class DeviceMemory:
    """A snapshot of the device: its ``total`` memory, what is ``free`` on it now (every process counted), and what
    this process ``held`` already (its allocator's reserved memory: the weights, the prefix cache), in bytes."""

    total: int
    free: int
    held: int

    def budget(self, utilization: float) -> int:
        """What this process may still allocate: ``utilization`` of the total less what it holds, and never more
        than is free on the device now."""
        return max(0, min(int(self.total * utilization) - self.held, self.free))

    def describe(self, utilization: float) -> str:
        return (f"gpu_memory_utilization {utilization:g} of the device's {format_bytes(self.total)} "
                f"= {format_bytes(int(self.total * utilization))}, {format_bytes(self.held)} already held by this "
                f"process, {format_bytes(self.free)} free on the device")


def cuda_memory(device) -> DeviceMemory:
    """The CUDA device's figures (``torch.cuda.mem_get_info`` and ``memory_reserved``)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, free=free, held=torch.cuda.memory_reserved(device))


class DecodeMemoryError(ValueError):
    """Not even one image fits: ``needed`` bytes for one, ``available`` bytes there."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed, self.available = needed, available


@dataclass(frozen=True)
class FitResult:
    """``images`` of the ``requested`` fit: they need ``needed`` bytes (the requested ones ``requested_needed``) of
    the ``available``."""

    requested: int
    images: int
    needed: int
    requested_needed: int
    available: int

    @property
    def shrunk(self) -> bool:
        return self.images < self.requested


def fit_batch(
    requested_images: int, rows_per_image: int, per_slot: int, workspace_fn: Callable[[int], int], budget: int
) -> FitResult:
    """The most images, up to ``requested_images``, whose decode memory fits ``budget`` bytes: each image takes
    ``rows_per_image`` slots of ``per_slot`` bytes, and ``workspace_fn(rows)`` is the step workspace for that many
    rows. Raises ``DecodeMemoryError`` (with the figures) when not even one image fits."""
    if requested_images < 1 or rows_per_image < 1:
        raise ValueError("fit_batch needs at least one image of at least one row")

    def needed(images: int) -> int:
        rows = images * rows_per_image
        return rows * per_slot + workspace_fn(rows)

    one = needed(1)
    if one > budget:
        raise DecodeMemoryError(f"one image needs {format_bytes(one)} of decode memory and {format_bytes(budget)} is "
                                "available", one, budget)
    low, high = 1, requested_images  # needed() grows with the images: the largest that fits, by bisection
    while low < high:
        middle = (low + high + 1) // 2
        if needed(middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return FitResult(requested_images, low, needed(low), needed(requested_images), budget)


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at 1 or more: 512 B, 3.50 MiB, 21.34 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from or during, is the device running out of memory
    (``torch.OutOfMemoryError``; a CUDA error saying so, e.g. from a graph capture that ended on one)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if type(current).__name__ == "OutOfMemoryError" or "out of memory" in str(current).lower():
            return True
        seen.add(id(current))
        current = current.__cause__ if current.__cause__ is not None else (
            None if current.__suppress_context__ else current.__context__)
    return False
