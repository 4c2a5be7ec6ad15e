"""Hypothesis against the real services over gRPC: random requests and bytes end cleanly, servers stay up."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import ar_pb2, ar_pb2_grpc
from protos.values import knobs_to_proto
from servicekit.healthcheck import check

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
# Statuses a caller may get for a request it made up: bad input, an unknown model. Never INTERNAL/UNKNOWN.
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.ar_address) as channel:
        yield channel


json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers(-(2**70), 2**70) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=5,
)
knob_names = st.sampled_from(
    ["num_inference_steps", "text_guidance_scale", "cfg_range", "temperature", "top_k", "top_p", "seed", "style", ""]
)
sides = st.one_of(st.sampled_from([0, 16, 64, 128, 250, 512, 528, 4096, 2**32 - 1]), st.integers(0, 600))


@st.composite
def requests(draw):
    fields = dict(
        request_id=draw(st.text(max_size=8)),
        model=draw(st.sampled_from(["", "tiny", "dall-e-3", "\x00"])),
        prompt=draw(st.one_of(st.text(max_size=40), st.just("a cat"), st.just("<|im_end|>x"))),
        negative_prompt=draw(st.one_of(st.just(""), st.text(max_size=20))),
        width=draw(sides),
        height=draw(sides),
        n=draw(st.one_of(st.integers(0, 12), st.just(2**32 - 1))),
        output_format=draw(st.integers(0, 6)),
        quality=draw(st.sampled_from(["", "auto", "low", "hd", "ultra", "\n"])),
        knobs=knobs_to_proto(draw(st.dictionaries(knob_names, json_values, max_size=3))),
    )
    if draw(st.booleans()):
        fields["seed"] = draw(st.one_of(st.integers(0, 2**64 - 1), st.just(2**63)))
    if draw(st.booleans()):
        fields["output_compression"] = draw(st.integers(0, 2**32 - 1))
    return ar_pb2.GenerateImageRequest(**fields)


@FUZZ
@given(request=requests())
def test_random_generate_requests_end_cleanly(channel, request):
    """StreamImage with random fields: accepted (the first event arrives; we cancel) or refused cleanly."""
    stream = ar_pb2_grpc.ImageGeneratorStub(channel).StreamImage(request, timeout=60)
    try:
        next(stream)
    except StopIteration:
        pytest.fail("the stream ended without an event")
    except grpc.RpcError as exc:
        assert exc.code() in CLEAN, (exc.code(), exc.details())
    finally:
        stream.cancel()


@FUZZ
@given(raw=st.binary(max_size=80))
def test_random_bytes_to_every_image_generator_method(channel, raw):
    for method in ("GenerateImage", "StreamImage", "GenerateVisualTokens", "ListModels"):
        call = channel.unary_stream if method in ("StreamImage", "GenerateVisualTokens") else channel.unary_unary
        rpc = call(f"/ardit.v1.ImageGenerator/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            result = rpc(raw, timeout=60)
            if method in ("StreamImage", "GenerateVisualTokens"):
                next(iter(result), None)
                result.cancel()
        except grpc.RpcError as exc:
            assert exc.code() in CLEAN, (method, exc.code(), exc.details())


@FUZZ
@given(messages=st.lists(st.binary(max_size=60), max_size=4))
def test_random_bytes_on_a_real_render_stream(stack, messages):
    with grpc.insecure_channel(stack.dit_address) as channel:
        render = channel.stream_stream("/ardit.v1.Renderer/Render", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            list(render(iter(messages), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_services_are_healthy_after_the_fuzzing(stack):
    assert check(stack.ar_address) == check(stack.dit_address) == "SERVING"
    reply = ar_pb2_grpc.ImageGeneratorStub(grpc.insecure_channel(stack.ar_address)).GenerateImage(
        ar_pb2.GenerateImageRequest(prompt="after the storm", width=64, height=64, seed=1,
                                    knobs=knobs_to_proto({"num_inference_steps": 2})),
        timeout=60,
    )
    assert len(reply.images) == 1
