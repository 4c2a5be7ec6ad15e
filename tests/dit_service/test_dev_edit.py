"""Image editing on the DiT side (MammothModa2-Dev): reference images in the Render stream, their preprocessing and
VAE encoding, the DiT's reference path and three-way guidance.

Checked against plain readings of the released code (bytedance/mammothmoda main, ``mamoda2/mammothmoda2/``):
``utils/vision_processor.py`` 55-81, 84-91, 504-522 (smart_resize, to_rgb, extract_ref_image), ``utils/vae_processor.py``
82-146 (the VAE processor's size), ``model/mammothmoda2_dit/rope_real.py`` 217-258 (position ids),
``diffusion_transformer.py`` 416-502, 504-584, 685-761 (the reference path, the joint sequence, the prediction slice),
``utils/t2i_utils.py`` 187-273, 337-346 (guidance, output size).
"""

from __future__ import annotations

import io
import math
import struct
import zlib

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from dit_service.engine import DiTEngine
from dit_service.model.cuda_graphs import GraphedTransformer
from dit_service.model.pipeline import DiTPipeline, reference_seed
from dit_service.model.sampler import start_entry, step_entries
from dit_service.model.transformer import rope_tables
from dit_service.references import load_reference, preprocess_image
from dit_service.server import build_server
from protos import common_pb2, dit_pb2
from protos.codec import encode_tensor
from protos.knobs import FAMILIES
from protos.status import RequestRejected, param_of
from protos.values import knobs_to_proto
from servicekit.checkpoint import open_checkpoint
from servicekit.released_images import reference_fetch_size, vae_size
from tests.dit_service import test_engine_batching as engine_batching
from tests.dit_service.conftest import DEV_CONDITION_DIM

LLM = DEV_CONDITION_DIM
KNOBS = FAMILIES["mammothmoda2"]


def _rows(n, seed, width=LLM):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


TEXT, IMAGE, NEGATIVE = _rows(5, 11), _rows(9, 12), _rows(4, 13)


