"""MammothTok (the Dev member's input-image tokenizer) and the input image's preprocessing and prompt ids.

References: bytedance/mammothmoda main, ``mamoda2/mammothmoda2/model/mammothmoda2_visual_tokenizers/`` and
``utils/vision_processor.py``; ``../shared/reference/mammothmoda2-dev.md`` sections 1.8, 3a, 5 and 7. The reference
computations below are written from the formulas, in plain torch, independently of the module under test.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

from ar_service.edit_image import (
    EOF_TOKEN,
    MAX_PIXELS,
    MIN_PIXELS,
    ImagePromptIds,
    image_prompt_text,
    pixels_from_image,
    placeholder_count,
    resize_for_mammothtok,
    smart_resize,
    splice_image_ids,
    to_rgb,
    tokenize_edit_image,
)
from ar_service.model.mammothtok import (
    CHECKPOINT_PREFIX,
    MammothTok,
    MammothTokConfig,
    MammothTokMismatch,
    aimv2_rms_norm,
    init_random_,
    load_mammothtok,
    load_state,
    nearest_codes,
    sincos_positions,
)
from ar_service.model.tiny import tiny_t2i
from ar_service.model.tokenizer import build_tokenizer
from servicekit.checkpoint import open_checkpoint, save_tensors

TINY = {"embed_dim": 32, "num_blocks": 2, "num_heads": 2, "mlp_hidden_dim": 64, "codebook_embed_dim": 4,
        "codebook_size": 64}
EPS = 1e-5


def _tiny(seed: int = 0) -> MammothTok:
    return init_random_(MammothTok.from_config(TINY), seed=seed).eval()


def _pixels(height: int, width: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, height, width, generator=generator) * 2 - 1


# ---- reference reading of the formulas ----------------------------------------------------------------------------

def ref_rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """AIMv2 RMSNorm as written: no upcast, ``x * rsqrt(mean(x^2) + eps)`` then ``* weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def ref_positions(rows: int, cols: int, dim: int) -> torch.Tensor:
    """Row-major grid; first half of the channels from the column index, second half from the row index; each half
    sin(p w_i) for i < dim/4 then cos(p w_i), w_i = 10000^(-i/(dim/4)). Computed in float64, one entry at a time."""
    quarter = dim // 4
    omega = [10000.0 ** (-i / quarter) for i in range(quarter)]
    table = []
    for r in range(rows):
        for c in range(cols):
            entry = [math.sin(c * o) for o in omega] + [math.cos(c * o) for o in omega]
            entry += [math.sin(r * o) for o in omega] + [math.cos(r * o) for o in omega]
            table.append(entry)
    return torch.tensor(table, dtype=torch.float64)


