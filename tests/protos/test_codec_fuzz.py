"""Hypothesis: decode_tensor turns any Tensor message into a tensor or a CodecError, nothing else."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import common_pb2
from protos.codec import WIRE_DTYPES, CodecError, decode_tensor, encode_tensor

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
SMALL_DIM = st.integers(min_value=0, max_value=6)
dtypes = st.one_of(st.sampled_from(WIRE_DTYPES), st.text(max_size=12))
shapes = st.one_of(st.lists(SMALL_DIM, max_size=4), st.lists(INT64, max_size=70), st.lists(st.sampled_from([0, 2**62, -1, 3]), max_size=8))


def check(message: common_pb2.Tensor) -> None:
    try:
        tensor = decode_tensor(message)
    except CodecError:
        return
    assert isinstance(tensor, torch.Tensor)
    assert list(tensor.shape) == list(message.shape)
    assert tensor.numel() == math.prod(message.shape)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=dtypes, shape=shapes, data=st.binary(max_size=512))
def test_random_tensor_messages_decode_or_raise_codec_error(dtype, shape, data):
    check(common_pb2.Tensor(dtype=dtype, shape=shape, data=data))


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(WIRE_DTYPES), shape=st.lists(SMALL_DIM, min_size=1, max_size=3), cut=st.integers(0, 10_000))
def test_truncated_or_padded_data_is_a_codec_error(dtype, shape, cut):
    tensor = torch.zeros(shape, dtype=getattr(torch, dtype))
    message = encode_tensor(tensor)
    assert decode_tensor(message).shape == tensor.shape
    if not message.data:
        return
    truncated = common_pb2.Tensor(dtype=dtype, shape=shape, data=message.data[: cut % len(message.data)])
    padded = common_pb2.Tensor(dtype=dtype, shape=shape, data=message.data + b"\0" * (1 + cut % 7))
    for bad in (truncated, padded):
        try:
            decode_tensor(bad)
        except CodecError:
            continue
        raise AssertionError("wrong-length data decoded")


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=256))
def test_random_bytes_parsed_as_a_tensor_message(raw):
    message = common_pb2.Tensor()
    try:
        message.ParseFromString(raw)
    except Exception:  # not a Tensor message at all: the transport's business (INVALID_ARGUMENT there)
        return
    check(message)
