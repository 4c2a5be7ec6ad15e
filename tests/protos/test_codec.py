"""The tensor codec: what goes on the wire comes back bit for bit, and bad messages are refused."""

import pytest
import torch

from protos import common_pb2
from protos.codec import MAX_CHUNK_BYTES, CodecError, decode_tensor, encode_tensor, iter_row_chunks

ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_round_trip_is_exact(dtype):
    source = (torch.randn(5, 7, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    message = encode_tensor(source)
    assert message.dtype == str(dtype).removeprefix("torch.")
    assert list(message.shape) == [5, 7]
    back = decode_tensor(common_pb2.Tensor.FromString(message.SerializeToString()))
    assert back.dtype == dtype
    assert torch.equal(back, source)


def test_bfloat16_travels_as_two_bytes_per_value():
    source = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    message = encode_tensor(source)
    assert len(message.data) == 6
    assert torch.equal(decode_tensor(message), source)


def test_non_contiguous_and_empty_tensors():
    source = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(decode_tensor(encode_tensor(source)), source)
    empty = torch.empty(0, 8, dtype=torch.bfloat16)
    back = decode_tensor(encode_tensor(empty))
    assert back.shape == (0, 8) and back.dtype == torch.bfloat16


def test_byte_count_must_match_shape():
    message = encode_tensor(torch.zeros(2, 3))
    message.data = message.data[:-1]
    with pytest.raises(CodecError, match="needs 24 bytes"):
        decode_tensor(message)


def test_unknown_dtype_is_refused():
    with pytest.raises(CodecError, match="unknown tensor dtype"):
        decode_tensor(common_pb2.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8))


def test_negative_dimension_is_refused():
    with pytest.raises(CodecError, match="negative"):
        decode_tensor(common_pb2.Tensor(dtype="float32", shape=[-1, 2], data=b""))


def test_row_chunks_stay_under_the_limit_and_cover_everything():
    # The 1024x1024 image condition of a Preview-sized AR in bf16: 4160 x 3584.
    hidden = torch.zeros(4160, 3584, dtype=torch.bfloat16)
    pieces = list(iter_row_chunks(hidden))
    assert len(pieces) > 1
    assert all(encode_tensor(piece).ByteSize() < 4 * 1024 * 1024 for _, piece in pieces)
    assert all(piece.numel() * piece.element_size() <= MAX_CHUNK_BYTES for _, piece in pieces)
    offsets = [offset for offset, _ in pieces]
    sizes = [piece.shape[0] for _, piece in pieces]
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    assert sum(sizes) == 4160