def ref_codes(model: MammothTok, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(quant_conv features (B, e, h, w), codes (B, h, w)) from the weights, without the module's forward."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = model.config
    b, _, height, width = pixels.shape
    p, d, heads = cfg.patch_size, cfg.embed_dim, cfg.num_heads
    rows, cols = height // p, width // p
    # Patch embedding as a matmul over unfolded 14x14 patches (channel, dy, dx order, like the conv weight).
    patches = pixels.reshape(b, 3, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5).reshape(b, rows * cols, 3 * p * p)
    pre = "encoder.preprocessor.patchifier."
    x = patches @ sd[pre + "proj.weight"].reshape(d, -1).T + sd[pre + "proj.bias"]
    x = ref_rms(x, sd[pre + "norm.weight"])
    x = x + ref_positions(rows, cols, d).float()
    for i in range(cfg.num_blocks):
        blk = f"encoder.trunk.blocks.{i}."
        h = ref_rms(x, sd[blk + "norm_1.weight"])
        qkv = h @ sd[blk + "attn.qkv.weight"].T  # (b, n, 3d): [q | k | v], each split into heads
        q, k, v = (qkv[..., j * d:(j + 1) * d].reshape(b, -1, heads, d // heads).transpose(1, 2) for j in range(3))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), dim=-1)  # no mask: bidirectional
        attn = (weights @ v).transpose(1, 2).reshape(b, -1, d)
        x = x + attn @ sd[blk + "attn.proj.weight"].T
        h = ref_rms(x, sd[blk + "norm_2.weight"])
        gate = h @ sd[blk + "mlp.fc1.weight"].T
        x = x + (gate * torch.sigmoid(gate) * (h @ sd[blk + "mlp.fc3.weight"].T)) @ sd[blk + "mlp.fc2.weight"].T
    x = ref_rms(x, sd["encoder.trunk.post_trunk_norm.weight"])
    z = x @ sd["quant_conv.weight"].reshape(cfg.codebook_embed_dim, d).T + sd["quant_conv.bias"]  # (b, n, e)
    features = z.reshape(b, rows, cols, -1).permute(0, 3, 1, 2)
    zn = z / z.norm(dim=-1, keepdim=True)
    book = sd["quantize.embedding.weight"]
    en = book / book.norm(dim=-1, keepdim=True)
    squared = ((zn[:, :, None, :] - en[None, None]) ** 2).sum(-1)  # (b, n, codes)
    return features, squared.argmin(-1).reshape(b, rows, cols)


# ---- encoder and quantiser numerics --------------------------------------------------------------------------------

def test_positions_first_half_is_the_column():
    table = sincos_positions(3, 5, 16)
    assert table.dtype == torch.float32 and table.shape == (15, 16)
    torch.testing.assert_close(table.double(), ref_positions(3, 5, 16), atol=1e-6, rtol=0)
    grid = table.view(3, 5, 16)
    assert torch.equal(grid[0, 2, :8], grid[2, 2, :8])  # same column, other row: first half equal
    assert torch.equal(grid[1, 0, 8:], grid[1, 4, 8:])  # same row, other column: second half equal
    assert not torch.equal(grid[0, 1, :8], grid[1, 0, :8])
    assert torch.all(grid[:, 0, :4] == 0) and torch.all(grid[:, 0, 4:8] == 1)  # column 0: sin 0, cos 0


def test_rms_norm_has_no_upcast_in_float32_and_rounds_once_in_bf16():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=generator) * 3
    weight = 1 + 0.1 * torch.randn(32, generator=generator)
    torch.testing.assert_close(aimv2_rms_norm(x, weight, EPS), ref_rms(x, weight), atol=0, rtol=0)
    xb, wb = x.bfloat16(), weight.bfloat16()
    out = aimv2_rms_norm(xb, wb, EPS)
    assert out.dtype == torch.bfloat16
    # As CUDA autocast runs the released code: pow/rsqrt in float32, one rounding to bf16, then the weight in bf16.
    expected = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + EPS)).bfloat16() * wb
    assert torch.equal(out, expected)


def test_encoder_and_quantiser_match_the_formulas():
    model = _tiny()
    pixels = _pixels(42, 70, batch=2)
    features, codes = ref_codes(model, pixels)
    with torch.no_grad():
        got = model.features(pixels)
    torch.testing.assert_close(got, features, atol=2e-5, rtol=1e-4)
    encoded = model.encode(pixels)
    assert encoded.shape == (2, 3, 5) and encoded.dtype == torch.int64
    assert torch.equal(encoded, codes)
    assert len(encoded.unique()) > 3  # random weights still spread over the codebook


def test_nearest_code_is_the_max_cosine_after_normalising():
    generator = torch.Generator().manual_seed(5)
    z = torch.randn(200, 4, generator=generator) * 7  # scale must not matter
    book = torch.randn(64, 4, generator=generator) * torch.rand(64, 1, generator=generator)  # nor the rows' norms
    cos = (z / z.norm(dim=1, keepdim=True)) @ (book / book.norm(dim=1, keepdim=True)).T
    assert torch.equal(nearest_codes(z, book), cos.argmax(1))
    bf16 = nearest_codes(z, book, released_bf16_distances=True)
    assert bf16.shape == (200,) and ((bf16 >= 0) & (bf16 < 64)).all()
    # Where the bf16 cross term decides differently, it picks a code within bf16 resolution of the best cosine.
    best = cos.max(1).values
    assert torch.all(best - cos.gather(1, bf16[:, None]).squeeze(1) <= 2 * 2**-8)


def test_encode_is_deterministic_and_batch_independent():
    pixels = _pixels(56, 28, batch=3)
    a, b = _tiny(seed=7), _tiny(seed=7)
    first = a.encode(pixels)
    assert torch.equal(first, a.encode(pixels))
    assert torch.equal(first, b.encode(pixels))
    assert torch.equal(first[1:2], a.encode(pixels[1:2]))
    assert not torch.equal(first, _tiny(seed=8).encode(pixels))


