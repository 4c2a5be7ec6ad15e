"""An edit in ar_service without a socket: the tiny Dev model's MammothTok, the edit prompt (the input image's
MammothTok block in place of ``<|gen_placeholder|>``, then the instruction), the text condition without the image's
gen ids, AR guidance's unconditional row, the Render header carrying the input images, the limits and the refusals
(a Preview model, a Dev checkpoint without MammothTok), EditImage's stream reading, and make_tiny --dev's
determinism."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import grpc
import pytest
from PIL import Image

from ar_service import events
from ar_service.conditions import text_condition_mask
from ar_service.edit_image import ImagePromptIds, placeholder_count, reference_output_size
from ar_service.engine import AREngine
from ar_service.model.loading import load_ar
from ar_service.model.mammothtok import CHECKPOINT_PREFIX
from ar_service.model.tiny import TINY_GEN_TOKENIZER_CONFIG, write_ar_only_root
from ar_service.planning import EditLimits
from ar_service.prompt import GEN_PLACEHOLDER, Grid, build_edit_prompt
from ar_service.render_client import RenderHeader, reference_pieces
from ar_service.server import read_edit_input
from protos import ar_pb2, common_pb2
from protos.knobs import FAMILIES
from protos.status import RequestRejected
from servicekit.checkpoint import open_checkpoint, save_tensors
from tests.ar_service.test_ar_batching import FakeRenderer, wait_done


def png(width: int, height: int, color=(200, 40, 40)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def dev_root(tmp_path_factory) -> Path:
    return write_ar_only_root(tmp_path_factory.mktemp("ckpt") / "tiny-dev", dev=True)


@pytest.fixture(scope="module")
def dev_engine(dev_root):
    checkpoint = open_checkpoint(dev_root)
    engine = AREngine(load_ar(dev_root), checkpoint, FAMILIES[checkpoint.family], FakeRenderer(),
                      edit_limits=EditLimits(max_image_bytes=200_000, max_total_bytes=300_000, max_image_pixels=1_000_000))
    yield engine
    engine.close()


def test_the_tiny_dev_checkpoint_holds_a_loadable_mammothtok(dev_root):
    checkpoint = open_checkpoint(dev_root)
    assert checkpoint.config["gen_tokenizer_config"] == TINY_GEN_TOKENIZER_CONFIG
    loaded = load_ar(dev_root)
    assert loaded.mammothtok is not None and loaded.edit_refusal == ""
    assert loaded.mammothtok.config.codebook_size == 64
    assert len(checkpoint.tensor_names(CHECKPOINT_PREFIX)) == len(loaded.mammothtok.state_dict())


def test_edit_prompt_holds_the_image_block_then_the_instruction(dev_engine):
    loaded = dev_engine.loaded
    plan = dev_engine.plan(prompt="make it blue", images=[png(96, 64)], seed=1)
    assert (plan.width, plan.height, plan.upscale) == (96, 64, 1) and plan.references == (png(96, 64),)
    ((width, height, rows, cols),) = plan.reference_grids
    assert (width, height, rows, cols) == (98, 70, 5, 7)  # smart_resize to multiples of 14
    ids = ImagePromptIds.from_tokenizer(loaded.tokenizer, loaded.t2i)
    text = loaded.tokenizer.decode(plan.prompt_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful image generator.<|im_end|>\n<|im_start|>user\n"
                           "<|image start|>5*7<|image token|>")
    assert text.endswith("<|image end|>make it blue<|im_end|>\n<|im_start|>assistant\n<|image start|>6*4<|image token|>")
    start = plan.prompt_ids.index(ids.image_start)
    block = plan.prompt_ids[start:start + placeholder_count(rows, cols)]
    assert block[-1] == ids.image_end and ids.placeholder not in plan.prompt_ids
    assert sum(ids.visual_token_start <= t < ids.visual_token_start + 64 for t in block) == rows * cols
    # the text condition has the instruction and the header's digits, none of the image's gen ids
    t2i = dev_engine.plan(prompt="make it blue", width=96, height=64, seed=1)
    assert plan.text_positions == t2i.text_positions + len("5*7")
    mask = text_condition_mask(plan.prompt_ids, loaded.config, len(plan.prompt_ids) - 10)
    assert not any(plan.prompt_ids[i] >= loaded.config.gen_vocab_start_index for i in mask.nonzero().flatten().tolist())
    assert plan.image_positions == t2i.image_positions  # the prompt tail's rows and the grid, as text to image
    # AR guidance's unconditional row (decoding.stream.UnconditionalRow) keeps the last 10 prompt tokens: the
    # generation header alone, as for text to image: no image, no instruction
    assert plan.prompt_ids[-10:] == t2i.prompt_ids[-10:] and ids.image_end not in plan.prompt_ids[-10:]


def test_the_edit_prompt_template_and_its_placeholders():
    text = build_edit_prompt("swap colours", Grid(4, 3), images=2)
    assert text.count(GEN_PLACEHOLDER) == 2 and text.index(GEN_PLACEHOLDER) < text.index("swap colours")
    with pytest.raises(ValueError):
        build_edit_prompt("x", Grid(4, 3), images=0)


def test_an_edit_renders_with_its_references_in_the_header(dev_engine):
    plan = dev_engine.plan(prompt="make it blue", images=[png(64, 64), png(48, 80)], n=2, seed=3)
    assert (plan.width, plan.height) == (48, 80) == reference_output_size(48, 80)
    job = dev_engine.submit(plan)
    got = wait_done(job)
    assert isinstance(got[-1], events.JobDone)
    sessions = [s for s in dev_engine.renderer.sessions if s.header.request_id == plan.request_id]
    assert len(sessions) == 2
    for session in sessions:
        assert session.header.references == (png(64, 64), png(48, 80))
        assert session.header.to_proto().reference_images == 2
        assert (session.header.width, session.header.height) == (48, 80)


def test_an_asked_size_resizes_the_last_reference(dev_engine):
    plan = dev_engine.plan(prompt="bigger", images=[png(64, 48)], width=96, height=64)
    assert (plan.width, plan.height) == (96, 64)
    assert Image.open(io.BytesIO(plan.references[-1])).size == (96, 64)
    with pytest.raises(RequestRejected, match="multiples of 16"):
        dev_engine.plan(prompt="x", images=[png(64, 48)], width=1024, height=1040)


@pytest.mark.parametrize(("images", "words"), [
    ([b"not an image"], "not a readable"),
    ([png(64, 64)] * 6, "at most 5 input images"),
    ([png(64, 64, (1, 2, 3)) + bytes(200_001)], "at most 200000"),
    ([png(1200, 1000)], "at most 1000000"),
    ([png(4100, 20)], "aspect ratio"),
    ([png(64, 64), png(2100, 20)], "gives the output its size"),
])
def test_edit_refusals_name_the_problem(dev_engine, images, words):
    with pytest.raises(RequestRejected, match=words) as caught:
        dev_engine.plan(prompt="edit", images=images)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.param == "image"


def test_a_preview_model_refuses_edits(tiny_ar, tiny_root):
    checkpoint = open_checkpoint(tiny_root)
    engine = AREngine(tiny_ar, checkpoint, FAMILIES[checkpoint.family], FakeRenderer())
    try:
        with pytest.raises(RequestRejected, match="does not edit images.*preview") as caught:
            engine.plan(prompt="edit", images=[png(64, 64)])
        assert caught.value.param == "model" and caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        engine.close()


def test_a_dev_checkpoint_without_mammothtok_refuses_edits(tmp_path, dev_root):
    root = write_ar_only_root(tmp_path / "no-tok", dev=True, weights=False)
    tensors = {name: tensor for name, tensor in open_checkpoint(dev_root).load_tensors("", "cpu").items()
               if not name.startswith("gen_tokenizer.")}
    save_tensors(root, tensors)
    loaded = load_ar(root)
    assert loaded.mammothtok is None and "holds no gen_tokenizer.image_tokenizer.*" in loaded.edit_refusal


def test_read_edit_input_puts_pieces_together_and_refuses_disorder():
    request = ar_pb2.GenerateImageRequest(prompt="x")
    first, second = b"a" * 10, b"b" * 7
    messages = [ar_pb2.EditImageInput(request=request),
                *(ar_pb2.EditImageInput(image=piece) for piece in reference_pieces((first, second), chunk=4))]
    got, images = read_edit_input(iter(messages), EditLimits())
    assert got.prompt == "x" and images == [first, second]
    chunk = common_pb2.ImageChunk
    bad = {
        "first message must be the request": [ar_pb2.EditImageInput(image=chunk(index=0, data=b"x", last=True))],
        "in order": [ar_pb2.EditImageInput(request=request), ar_pb2.EditImageInput(image=chunk(index=1, data=b"x"))],
        "without its last piece": [ar_pb2.EditImageInput(request=request),
                                   ar_pb2.EditImageInput(image=chunk(index=0, data=b"x"))],
        "at least one input image": [ar_pb2.EditImageInput(request=request)],
        "over 5 bytes": [ar_pb2.EditImageInput(request=request),
                         ar_pb2.EditImageInput(image=chunk(index=0, data=b"123456", last=True))],
    }
    for words, stream in bad.items():
        with pytest.raises(RequestRejected, match=words):
            read_edit_input(iter(stream), EditLimits(max_image_bytes=5))


def test_reference_pieces_stay_under_the_chunk_and_the_header_counts_them():
    pieces = reference_pieces((b"x" * 10, b""), chunk=4)
    assert [(p.index, len(p.data), p.last) for p in pieces] == [(0, 4, False), (0, 4, False), (0, 2, True), (1, 0, True)]
    header = RenderHeader(request_id="r", index=0, width=0, height=0, seed=1, output_format="png",
                          output_compression=None, knobs={}, hidden_size=8, dtype="float32", text_positions=1,
                          image_positions=1, negative_positions=0, references=(b"a", b"b"))
    assert header.to_proto().reference_images == 2


def test_make_tiny_dev_is_deterministic_with_its_mammothtok(tmp_path):
    from tools.make_tiny import make_tiny_dev

    digests = []
    for name in ("a", "b"):
        make_tiny_dev(tmp_path / name)
        files = sorted(p for p in (tmp_path / name).iterdir() if p.suffix in (".safetensors", ".json"))
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    assert digests[0] == digests[1]
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["gen_tokenizer_config"] == TINY_GEN_TOKENIZER_CONFIG


@pytest.mark.parametrize(("width", "height"), [(1024, 1024), (1000, 700), (333, 2047), (3000, 1999), (48, 80)])
def test_the_output_size_the_ar_announces_is_the_one_the_dit_renders(width, height):
    """The AR states an edit's size before the DiT sees the input; both read it from servicekit.released_images."""
    from PIL import Image

    from dit_service.references import preprocess_image

    pixels = preprocess_image(Image.new("RGB", (width, height), (10, 20, 30)))
    assert reference_output_size(width, height) == (pixels.shape[2], pixels.shape[1])


def test_a_1024_input_is_tokenised_at_the_released_73x73_by_default(dev_root):
    """The released resize of a 1024x1024 input gives 73x73 codes (1022x1022 pixels); the default edit_image_positions
    holds them all, and a smaller setting scales the input down to fit."""
    checkpoint = open_checkpoint(dev_root)
    picture = png(1024, 1024)
    for limits, grid in ((EditLimits(), (73, 73)), (EditLimits(image_positions=4096), (60, 60))):
        engine = AREngine(load_ar(dev_root), checkpoint, FAMILIES[checkpoint.family], FakeRenderer(), edit_limits=limits)
        try:
            plan = engine.plan(prompt="make it blue", images=[picture], width=64, height=64, seed=1)
        finally:
            engine.close()
        ((_, _, rows, cols),) = plan.reference_grids
        assert (rows, cols) == grid