def picture(width, height, seed=0, mode="RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = (np.random.default_rng(seed).random((height, width, channels)) * 255).astype(np.uint8)
    return Image.fromarray(pixels, mode)


def file_bytes(image: Image.Image, fmt="PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


# -- preprocessing -------------------------------------------------------------------------------------------------

def plain_smart_resize(height, width, factor=16, min_pixels=4 * 16 * 16, max_pixels=1024 * 1024):
    """vision_processor.py 55-81 as written."""
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def plain_vae_size(height, width, scale=16, max_side=2048, max_pixels=1024 * 1024):
    """vae_processor.py 128-146 as written."""
    side_ratio = max_side / height if height > width else max_side / width
    ratio = min((max_pixels / (height * width)) ** 0.5, side_ratio, 1.0)
    return int(height * ratio) // scale * scale, int(width * ratio) // scale * scale


@pytest.mark.parametrize("size", [(50, 70), (2, 300), (8, 8), (1024, 1024), (1080, 1920), (3000, 4000), (17, 2900),
                                  (2048, 100), (33, 33)])
def test_sizes_follow_the_released_rules(size):
    h, w = size
    assert reference_fetch_size(h, w) == plain_smart_resize(h, w)
    sh, sw = reference_fetch_size(h, w)
    assert vae_size(sh, sw) == plain_vae_size(sh, sw)
    assert sh % 16 == 0 and sw % 16 == 0 and sh * sw <= 1024 * 1024


def test_preprocessing_is_fetch_image_then_the_vae_processor():
    image = picture(70, 50, seed=1)
    got = load_reference(file_bytes(image), 0)
    h, w = plain_smart_resize(50, 70)
    expected = image.resize((w, h), Image.Resampling.BICUBIC)  # already a VAE-size multiple: the Lanczos step copies
    assert plain_vae_size(h, w) == (h, w)
    want = torch.from_numpy(np.asarray(expected, dtype=np.float32) / 255.0).permute(2, 0, 1) * 2 - 1
    assert got.shape == (3, 48, 64) and torch.equal(got, want)
    assert got.min() >= -1 and got.max() <= 1


def test_rgba_is_composited_on_white():
    image = picture(32, 32, mode="RGBA")
    image.putalpha(0)  # fully transparent: white
    got = preprocess_image(image)
    assert torch.equal(got, torch.ones(3, 32, 32))


def test_jpeg_and_webp_are_accepted():
    for fmt in ("JPEG", "WEBP"):
        assert load_reference(file_bytes(picture(40, 56), fmt), 0).shape == (3, *plain_smart_resize(56, 40))


# -- the VAE posterior draw ------------------------------------------------------------------------------------------

def test_reference_latents_are_a_seeded_posterior_draw(dev_pipeline):
    ref = load_reference(file_bytes(picture(64, 48)), 0)
    posteriors = dev_pipeline.encode_references([ref])
    mean, std = posteriors[0]
    a, b, c = (dev_pipeline.sample_references(posteriors, seed) for seed in (3, 3, 4))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    config = dev_pipeline.vae.config
    noise = torch.randn(mean.shape, generator=torch.Generator().manual_seed(reference_seed(3, 0)))
    expected = (mean + std * noise - config["shift_factor"]) * config["scaling_factor"]
    assert torch.equal(a[0], expected) and a[0].shape == (16, 6, 8)
    assert reference_seed(3, 0) not in (3, reference_seed(3, 1), reference_seed(4, 0))


# -- RoPE ids and the reference path against plain readings ------------------------------------------------------------

def plain_position_ids(cap_len, ref_sizes, img_size):
    """rope_real.py 217-258 for one sample: ref_sizes / img_size are token grids (H // p, W // p)."""
    ids = [(k, k, k) for k in range(cap_len)]
    pe_shift = cap_len
    for ht, wt in ref_sizes:
        ids += [(pe_shift, r, c) for r in range(ht) for c in range(wt)]
        pe_shift += max(ht, wt)
    ht, wt = img_size
    ids += [(pe_shift, r, c) for r in range(ht) for c in range(wt)]
    return torch.tensor(ids)


@pytest.mark.parametrize("ref_sizes", [[(3, 4)], [(3, 4), (5, 2)]])
def test_reference_rope_ids_are_the_released_ones(dev_pipeline, ref_sizes):
    dit = dev_pipeline.transformer
    positions, target = dit.reference_positions(7, ref_sizes)
    plain = plain_position_ids(7, ref_sizes, (4, 4))
    n_refs = sum(h * w for h, w in ref_sizes)
    assert torch.equal(torch.cat(positions), plain[7 : 7 + n_refs])
    assert (plain[7 + n_refs :, 0] == target).all()
    assert target == 7 + sum(max(h, w) for h, w in ref_sizes)


def patchify(latent, p=2):
    """'c (h p1) (w p2) -> (h w) (p1 p2 c)' written out."""
    c, h, w = latent.shape
    return torch.stack([latent[:, i * p : (i + 1) * p, j * p : (j + 1) * p].permute(1, 2, 0).reshape(-1)
                        for i in range(h // p) for j in range(w // p)])


def unpatchify(tokens, h, w, c=16, p=2):
    out = torch.zeros(c, h, w)
    k = 0
    for i in range(h // p):
        for j in range(w // p):
            out[:, i * p : (i + 1) * p, j * p : (j + 1) * p] = tokens[k].reshape(p, p, c).permute(2, 0, 1)
            k += 1
    return out


def plain_forward(dit, latent, t, context, refs):
    """Transformer2DModel.forward for one sample with references (diffusion_transformer.py 416-502, 504-584,
    685-761): context refiner; each reference patch-embedded, + image_index_embedding[j], through ref_image_refiner
    with its RoPE; noise refiner; the joint sequence [context | refs | target]; norm_out; the last img_len tokens."""
    p = dit.patch_size
    cap_len = context.shape[0]
    temb = dit.time_caption_embed.timestep_embedding(t.reshape(1), torch.float32)
    ref_grids = [(r.shape[1] // p, r.shape[2] // p) for r in refs]
    h, w = latent.shape[-2:]
    ids = plain_position_ids(cap_len, ref_grids, (h // p, w // p))
    cos, sin = rope_tables(ids[None], dit.axes_dim_rope)
    ctx = context[None]
    for layer in dit.context_refiner:
        ctx = layer(ctx, cos[:, :cap_len], sin[:, :cap_len], None)
    start, ref_tokens = cap_len, []
    for j, ref in enumerate(refs):
        n = ref_grids[j][0] * ref_grids[j][1]
        tok = (dit.ref_image_patch_embedder(patchify(ref)) + dit.image_index_embedding[j])[None]
        for layer in dit.ref_image_refiner:
            tok = layer(tok, cos[:, start : start + n], sin[:, start : start + n], None, temb)
        ref_tokens.append(tok)
        start += n
    img = dit.x_embedder(patchify(latent[0]))[None]
    for layer in dit.noise_refiner:
        img = layer(img, cos[:, start:], sin[:, start:], None, temb)
    x = torch.cat([ctx, *ref_tokens, img], dim=1)
    for layer in dit.layers:
        x = layer(x, cos, sin, None, temb)
    x = dit.norm_out(x, temb)
    n_img = (h // p) * (w // p)
    return unpatchify(x[0, -n_img:], h, w)[None]


@pytest.fixture(scope="module")
def branch_contexts(dev_pipeline):
    return dev_pipeline.branch_conditions(TEXT, IMAGE, NEGATIVE)


@pytest.mark.parametrize("ref_shapes", [[(6, 8)], [(6, 8), (4, 10)]])
def test_the_reference_forward_is_the_released_one(dev_pipeline, branch_contexts, ref_shapes):
    dit = dev_pipeline.transformer
    g = torch.Generator().manual_seed(5)
    refs = [torch.randn(16, h, w, generator=g) for h, w in ref_shapes]
    latent, t = torch.randn(1, 16, 6, 6, generator=g), torch.tensor([0.4])
    cond, uncond = branch_contexts
    with torch.no_grad():
        for context in (cond, uncond):  # the cond branch (Q-Former tokens in cap_len) and the ref branch
            got = dit(latent, t, context[None], [context.shape[0]], references=[refs])
            want = plain_forward(dit, latent, t, context, refs)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        without = dit(latent, t, cond[None], [cond.shape[0]])
    assert not torch.allclose(got, without, atol=1e-3)


def padded_rows(contexts: list[torch.Tensor], seed: int, times: list[float]):
    """Inputs of a batched forward: a reference latent, latents and times per row, the contexts padded to the
    longest, and their lengths."""
    g = torch.Generator().manual_seed(seed)
    refs = [torch.randn(16, 6, 8, generator=g)]
    x = torch.randn(len(contexts), 16, 6, 6, generator=g)
    batch = torch.zeros(len(contexts), max(c.shape[0] for c in contexts), contexts[0].shape[1])
    for i, context in enumerate(contexts):
        batch[i, : context.shape[0]] = context
    return refs, x, torch.tensor(times), batch, [c.shape[0] for c in contexts]


def test_rows_of_one_layout_equal_the_same_rows_among_other_layouts(dev_pipeline, branch_contexts):
    """Two edit rows with the same context length and references (one concatenation builds their sequence) give the
    same velocities as beside a row of another layout (each sequence then built on its own)."""
    cond, uncond = branch_contexts
    refs, x, t, batch, lengths = padded_rows([cond, cond, uncond], 7, [0.3, 0.6, 0.8])
    with torch.no_grad():
        same = dev_pipeline.transformer(x[:2], t[:2], batch[:2], lengths[:2], references=[refs, refs])
        among = dev_pipeline.transformer(x, t, batch, lengths, references=[refs, refs, None])
    assert torch.equal(same, among[:2])


def test_a_row_with_references_is_the_same_alone_and_beside_others(dev_pipeline, branch_contexts):
    dit = dev_pipeline.transformer
    cond, uncond = branch_contexts
    refs, x, t, batch, lengths = padded_rows([cond, uncond, uncond], 6, [0.2, 0.5, 0.9])
    with torch.no_grad():
        together = dit(x, t, batch, lengths, references=[refs, refs, None])
        for i, r in enumerate([refs, refs, None]):
            alone = dit(x[i : i + 1], t[i : i + 1], batch[i : i + 1, : lengths[i]], [lengths[i]],
                        references=None if r is None else [r])
            assert torch.equal(together[i : i + 1], alone)


# -- three-way guidance ------------------------------------------------------------------------------------------------

class BranchModel:
    """A transformer double whose velocity tells the branch: cond (the conditional context, references), ref (the
    unconditional context, references), uncond (the unconditional context, none)."""

    def __init__(self, cond_len):
        self.cond_len = cond_len
        self.calls = []

    def value(self, length, refs):
        if length == self.cond_len:
            assert refs is not None  # the cond branch always carries the references
            return 3.0
        return 1.0 if refs is not None else -2.0

    def __call__(self, latents, timestep, condition, lengths, references=None):
        refs = references or [None] * latents.shape[0]
        self.calls.append([(n, r is not None) for n, r in zip(lengths, refs, strict=True)])
        return torch.stack([torch.full(latents.shape[1:], self.value(n, r)) for n, r in zip(lengths, refs, strict=True)])


@pytest.mark.parametrize("tg, ig, expected", [
    (4.0, 2.0, -2.0 + 2.0 * (1.0 + 2.0) + 4.0 * (3.0 - 1.0)),  # uncond + ig (ref - uncond) + tg (cond - ref)
    (4.0, 1.0, -2.0 + 4.0 * (3.0 + 2.0)),  # uncond (no references) + tg (cond - uncond)
    (1.0, 3.0, 3.0),  # cond alone, also when ig > 1
    (0.5, 0.5, 3.0),
])
@pytest.mark.parametrize("separate", [False, True])
def test_three_way_guidance_is_the_released_formula(tg, ig, expected, separate):
    cond, uncond = torch.zeros(6, 4), torch.zeros(3, 4)
    refs = [torch.zeros(16, 4, 4)]
    model = BranchModel(cond_len=6)
    entry = start_entry(cond, uncond, (16, 4, 4), seed=1, steps=2, guidance=tg, references=refs, image_guidance=ig)
    before = entry.latents.clone()
    step_entries(model, [entry], separate=separate)
    dt = float(entry.t[1] - entry.t[0])
    torch.testing.assert_close(entry.latents, before + dt * expected)
    branches = 3 if tg > 1 and ig > 1 else 2 if tg > 1 else 1
    assert entry.rows == branches and sum(len(c) for c in model.calls) == branches
    rows = [row for call in model.calls for row in call]
    assert rows == [(6, True), (3, True), (3, False)][:branches] if branches != 2 else rows == [(6, True), (3, False)]


def test_without_references_the_image_scale_is_one():
    entry = start_entry(torch.zeros(6, 4), torch.zeros(3, 4), (16, 4, 4), seed=1, steps=2, guidance=4.0,
                        image_guidance=5.0)
    assert entry.image_guidance == 1.0 and entry.branches() == 2


def test_cfg_range_switches_both_scales():
    refs = [torch.zeros(16, 4, 4)]
    entry = start_entry(torch.zeros(6, 4), torch.zeros(3, 4), (16, 4, 4), seed=1, steps=4, guidance=4.0,
                        cfg_range=(0.0, 0.5), references=refs, image_guidance=2.0)
    seen = []
    while not entry.done:
        seen.append(entry.branches())
        step_entries(BranchModel(6), [entry])
    assert seen == [3, 3, 3, 1]
    late = start_entry(torch.zeros(6, 4), torch.zeros(3, 4), (16, 4, 4), seed=1, steps=4, guidance=4.0,
                       cfg_range=(0.5, 1.0), references=refs, image_guidance=2.0, cfg_range_policy="off_after_first_exit")
    assert late.branches() == 1


# -- through Render ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(dev_pipeline):
    engine = DiTEngine(dev_pipeline, KNOBS, max_condition_positions=4096, max_batch_size=4, max_chunk_bytes=64 * 1024)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def channel(engine):
    running = build_server("127.0.0.1", 0, max_workers=8, engine=engine)
    running.server.start()
    running.set_serving(True)
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield channel
    running.server.stop(0)


def header(references=0, **overrides):
    fields = dict(request_id="edit", width=0 if references else 64, height=0 if references else 64, n=1, seed=7,
                  hidden_size=LLM, dtype="float32", text_positions=TEXT.shape[0], image_positions=IMAGE.shape[0],
                  negative_positions=NEGATIVE.shape[0], reference_images=references,
                  knobs=knobs_to_proto({"num_inference_steps": 2, "text_guidance_scale": 4.0}))
    fields.update(overrides)
    return dit_pb2.RenderInput(header=dit_pb2.RenderHeader(**fields))


def condition_messages():
    kinds = ((dit_pb2.CONDITION_KIND_TEXT, TEXT), (dit_pb2.CONDITION_KIND_IMAGE, IMAGE),
             (dit_pb2.CONDITION_KIND_NEGATIVE, NEGATIVE))
    return [dit_pb2.RenderInput(chunk=dit_pb2.ConditionChunk(kind=k, offset=0, hidden_states=encode_tensor(t)))
            for k, t in kinds]


def reference_messages(data: bytes, index: int, piece: int = 1000, last: bool = True):
    pieces = [data[i : i + piece] for i in range(0, len(data), piece)] or [b""]
    return [dit_pb2.RenderInput(reference=common_pb2.ImageChunk(index=index, data=chunk,
                                                                last=last and k == len(pieces) - 1))
            for k, chunk in enumerate(pieces)]


END = dit_pb2.RenderInput(end=dit_pb2.RenderEnd())


def render(channel, messages):
    """(images by index, summary) of a Render; raises grpc.RpcError."""
    images, summary = {}, None
    for event in channel.stream_stream("/ardit.v1.Renderer/Render", request_serializer=dit_pb2.RenderInput.SerializeToString,
                                       response_deserializer=dit_pb2.RenderEvent.FromString)(iter(messages), timeout=120):
        if event.WhichOneof("event") == "image":
            images[event.image.index] = event.image
        elif event.WhichOneof("event") == "completed":
            summary = event.completed
    return images, summary


def edit_messages(files, **overrides):
    messages = [header(len(files), **overrides), *condition_messages()]
    for i, data in enumerate(files):
        messages += reference_messages(data, i)
    return [*messages, END]


REFERENCE = file_bytes(picture(70, 50, seed=2))  # 48x64 after preprocessing
OTHER = file_bytes(picture(40, 90, seed=3))


def test_an_edit_renders_at_the_last_references_size(channel):
    images, summary = render(channel, edit_messages([REFERENCE]))
    image = images[0]
    assert (image.width, image.height) == (64, 48)
    assert Image.open(io.BytesIO(image.data)).size == (64, 48)
    assert summary.knobs["image_guidance_scale"].number_value == 2.0  # the released default
    again, _ = render(channel, edit_messages([REFERENCE]))
    assert again[0].data == image.data  # the same seed, the same bytes
    two, _ = render(channel, edit_messages([OTHER, REFERENCE], width=512, height=512))  # header size ignored
    assert (two[0].width, two[0].height) == (64, 48) and two[0].data != image.data
    last_other, _ = render(channel, edit_messages([REFERENCE, OTHER]))
    h, w = load_reference(OTHER, 0).shape[-2:]
    assert (last_other[0].width, last_other[0].height) == (w, h)


def test_references_change_the_picture(channel):
    edited, _ = render(channel, edit_messages([REFERENCE]))
    plain, _ = render(channel, [header(width=64, height=48), *condition_messages(), END])
    assert edited[0].data != plain[0].data
    other_seed, _ = render(channel, edit_messages([REFERENCE], seed=8))
    assert other_seed[0].data != edited[0].data


def test_image_guidance_has_no_effect_without_references(channel):
    knobs = {"num_inference_steps": 2, "text_guidance_scale": 4.0}
    a, _ = render(channel, [header(width=64, height=48, knobs=knobs_to_proto(knobs)), *condition_messages(), END])
    b, _ = render(channel, [header(width=64, height=48, knobs=knobs_to_proto(knobs | {"image_guidance_scale": 7.0})),
                            *condition_messages(), END])
    assert a[0].data == b[0].data
    c, _ = render(channel, edit_messages([REFERENCE], knobs=knobs_to_proto(knobs | {"image_guidance_scale": 7.0})))
    d, _ = render(channel, edit_messages([REFERENCE], knobs=knobs_to_proto(knobs)))
    assert c[0].data != d[0].data


def _png_with_size(width, height) -> bytes:
    """A PNG whose IHDR declares width x height (its CRC fixed), the rest of a 1x1 file."""
    data = bytearray(file_bytes(picture(1, 1)))
    ihdr = data[12:29]  # b"IHDR" + 13 bytes
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def _refused(channel, messages):
    with pytest.raises(grpc.RpcError) as caught:
        render(channel, messages)
    return caught.value.code(), param_of(caught.value), caught.value.details()


@pytest.mark.parametrize("case, param, words", [
    ("not an image", "reference", "reference image 0: the bytes are not a PNG, JPEG or WebP image"),
    ("truncated", "reference", "reference image 0: the file does not decode"),
    ("0x0", "reference", "reference image 0"),
    ("gif", "reference", "format GIF is not accepted"),
    ("too wide", "reference", "aspect ratio"),
    ("count mismatch", "reference_images", "reference image 1 never arrived"),
    ("incomplete", "reference_images", "reference image 0 is incomplete"),
    ("more than five", "reference_images", "at most 5"),
    ("index out of range", "reference.index", "index 3 is out of range"),
    ("after last", "reference.index", "after its last one"),
    ("undeclared", "reference_images", "the header declares reference_images 0"),
])
def test_bad_references_are_invalid_arguments(channel, case, param, words):
    gif = io.BytesIO()
    picture(8, 8).save(gif, "GIF")
    messages = {
        "not an image": edit_messages([b"hello, not an image"]),
        "truncated": edit_messages([REFERENCE[: len(REFERENCE) // 2]]),
        "0x0": edit_messages([_png_with_size(0, 0)]),
        "gif": edit_messages([gif.getvalue()]),
        "too wide": edit_messages([file_bytes(picture(1000, 2))]),
        "count mismatch": [header(2), *condition_messages(), *reference_messages(REFERENCE, 0), END],
        "incomplete": [header(1), *condition_messages(), *reference_messages(REFERENCE, 0, last=False), END],
        "more than five": edit_messages([REFERENCE] * 6),
        "index out of range": [header(2), *condition_messages(), *reference_messages(REFERENCE, 3), END],
        "after last": [header(1), *condition_messages(), *reference_messages(REFERENCE, 0),
                       *reference_messages(REFERENCE, 0), END],
        "undeclared": [header(0), *condition_messages(), *reference_messages(REFERENCE, 0), END],
    }[case]
    code, blamed, details = _refused(channel, messages)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert blamed == param and words in details, details


def one_reference_plan(engine: DiTEngine, hidden_size: int = LLM):
    """A Render header's plan for an edit with one reference image, its size left to the reference."""
    return engine.plan(request_id="r", width=0, height=0, n=1, seed=1, output_format="png", output_compression=None,
                       knobs={}, hidden_size=hidden_size, dtype="float32", text_positions=5, image_positions=9,
                       negative_positions=4, reference_images=1)


def test_a_reference_over_the_byte_limit_is_refused(dev_pipeline):
    engine = DiTEngine(dev_pipeline, KNOBS, max_condition_positions=4096, max_reference_bytes=1000)
    try:
        assembler = engine.assembler(one_reference_plan(engine))
        assembler.add_reference_piece(0, b"x" * 600, False)
        with pytest.raises(RequestRejected, match="over the 1000-byte limit") as caught:
            assembler.add_reference_piece(0, b"x" * 600, True)
        assert caught.value.param == "reference.data"
    finally:
        engine.close()


def test_a_reference_larger_than_the_service_allows_is_refused(dev_pipeline):
    engine = DiTEngine(dev_pipeline, KNOBS, max_condition_positions=4096, max_side=32)
    try:
        assembler = engine.assembler(one_reference_plan(engine))
        assembler.add_reference_piece(0, REFERENCE, True)
        with pytest.raises(RequestRejected, match="width must be at most 32") as caught:
            assembler.complete_references()
        assert caught.value.param == "reference"
    finally:
        engine.close()


def test_a_preview_dit_refuses_references(pipeline):
    engine = DiTEngine(pipeline, KNOBS, max_condition_positions=4096)
    try:
        with pytest.raises(RequestRejected, match="takes no reference images") as caught:
            one_reference_plan(engine, hidden_size=64)
        assert caught.value.param == "reference_images"
    finally:
        engine.close()


# -- the speed modes -------------------------------------------------------------------------------------------------

def _engine_images(engine, renders):
    """Submits (seed, n, references or None, text rows) renders at once; returns each one's images by index."""
    jobs = []
    for seed, n, files, text in renders:
        refs = None if files is None else [load_reference(f, i) for i, f in enumerate(files)]
        plan = engine.plan(request_id=f"r{seed}", width=0 if refs else 64, height=0 if refs else 48, n=n, seed=seed,
                           output_format="png", output_compression=None,
                           knobs={"num_inference_steps": 3, "text_guidance_scale": 4.0}, hidden_size=LLM,
                           dtype="float32", text_positions=text.shape[0], image_positions=IMAGE.shape[0],
                           negative_positions=NEGATIVE.shape[0], reference_images=0 if refs is None else len(refs))
        if refs is not None:
            plan.width, plan.height = refs[-1].shape[2], refs[-1].shape[1]
        jobs.append(engine.submit(plan, torch.cat([text, IMAGE]), NEGATIVE, references=refs))
    results = []
    for job in jobs:
        results.append(engine_batching.collect(job, timeout=120)[0])
    return results


def test_an_edit_batched_with_text_to_image_equals_it_alone(dev_pipeline):
    renders = [(1, 2, [OTHER, REFERENCE], TEXT), (5, 1, None, _rows(7, 21))]
    batched = DiTEngine(dev_pipeline, KNOBS, max_condition_positions=4096, max_batch_size=4)
    alone = DiTEngine(dev_pipeline, KNOBS, max_condition_positions=4096, deterministic=True)
    try:
        together = _engine_images(batched, renders)
        assert batched.status()["largest_batch"] == 3
        assert together == [_engine_images(alone, [r])[0] for r in renders]
        assert together[0][0] != together[0][1]  # seed + i: its own noise and its own reference draw
    finally:
        batched.close()
        alone.close()


def test_step_caching_works_for_edits(dev_pipeline, branch_contexts):
    ref = load_reference(REFERENCE, 0)
    posteriors = dev_pipeline.encode_references([ref])

    def run(cache, others=()):
        entry = dev_pipeline.start_prepared_entry(branch_contexts, 64, 48, seed=2, steps=8, guidance=4.0,
                                                  cache_threshold=cache, image_guidance=2.0,
                                                  references=dev_pipeline.sample_references(posteriors, 2))
        mates = [dev_pipeline.start_prepared_entry(branch_contexts, 64, 48, seed=9, steps=8, guidance=4.0,
                                                   cache_threshold=cache) for _ in others]
        while not entry.done:
            dev_pipeline.step([entry, *[m for m in mates if not m.done]])
        return entry

    exact, cached, batched = run(0.0), run(0.5), run(0.5, others=[1])
    assert cached.skipped_steps > 0 and exact.skipped_steps == 0
    assert torch.equal(cached.latents, batched.latents) and cached.skipped_steps == batched.skipped_steps
    assert exact.rows == 8 * 3


def test_fp8_covers_the_reference_refiner_and_edits_render(dev_root, dev_pipeline, branch_contexts):
    fp8 = DiTPipeline.from_checkpoint(open_checkpoint(dev_root))
    fp8.quantize("fp8")
    from servicekit.fp8 import FP8Linear

    assert any(isinstance(m, FP8Linear) for m in fp8.transformer.ref_image_refiner.modules())
    refs = dev_pipeline.sample_references(dev_pipeline.encode_references([load_reference(REFERENCE, 0)]), 1)

    def latents(pipeline):
        entry = pipeline.start_prepared_entry(branch_contexts, 64, 48, seed=1, steps=3, guidance=4.0,
                                              references=refs, image_guidance=2.0)
        while not entry.done:
            pipeline.step([entry])
        return entry.latents

    a, b = latents(fp8), latents(dev_pipeline)
    assert 0 < float((a - b).norm() / b.norm()) < 0.1


def test_graphed_steps_run_edits_eagerly(dev_pipeline, branch_contexts):
    graphed = GraphedTransformer(dev_pipeline.transformer, max_graphs=2)
    cond, _ = branch_contexts
    refs = [torch.randn(16, 6, 8, generator=torch.Generator().manual_seed(0))]
    x, t = torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0.5])
    with torch.no_grad():
        out = graphed(x, t, cond[None], [cond.shape[0]], references=[refs])
        want = dev_pipeline.transformer(x, t, cond[None], [cond.shape[0]], references=[refs])
    assert torch.equal(out, want) and graphed.counts["eager_edit"] == 1



def test_packed_joint_layers_take_the_references(dev_pipeline, branch_contexts):
    """Packing (the CUDA layout: the joint layers over the valid rows back to back) with an edit's three branches in
    one call gives each row what the padded layout gives; here on the CPU, to tolerance."""
    dit = dev_pipeline.transformer
    cond, uncond = branch_contexts
    g = torch.Generator().manual_seed(3)
    refs = [torch.randn(16, 4, 6, generator=g), torch.randn(16, 6, 4, generator=g)]
    x, t = torch.randn(3, 16, 6, 6, generator=g), torch.tensor([0.3, 0.3, 0.3])
    batch = torch.zeros(3, cond.shape[0], cond.shape[1])
    batch[0], batch[1, : uncond.shape[0]], batch[2, : uncond.shape[0]] = cond, uncond, uncond
    lengths = [cond.shape[0], uncond.shape[0], uncond.shape[0]]
    with torch.no_grad():
        padded = dit(x, t, batch, lengths, references=[refs, refs, None])
        dit.pack_samples = True
        try:
            packed = dit(x, t, batch, lengths, references=[refs, refs, None])
        finally:
            dit.pack_samples = False
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