def test_bf16_weights_run_in_bf16_and_mostly_agree_with_float32():
    pixels = _pixels(140, 140, batch=2)
    full = _tiny().encode(pixels)
    half = _tiny().to(torch.bfloat16)
    with torch.no_grad():
        assert half.features(pixels).dtype == torch.bfloat16  # float32 pixels are cast to the weights' dtype
    codes = half.encode(pixels)
    assert codes.dtype == torch.int64 and codes.shape == full.shape
    assert (codes == full).float().mean() > 0.9  # rounding moves a few near-ties, not the grid


def test_a_bf16_tokenizer_gives_the_released_bf16_codes_and_a_float32_one_the_exact_nearest():
    """An edit's input is tokenised as the released bf16-autocast run rounds its distances when MammothTok is bf16 (the
    codes the Dev AR learnt from), and with float32 distances when it is float32."""
    ids = ImagePromptIds.from_tokenizer(build_tokenizer(), tiny_t2i())
    generator = torch.Generator().manual_seed(11)
    image = Image.fromarray((torch.rand(140, 140, 3, generator=generator) * 255).to(torch.uint8).numpy())
    for model in (_tiny(), _tiny().to(torch.bfloat16)):
        pixels = pixels_from_image(resize_for_mammothtok(image)).to(model.quant_conv.weight.dtype)
        released = model.encode(pixels, released_bf16_distances=True)[0]
        exact = model.encode(pixels, released_bf16_distances=False)[0]
        assert not torch.equal(released, exact)  # this picture has near-ties, so the choice shows
        expected = released if model.quant_conv.weight.dtype == torch.bfloat16 else exact
        assert torch.equal(tokenize_edit_image(image, model, ids).codes, expected)


def test_encode_refuses_sizes_that_are_not_patch_multiples():
    model = _tiny()
    with pytest.raises(ValueError, match="multiple of the 14-pixel patch"):
        model.encode(_pixels(30, 28))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model.encode(torch.zeros(3, 28, 28))


def test_non_square_image_gives_rows_by_columns():
    model = _tiny()
    ids = ImagePromptIds.from_tokenizer(build_tokenizer(), tiny_t2i())
    image = Image.new("RGB", (75, 40), (10, 200, 30))  # W 75 -> 70, H 40 -> 42
    tokens = tokenize_edit_image(image, model, ids)
    assert (tokens.width, tokens.height) == (70, 42)
    assert tokens.grid == (3, 5) and tokens.codes.shape == (3, 5)
    assert len(tokens.ids) == placeholder_count(3, 5)
    exact = tokenize_edit_image(Image.new("RGB", (70, 42), (10, 200, 30)), model, ids)
    assert torch.equal(exact.codes, tokens.codes)  # a uniform image resizes to the same pixels


# ---- configuration, names, loading ---------------------------------------------------------------------------------

def _released_names(blocks: int) -> set[str]:
    names = {"encoder.preprocessor.patchifier.proj.weight", "encoder.preprocessor.patchifier.proj.bias",
             "encoder.preprocessor.patchifier.norm.weight", "encoder.trunk.post_trunk_norm.weight",
             "quant_conv.weight", "quant_conv.bias", "quantize.embedding.weight"}
    for i in range(blocks):
        names |= {f"encoder.trunk.blocks.{i}.{n}" for n in ("norm_1.weight", "attn.qkv.weight", "attn.proj.weight",
                                                            "norm_2.weight", "mlp.fc1.weight", "mlp.fc2.weight",
                                                            "mlp.fc3.weight")}
    return names


def test_released_sizes_names_and_parameter_count():
    config = MammothTokConfig.from_root_config({"model_type": "mammothmoda2"})  # released config.json: no entry
    assert config == MammothTokConfig()
    with torch.device("meta"):
        model = MammothTok.from_config()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert set(shapes) == _released_names(24)
    assert shapes["encoder.preprocessor.patchifier.proj.weight"] == (1024, 3, 14, 14)
    assert shapes["encoder.trunk.blocks.0.attn.qkv.weight"] == (3072, 1024)
    assert shapes["encoder.trunk.blocks.0.mlp.fc1.weight"] == (2816, 1024)
    assert shapes["encoder.trunk.blocks.0.mlp.fc2.weight"] == (1024, 2816)
    assert shapes["quant_conv.weight"] == (8, 1024, 1, 1)
    assert shapes["quantize.embedding.weight"] == (16384, 8)
    assert model.num_parameters() == config.parameter_count
    assert 309_000_000 < config.parameter_count < 309_100_000
    tiny = MammothTok.from_config(TINY)
    assert set(tiny.state_dict()) == _released_names(2)
    assert tiny.num_parameters() == tiny.config.parameter_count


