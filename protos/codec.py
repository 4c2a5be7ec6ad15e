"""Tensors on the wire: dtype name + shape + raw little-endian bytes.

The same layout the KServe/Triton v2 protocol uses for raw tensor contents. bf16 stays
bf16: its bytes travel as they are (numpy has no bf16, so the bytes go through torch).
torch is imported lazily so that the gateway can import ``protos`` without it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from protos import common_pb2

if TYPE_CHECKING:
    import torch

# Condition chunks stay well under gRPC's 4 MiB default message size.
MAX_CHUNK_BYTES = 3 * 1024 * 1024
# No ardit tensor has more dimensions; torch refuses over 64 and overflows its strides on huge empty shapes.
MAX_DIMS = 8
_MAX_EXTENT = 2**62

_ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "bool": 1,
}
WIRE_DTYPES = tuple(_ITEMSIZE)

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ardit's tensor codec assumes a little-endian host")


class CodecError(ValueError):
    """A tensor message that does not describe a valid tensor."""


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype ("bfloat16", "float32", ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise CodecError(f"dtype {name} cannot travel; supported: {', '.join(WIRE_DTYPES)}")
    return name


def encode_tensor(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Packs a tensor (any device) into a wire message."""
    import torch

    name = dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return common_pb2.Tensor(dtype=name, shape=list(tensor.shape), data=data)


def decode_tensor(message: common_pb2.Tensor) -> torch.Tensor:
    """Unpacks a wire message into a CPU tensor, checking that its bytes match its shape."""
    import torch

    if message.dtype not in _ITEMSIZE:
        raise CodecError(f"unknown tensor dtype {message.dtype!r}; supported: {', '.join(WIRE_DTYPES)}")
    shape = list(message.shape)
    if len(shape) > MAX_DIMS:
        raise CodecError(f"tensor shape has {len(shape)} dimensions; at most {MAX_DIMS} are supported")
    if any(dim < 0 for dim in shape):
        raise CodecError(f"tensor shape {shape} has a negative dimension")
    if math.prod(dim for dim in shape if dim) * _ITEMSIZE[message.dtype] >= _MAX_EXTENT:
        raise CodecError(f"tensor shape {shape} is too large")
    expected = math.prod(shape) * _ITEMSIZE[message.dtype]
    if len(message.data) != expected:
        raise CodecError(
            f"tensor of dtype {message.dtype} and shape {shape} needs {expected} bytes, got {len(message.data)}"
        )
    dtype = _torch_dtype(message.dtype)
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(message.data), dtype=dtype).reshape(shape)


def iter_row_chunks(tensor: torch.Tensor, max_bytes: int = MAX_CHUNK_BYTES) -> Iterator[tuple[int, torch.Tensor]]:
    """Splits a [positions, hidden] tensor into (offset, slice) pieces of at most ``max_bytes``."""
    if tensor.dim() != 2:
        raise CodecError(f"condition tensors are [positions, hidden]; got shape {list(tensor.shape)}")
    row_bytes = tensor.shape[1] * tensor.element_size()
    rows_per_chunk = max(1, max_bytes // max(row_bytes, 1))
    for start in range(0, tensor.shape[0], rows_per_chunk):
        yield start, tensor[start : start + rows_per_chunk]
