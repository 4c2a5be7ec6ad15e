"""Internal callers speak gRPC directly: the front door, the token grid, and Render itself."""

from __future__ import annotations

import io
import json

import grpc
import pytest
import torch
from PIL import Image

from protos import ar_pb2, ar_pb2_grpc, dit_pb2, dit_pb2_grpc
from protos.codec import encode_tensor
from protos.status import param_of
from protos.values import knobs_to_proto

FAST = knobs_to_proto({"num_inference_steps": 3})


@pytest.fixture(scope="module")
def generator(stack):
    with grpc.insecure_channel(stack.ar_address) as channel:
        yield ar_pb2_grpc.ImageGeneratorStub(channel)


@pytest.fixture(scope="module")
def renderer(stack):
    with grpc.insecure_channel(stack.dit_address) as channel:
        yield dit_pb2_grpc.RendererStub(channel)


@pytest.fixture(scope="module")
def t2i(stack) -> dict:
    return json.loads((stack.model_dir / "t2i_generation_config.json").read_text())


def test_generate_image_unary(generator):
    reply = generator.GenerateImage(
        ar_pb2.GenerateImageRequest(prompt="a boat", width=256, height=128, n=2, seed=42, knobs=FAST), timeout=120
    )
    assert [image.index for image in reply.images] == [0, 1]
    assert [image.seed for image in reply.images] == [42, 43]
    assert reply.seed == 42
    for image in reply.images:
        assert Image.open(io.BytesIO(image.data)).size == (256, 128)
    assert reply.timings.ar_tokens == 2 * (8 * 17 + 1)


def test_stream_image_reports_rows_steps_then_images(generator):
    stream = generator.StreamImage(ar_pb2.GenerateImageRequest(prompt="a boat", seed=5, knobs=FAST), timeout=120)
    kinds, rows, steps = [], [], []
    for event in stream:
        kind = event.WhichOneof("event")
        kinds.append(kind)
        if kind == "progress" and event.progress.stage == "ar_decode":
            rows.append(event.progress.step)
        if kind == "progress" and event.progress.stage == "denoise":
            steps.append(event.progress.step)
    assert rows == list(range(1, 17))
    assert steps == [1, 2, 3]
    assert kinds[-2:] == ["image", "completed"]


def test_visual_tokens_follow_the_grid_contract(generator, t2i):
    rows = list(
        generator.GenerateVisualTokens(ar_pb2.GenerateImageRequest(prompt="a boat", width=128, height=64, seed=3), timeout=60)
    )
    assert [row.row for row in rows] == list(range(4))
    for row in rows:
        assert (row.grid_width, row.grid_height) == (8, 4)
        assert len(row.token_ids) == 8
        assert all(t2i["visual_token_start_id"] <= t <= t2i["visual_token_end_id"] for t in row.token_ids)
    again = list(
        generator.GenerateVisualTokens(ar_pb2.GenerateImageRequest(prompt="a boat", width=128, height=64, seed=3), timeout=60)
    )
    assert [list(r.token_ids) for r in again] == [list(r.token_ids) for r in rows]