def test_config_from_root_and_its_refusals():
    config = MammothTokConfig.from_root_config({"gen_tokenizer_config": TINY})
    assert (config.embed_dim, config.num_blocks, config.head_dim, config.codebook_size) == (32, 2, 16, 64)
    assert config.patch_size == 14 and config.norm_eps == 1e-5
    assert MammothTokConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown keys.*'depth'"):
        MammothTokConfig.from_dict({"depth": 2})
    with pytest.raises(ValueError, match="not a multiple of num_heads"):
        MammothTokConfig.from_dict({"embed_dim": 36, "num_heads": 8})
    with pytest.raises(ValueError, match="multiple of 4"):
        MammothTokConfig.from_dict({"embed_dim": 34, "num_heads": 2})
    with pytest.raises(ValueError, match="must be an object"):
        MammothTokConfig.from_root_config({"gen_tokenizer_config": [1]})


def _checkpoint_tensors(model: MammothTok) -> dict[str, torch.Tensor]:
    tensors = {CHECKPOINT_PREFIX + k: v.clone() for k, v in model.state_dict().items()}
    tensors[CHECKPOINT_PREFIX + "post_quant_conv.weight"] = torch.zeros(32, 4, 1, 1)
    tensors[CHECKPOINT_PREFIX + "decoder.conv_in.weight"] = torch.zeros(8, 32, 3, 3)
    tensors[CHECKPOINT_PREFIX + "s2ddecoder.mask_token"] = torch.zeros(1, 1, 32)
    tensors["llm_model.lm_head.weight"] = torch.zeros(4, 4)  # outside the prefix: ignored
    return tensors


def test_load_by_released_names_strict_and_skipping_the_decoder():
    source = _tiny(seed=3)
    tensors = _checkpoint_tensors(source)
    target = MammothTok.from_config(TINY)
    report = load_state(target, tensors, prefix=CHECKPOINT_PREFIX)
    assert report.skipped == ("decoder.conv_in.weight", "post_quant_conv.weight", "s2ddecoder.mask_token")
    assert set(report.loaded) == _released_names(2)
    pixels = _pixels(28, 42)
    assert torch.equal(target.encode(pixels), source.encode(pixels))

    missing = dict(tensors)
    del missing[CHECKPOINT_PREFIX + "encoder.trunk.blocks.1.mlp.fc3.weight"]
    with pytest.raises(MammothTokMismatch, match=r"missing 1: gen_tokenizer\.image_tokenizer\.encoder\.trunk\.blocks\.1\.mlp\.fc3\.weight"):
        load_state(MammothTok.from_config(TINY), missing, prefix=CHECKPOINT_PREFIX)
    extra = dict(tensors)
    extra[CHECKPOINT_PREFIX + "encoder.trunk.blocks.2.norm_1.weight"] = torch.ones(32)
    with pytest.raises(MammothTokMismatch, match=r"unexpected 1: .*blocks\.2\.norm_1\.weight"):
        load_state(MammothTok.from_config(TINY), extra, prefix=CHECKPOINT_PREFIX)
    shaped = dict(tensors)
    shaped[CHECKPOINT_PREFIX + "quantize.embedding.weight"] = torch.zeros(16384, 8)
    with pytest.raises(MammothTokMismatch, match=r"wrong shape 1: .*quantize\.embedding\.weight \(16384, 8\) != \(64, 4\)"):
        load_state(MammothTok.from_config(TINY), shaped, prefix=CHECKPOINT_PREFIX)


