"""Knob values and errors cross the wire unchanged in meaning."""

import grpc
import pytest

from protos.status import HTTP_STATUS, http_status
from protos.values import from_value, knobs_from_proto, knobs_to_proto, to_value


@pytest.mark.parametrize("value", [None, True, False, 3, 2.5, "text", [0.25, 0.5], {"a": [1, "b"]}])
def test_value_round_trip(value):
    assert from_value(to_value(value)) == value


def test_whole_numbers_come_back_as_int_and_fractions_as_float():
    assert isinstance(from_value(to_value(20)), int)
    assert isinstance(from_value(to_value(20.0)), int)
    assert from_value(to_value(20.5)) == 20.5


def test_knob_maps_round_trip():
    knobs = {"text_guidance_scale": 4.5, "cfg_range": [0.0, 0.5], "num_inference_steps": 8}
    assert knobs_from_proto(knobs_to_proto(knobs)) == knobs


def test_unsupported_python_values_are_refused():
    with pytest.raises(TypeError):
        to_value(object())


def test_http_mapping_follows_grpc_gateway():
    assert http_status(grpc.StatusCode.INVALID_ARGUMENT) == 400
    assert http_status(grpc.StatusCode.RESOURCE_EXHAUSTED) == 429
    assert http_status(grpc.StatusCode.UNAVAILABLE) == 503
    assert http_status(grpc.StatusCode.DEADLINE_EXCEEDED) == 504
    assert http_status(grpc.StatusCode.CANCELLED) == 499
    assert http_status(grpc.StatusCode.NOT_FOUND) == 404
    assert set(HTTP_STATUS) == set(grpc.StatusCode)


class _Error(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_a_peer_lost_mid_call_counts_as_unavailable():
    from protos.status import effective_code

    assert effective_code(_Error(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2")) == grpc.StatusCode.UNAVAILABLE
    assert effective_code(_Error(grpc.StatusCode.UNKNOWN, "Socket closed")) == grpc.StatusCode.UNAVAILABLE
    assert effective_code(_Error(grpc.StatusCode.INTERNAL, "render failed: ValueError")) == grpc.StatusCode.INTERNAL
    assert effective_code(_Error(grpc.StatusCode.INVALID_ARGUMENT, "socket closed")) == grpc.StatusCode.INVALID_ARGUMENT