def test_bad_knob_is_invalid_argument_naming_it(generator):
    with pytest.raises(grpc.RpcError) as info:
        generator.GenerateImage(
            ar_pb2.GenerateImageRequest(prompt="a boat", knobs=knobs_to_proto({"cfg_range": [1, 0]})), timeout=30
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert param_of(info.value) == "cfg_range"


def test_models_are_listed(generator):
    (card,) = generator.ListModels(ar_pb2.ListModelsRequest(), timeout=10).models
    assert card.size_multiple == 16 and card.max_side == 512
    assert (card.grid.rule, card.grid.pixels_per_token) == ("pixels_per_token", 16)  # the tiny model's grid
    assert {k.name for k in card.knobs} >= {"num_inference_steps", "text_guidance_scale", "cfg_range"}


# -- Render, called directly ---------------------------------------------------------------------

HIDDEN = 64  # the tiny AR's hidden size


def header(**overrides) -> dit_pb2.RenderInput:
    fields = dict(
        request_id="direct", width=128, height=128, n=1, seed=7, hidden_size=HIDDEN, dtype="float32",
        text_positions=3, image_positions=8 * 9, knobs=FAST,
    )
    fields.update(overrides)
    return dit_pb2.RenderInput(header=dit_pb2.RenderHeader(**fields))


def chunk(kind, offset, tensor) -> dit_pb2.RenderInput:
    return dit_pb2.RenderInput(chunk=dit_pb2.ConditionChunk(kind=kind, offset=offset, hidden_states=encode_tensor(tensor)))


END = dit_pb2.RenderInput(end=dit_pb2.RenderEnd())
TEXT, IMAGE = dit_pb2.CONDITION_KIND_TEXT, dit_pb2.CONDITION_KIND_IMAGE


def condition(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, HIDDEN, generator=g), torch.randn(72, HIDDEN, generator=g)


def render(renderer, messages) -> list[dit_pb2.RenderEvent]:
    return list(renderer.Render(iter(messages), timeout=60))


def test_render_direct_rerenders_a_condition_with_several_seeds(renderer):
    text, image = condition()
    messages = [header(n=2), chunk(TEXT, 0, text), chunk(IMAGE, 0, image[:40]), chunk(IMAGE, 40, image[40:]), END]
    events = render(renderer, messages)
    images = [e.image for e in events if e.WhichOneof("event") == "image"]
    assert [(i.index, i.seed) for i in images] == [(0, 7), (1, 8)]
    assert images[0].data != images[1].data
    assert events[-1].completed.seed == 7
    # Re-rendering image 1 alone with seed 8 gives the same bytes.
    alone = render(renderer, [header(seed=8), chunk(TEXT, 0, text), chunk(IMAGE, 0, image), END])
    assert [e.image.data for e in alone if e.WhichOneof("event") == "image"] == [images[1].data]


def expect_invalid(renderer, messages, param=None):
    with pytest.raises(grpc.RpcError) as info:
        render(renderer, messages)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    if param:
        assert param_of(info.value) == param
    return info.value


def test_render_without_header_is_invalid(renderer):
    text, _ = condition()
    expect_invalid(renderer, [chunk(TEXT, 0, text), END], param="header")


def test_render_chunk_of_wrong_dtype_is_invalid(renderer):
    text, image = condition()
    error = expect_invalid(renderer, [header(), chunk(TEXT, 0, text.to(torch.bfloat16)), END])
    assert "dtype" in error.details()


def test_render_chunk_of_wrong_shape_is_invalid(renderer):
    error = expect_invalid(renderer, [header(), chunk(TEXT, 0, torch.zeros(3, HIDDEN + 1)), END])
    assert "shape" in error.details()


def test_render_chunk_beyond_the_declared_positions_is_invalid(renderer):
    text, image = condition()
    expect_invalid(renderer, [header(), chunk(TEXT, 0, text), chunk(IMAGE, 70, image[:5]), END], param="chunk.offset")


def test_render_missing_positions_is_invalid(renderer):
    text, image = condition()
    expect_invalid(renderer, [header(), chunk(TEXT, 0, text), chunk(IMAGE, 0, image[:10]), END], param="chunk")


def test_render_chunks_after_the_end_marker_are_invalid(renderer):
    text, image = condition()
    expect_invalid(renderer, [header(), chunk(TEXT, 0, text), chunk(IMAGE, 0, image), END, chunk(TEXT, 0, text)], param="end")


def test_render_header_with_wrong_hidden_size_is_invalid(renderer):
    expect_invalid(renderer, [header(hidden_size=HIDDEN * 2)], param="hidden_size")


def test_render_header_with_bad_knob_is_invalid(renderer):
    expect_invalid(renderer, [header(knobs=knobs_to_proto({"num_inference_steps": -1}))], param="num_inference_steps")


def test_renderer_still_works_after_bad_streams(renderer):
    text, image = condition(1)
    events = render(renderer, [header(), chunk(TEXT, 0, text), chunk(IMAGE, 0, image), END])
    assert sum(e.WhichOneof("event") == "image" for e in events) == 1