def test_load_from_a_checkpoint_directory_reads_only_the_encoder_side(tmp_path):
    source = _tiny(seed=4)
    config = {"model_type": "mammothmoda2", "llm_config": {"model_type": "mammothmoda2_qwen3_vl"},
              "gen_dit_config": {"is_image_embedder": True}, "gen_tokenizer_config": TINY}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_tensors(tmp_path, _checkpoint_tensors(source))
    checkpoint = open_checkpoint(tmp_path)
    read: list[str] = []

    class Spy:  # the checkpoint, recording which prefixes are read
        config = checkpoint.config
        tensor_names = staticmethod(checkpoint.tensor_names)

        @staticmethod
        def load_tensors(prefix, device="cpu", dtype=None):
            read.append(prefix)
            return checkpoint.load_tensors(prefix, device, dtype)

    messages: list[str] = []
    model, report = load_mammothtok(Spy(), log=messages.append)
    assert sorted(read) == [CHECKPOINT_PREFIX + p for p in ("encoder.", "quant_conv.", "quantize.")]
    assert len(report.skipped) == 3 and "not loading 3 tensors" in messages[0]
    pixels = _pixels(42, 42)
    assert torch.equal(model.encode(pixels), source.encode(pixels))

    config["gen_tokenizer_config"] = dict(TINY, num_blocks=3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MammothTokMismatch, match=r"missing 7: .*blocks\.2\."):
        load_mammothtok(open_checkpoint(tmp_path))


# ---- preprocessing -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((1024, 1024), (1022, 1022)),  # the spec's example: a 73 x 73 grid
        ((42, 70), (42, 70)),  # already multiples, above the minimum
        ((40, 75), (42, 70)),  # round to multiples of 14
        ((35, 140), (28, 140)), ((49, 126), (56, 126)),  # Python round: halves go to the even multiple
        ((10, 10), (28, 28)),  # tiny: ceil-scaled up to at least 784 px^2
        ((5, 20), (14, 56)),
        ((3000, 4000), (1540, 2058)),  # huge: floor-scaled under 16384 patches
    ],
)
def test_smart_resize(size, expected):
    assert smart_resize(*size) == expected


def test_smart_resize_bounds_and_refusals():
    for h, w in [(1, 1), (7, 13), (10, 1000), (5000, 5000), (16000, 90), (333, 777)]:
        rh, rw = smart_resize(h, w)
        assert rh % 14 == 0 and rw % 14 == 0
        assert MIN_PIXELS <= rh * rw <= MAX_PIXELS
    # sqrt(3211264) is 1792, but 5000 / (5000 / 1792) lands just under 1792 in floating point, and the released
    # floor takes it down a whole patch: 127 x 127, not 128 x 128.
    assert smart_resize(5000, 5000) == (1778, 1778)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500)
    assert smart_resize(448, 448, factor=16, max_pixels=256 * 256) == (256, 256)


def test_rgba_is_composited_on_white_and_other_modes_converted():
    image = Image.new("RGBA", (3, 1))
    image.putpixel((0, 0), (255, 0, 0, 0))  # transparent red -> white
    image.putpixel((1, 0), (0, 0, 255, 255))  # opaque blue stays
    image.putpixel((2, 0), (0, 0, 0, 128))  # half-transparent black -> mid grey
    rgb = to_rgb(image)
    assert rgb.mode == "RGB"
    assert rgb.getpixel((0, 0)) == (255, 255, 255)
    assert rgb.getpixel((1, 0)) == (0, 0, 255)
    assert all(120 <= v <= 135 for v in rgb.getpixel((2, 0)))
    grey = to_rgb(Image.new("L", (2, 2), 77))
    assert grey.mode == "RGB" and grey.getpixel((1, 1)) == (77, 77, 77)


def test_pixels_are_channels_first_in_minus_one_to_one():
    image = Image.new("RGB", (28, 14), (255, 0, 128))
    image.putpixel((27, 0), (0, 255, 0))
    pixels = pixels_from_image(image)
    assert pixels.shape == (1, 3, 14, 28) and pixels.dtype == torch.float32
    assert pixels[0, 0, 0, 0] == 1 and pixels[0, 1, 0, 0] == -1
    torch.testing.assert_close(pixels[0, 2, 0, 0], torch.tensor(128 / 255 * 2 - 1), atol=1e-7, rtol=0)
    assert pixels[0, 1, 0, 27] == 1 and pixels[0, 0, 0, 27] == -1  # x is the last axis


