"""Hypothesis against the real Renderer servicer on an in-process gRPC server (a fake, instant pipeline).

Random and truncated RenderInput bytes, headers with random fields, chunks with random dtype, shape and
offset: every stream ends with OK or a clean INVALID_ARGUMENT, never another status, a crash or a hang,
and the server stays healthy. The limits a Render stream meets are checked here too.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dit_service.engine import DiTEngine
from dit_service.server import build_server
from protos import common_pb2, dit_pb2, dit_pb2_grpc
from protos.codec import encode_tensor
from protos.knobs import FAMILIES
from protos.status import param_of
from protos.values import knobs_to_proto

HIDDEN = 8
RENDER = "/ardit.v1.Renderer/Render"
OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))


class FakePipeline:
    """The pipeline surface the engine uses; renders a flat grey image instantly."""

    size_multiple = 16
    condition_dim = HIDDEN
    requires_image_condition = False
    device = torch.device("cpu")  # where the engine times its steps

    def branch_conditions(self, **_):
        return None

    def start_prepared_entry(self, conditions, *, width, height, **_):
        return SimpleNamespace(latents=(width, height), step=0, steps=1, rows=0, done=False, computed_steps=0,
                               skipped_steps=0)

    def step(self, entries, separate=False):
        for entry in entries:
            entry.step, entry.rows, entry.done, entry.computed_steps = 1, 1, True, 1
        return 1

    def decode(self, latents):
        width, height = latents
        return np.full((min(height, 32), min(width, 32), 3), 127, dtype=np.uint8)


@pytest.fixture(scope="module")
def server():
    engine = DiTEngine(
        FakePipeline(), FAMILIES["mammothmoda2"], max_condition_positions=4096,
        max_side=1024, max_pixels=512 * 512, max_chunk_bytes=64 * 1024, max_condition_chunks=64,
    )
    running = build_server("127.0.0.1", 0, max_workers=16, engine=engine, max_receive_message_bytes=128 * 1024)
    running.server.start()
    running.set_serving(True)
    yield running
    running.server.stop(0)
    engine.close()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


def header(**overrides) -> dit_pb2.RenderInput:
    fields = dict(request_id="fuzz", width=32, height=32, n=1, seed=1, hidden_size=HIDDEN, dtype="float32",
                  text_positions=2, image_positions=6, knobs=knobs_to_proto({"num_inference_steps": 1}))
    fields.update(overrides)
    return dit_pb2.RenderInput(header=dit_pb2.RenderHeader(**fields))


def chunk(kind, offset, tensor) -> dit_pb2.RenderInput:
    return dit_pb2.RenderInput(chunk=dit_pb2.ConditionChunk(kind=kind, offset=offset, hidden_states=encode_tensor(tensor)))


END = dit_pb2.RenderInput(end=dit_pb2.RenderEnd())
TEXT, IMAGE = dit_pb2.CONDITION_KIND_TEXT, dit_pb2.CONDITION_KIND_IMAGE


def valid_stream() -> list[dit_pb2.RenderInput]:
    return [header(), chunk(TEXT, 0, torch.ones(2, HIDDEN)), chunk(IMAGE, 0, torch.ones(6, HIDDEN)), END]


def call_raw(channel, messages: list[bytes], timeout: float = 20) -> tuple[grpc.StatusCode, str | None]:
    """Sends raw bytes as Render messages; returns the final status (and the blamed parameter)."""
    render = channel.stream_stream(RENDER, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        for _ in render(iter(messages), timeout=timeout):
            pass
    except grpc.RpcError as exc:
        return exc.code(), param_of(exc)
    return OK, None


def call(channel, messages: list[dit_pb2.RenderInput], timeout: float = 20):
    return call_raw(channel, [m.SerializeToString() for m in messages], timeout)


def assert_clean(code):
    assert code in (OK, INVALID), code


@FUZZ
@given(messages=st.lists(st.binary(max_size=64), max_size=5))
def test_random_bytes(channel, messages):
    code, _ = call_raw(channel, messages)
    assert code == INVALID  # random bytes never make a complete, valid render


@FUZZ
@given(which=st.integers(0, 3), cut=st.integers(0, 10_000), drop=st.booleans())
def test_truncated_or_missing_messages(channel, which, cut, drop):
    raw = [m.SerializeToString() for m in valid_stream()]
    if drop:
        del raw[which]
    else:
        raw[which] = raw[which][: cut % max(len(raw[which]), 1)]
    assert_clean(call_raw(channel, raw)[0])


uint32 = st.one_of(st.integers(0, 40), st.sampled_from([0, 1, 16, 32, 4096, 2**31, 2**32 - 1]))
uint64 = st.one_of(st.integers(0, 100), st.sampled_from([2**63, 2**64 - 1, 2**64 - 5]))
json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers(-(2**60), 2**60) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
knob_names = st.sampled_from(["num_inference_steps", "text_guidance_scale", "cfg_range", "top_k", "seed", "x", ""])


@st.composite
def random_headers(draw):
    fields = dict(
        request_id=draw(st.text(max_size=10)), width=draw(uint32), height=draw(uint32), n=draw(uint32),
        output_format=draw(st.integers(0, 5)), hidden_size=draw(st.sampled_from([HIDDEN, 0, 7, 2**32 - 1])),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16", "int64", "", "float64", "x"])),
        text_positions=draw(uint32), image_positions=draw(uint32), negative_positions=draw(uint32),
        index_offset=draw(uint32), knobs=knobs_to_proto(draw(st.dictionaries(knob_names, json_values, max_size=3))),
    )
    if draw(st.booleans()):
        fields["seed"] = draw(uint64)
    if draw(st.booleans()):
        fields["output_compression"] = draw(uint32)
    return dit_pb2.RenderInput(header=dit_pb2.RenderHeader(**fields))


@st.composite
def random_chunks(draw):
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16", "int64", "uint8", "", "complex64"]))
    shape = draw(st.lists(st.one_of(st.integers(0, 10), st.sampled_from([HIDDEN, -1, 2**40])), max_size=3))
    size = draw(st.integers(0, 400))
    data = draw(st.one_of(st.binary(min_size=size, max_size=size), st.just(b"\0" * 4 * HIDDEN * 2)))
    tensor = common_pb2.Tensor(dtype=dtype, shape=shape, data=data)
    return dit_pb2.RenderInput(
        chunk=dit_pb2.ConditionChunk(kind=draw(st.integers(0, 6)), offset=draw(uint32), hidden_states=tensor)
    )


@FUZZ
@given(first=st.one_of(random_headers(), st.just(header())), rest=st.lists(st.one_of(random_chunks(), st.just(END)), max_size=5))
def test_random_headers_and_chunks(channel, first, rest):
    assert_clean(call(channel, [first, *rest])[0])


@FUZZ
@given(first=random_headers())
def test_random_header_then_a_well_formed_condition(channel, first):
    h = first.header
    messages = [first]
    for kind, count in ((TEXT, h.text_positions), (IMAGE, h.image_positions)):
        if 0 < count <= 64:
            messages.append(chunk(kind, 0, torch.ones(count, HIDDEN)))
    assert_clean(call(channel, [*messages, END])[0])


def test_the_server_is_healthy_and_renders_after_the_fuzzing(channel):
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert call(channel, valid_stream())[0] == OK


# -- limits ---------------------------------------------------------------------------------------------


def test_a_chunk_over_max_chunk_bytes_is_refused_before_decoding(channel):
    big = torch.ones(2100, HIDDEN)  # 67,200 bytes: over the 64 KiB limit, under the receive limit
    code, param = call(channel, [header(image_positions=4096 - 2), chunk(IMAGE, 0, big)])
    assert (code, param) == (INVALID, "chunk.hidden_states")


def test_more_than_max_chunks_is_refused(channel):
    messages = [header(image_positions=100)] + [chunk(IMAGE, i, torch.ones(1, HIDDEN)) for i in range(70)]
    code, param = call(channel, messages)
    assert (code, param) == (INVALID, "chunk")


def test_a_chunk_cannot_claim_more_positions_than_its_bytes_hold(channel):
    too_few_bytes = common_pb2.Tensor(dtype="float32", shape=[6, HIDDEN], data=b"\0" * 16)
    lying = dit_pb2.ConditionChunk(kind=IMAGE, offset=0, hidden_states=too_few_bytes)
    code, param = call(channel, [header(), dit_pb2.RenderInput(chunk=lying)])
    assert (code, param) == (INVALID, "chunk.hidden_states")


@pytest.mark.parametrize(
    "overrides, param",
    [({"width": 2048}, "width"), ({"width": 1024, "height": 1024}, "width"), ({"image_positions": 5000}, "image_positions"),
     ({"seed": 2**64 - 1, "n": 2}, "seed"), ({"index_offset": 2**32 - 1, "n": 2}, "index_offset")],
)
def test_header_limits(channel, overrides, param):
    assert call(channel, [header(**overrides)]) == (INVALID, param)


def test_a_message_over_the_receive_limit_is_resource_exhausted(channel):
    code, _ = call_raw(channel, [header().SerializeToString(), b"\0" * (200 * 1024)])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_max_concurrent_streams_per_connection(tmp_path):
    engine = DiTEngine(FakePipeline(), FAMILIES["mammothmoda2"], max_condition_positions=4096)
    running = build_server("127.0.0.1", 0, max_workers=8, engine=engine, max_concurrent_streams=1)
    running.server.start()
    running.set_serving(True)
    address = f"127.0.0.1:{running.port}"
    release = threading.Event()

    def held():
        yield header()
        release.wait(10)
        yield from valid_stream()[1:]

    try:
        with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as one, \
                grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as other:
            stub = dit_pb2_grpc.RendererStub(one)
            first = stub.Render(held(), timeout=20)
            time.sleep(1.0)  # the first stream is open on the connection
            # The first stream holds the connection's only slot: a second stream on it waits.
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Render(iter(valid_stream()), timeout=1.5))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # Another connection is not held up.
            assert call(other, valid_stream())[0] == OK
            release.set()
            assert any(e.WhichOneof("event") == "image" for e in list(first))  # drained: the slot is free again
            assert call(one, valid_stream())[0] == OK
    finally:
        release.set()
        running.server.stop(0)
        engine.close()