def test_resize_is_bicubic_to_the_smart_size():
    image = Image.radial_gradient("L").convert("RGBA")  # 256 x 256
    resized = resize_for_mammothtok(image)
    assert resized.size == (252, 252) and resized.mode == "RGB"
    expected = to_rgb(image).resize((252, 252), Image.Resampling.BICUBIC)
    assert resized.tobytes() == expected.tobytes()
    assert resize_for_mammothtok(image, max_pixels=28 * 28 * 4).size == (56, 56)


# ---- prompt ids ----------------------------------------------------------------------------------------------------

def _ids() -> ImagePromptIds:
    return ImagePromptIds.from_tokenizer(build_tokenizer(), tiny_t2i())


def test_prompt_ids_layout_and_count():
    tokenizer, t2i = build_tokenizer(), tiny_t2i()
    ids = _ids()
    assert ids.eol == t2i.eol_token_id == tokenizer.convert_tokens_to_ids("<|endofline|>")
    assert ids.eof == tokenizer.convert_tokens_to_ids(EOF_TOKEN)
    codes = torch.arange(15).view(3, 5) * 4
    out = ids.ids(codes)
    assert len(out) == placeholder_count(3, 5) == 3 * 6 + 5 + 1 + 1
    digits = tokenizer.encode("3*5", add_special_tokens=False)
    assert out[:5] == [tokenizer.convert_tokens_to_ids("<|image start|>"), *digits,
                       tokenizer.convert_tokens_to_ids("<|image token|>")]
    body = out[5:-2]
    for r in range(3):
        row = body[r * 6:(r + 1) * 6]
        assert row[:5] == [t2i.visual_token_start_id + int(c) for c in codes[r]]
        assert row[5] == t2i.eol_token_id
    assert out[-2:] == [ids.eof, tokenizer.convert_tokens_to_ids("<|image end|>")]
    assert tokenizer.convert_ids_to_tokens(out[5]) == "<|visual token 0|>"
    # Two-digit sides: the header grows by a digit each.
    wide = ids.ids(torch.zeros(12, 10, dtype=torch.int64))
    assert len(wide) == placeholder_count(12, 10) == 12 * 11 + 5 + 2 + 2


def test_prompt_text_is_the_released_split_row_form():
    text = image_prompt_text([[1, 2, 3], [4, 5, 16383]])
    assert text == ("<|image start|>2*3<|image token|>"
                    "<|visual token 000001|><|visual token 000002|><|visual token 000003|><|endofline|>"
                    "<|visual token 000004|><|visual token 000005|><|visual token 016383|>"
                    "<|endofline|><|endoffile|><|image end|>")


def test_prompt_ids_refusals():
    ids = _ids()
    with pytest.raises(ValueError, match=r"codes \[64\] lie outside the 64 visual tokens"):
        ids.ids([[0, 64]])
    with pytest.raises(ValueError, match="rectangular"):
        ids.ids([[0, 1], [2]])

    class MergingDigits:
        unk_token_id = None

        def convert_tokens_to_ids(self, token):
            return build_tokenizer().convert_tokens_to_ids(token)

        def encode(self, text, add_special_tokens=True):
            return [1, 2]  # e.g. "12" as one token

    with pytest.raises(ValueError, match="splits the image header '12\\*34' into 2 ids"):
        ImagePromptIds.from_tokenizer(MergingDigits(), tiny_t2i()).ids(torch.zeros(12, 34, dtype=torch.int64))

    class NoEof(MergingDigits):
        def convert_tokens_to_ids(self, token):
            return None if token == EOF_TOKEN else super().convert_tokens_to_ids(token)

    with pytest.raises(ValueError, match="lacks \\['<\\|endoffile\\|>'\\]"):
        ImagePromptIds.from_tokenizer(NoEof(), tiny_t2i())


def test_splice_fills_placeholders_in_order():
    ids = _ids()
    first, second = ids.ids([[1, 2]]), ids.ids([[3], [4]])
    prompt = [7, *ids.placeholders(1, 2), 8, *ids.placeholders(2, 1), 9]
    spliced = splice_image_ids(prompt, ids.placeholder, [first, second])
    assert spliced == [7, *first, 8, *second, 9]
    with pytest.raises(ValueError, match="has 21 image placeholders; the input images need 10"):
        splice_image_ids(prompt, ids.placeholder, [first])
