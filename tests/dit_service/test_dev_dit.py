"""The MammothModa2-Dev DiT layout: the Q-Former inside the DiT (``time_caption_embed.image_embedder``).

Checked against a plain-torch reading of the released formulas (bytedance/mammothmoda main ``mamoda2/mammothmoda2/
model/mammothmoda2_dit/image_refiner.py`` 88-186, ``block_lumina2.py`` 232-249, ``diffusion_transformer.py`` 622-638,
``modeling_mammothmoda2.py`` 200-221, ``utils/t2i_utils.py`` 214-262): the context of the conditional branch is
[caption_embedder(text) | Q-Former(image)], the unconditional branches never see the image condition, and the speed
modes (batching, packing, FP8, step caching, CUDA graphs) take the Dev context as they take Preview's condition.

The tiny Dev DiT's LLM width is 48 and its own 64, so a row of the wrong width cannot pass unnoticed.
"""

from __future__ import annotations

import copy
import io
import json
import math

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from dit_service.engine import DiTEngine
from dit_service.model import transformer as transformer_module
from dit_service.model.pipeline import (
    DEV_CONDITION_MODE,
    IMAGE_EMBEDDER_PREFIX,
    DiTPipeline,
    build_modules,
    dev_dit_config,
    dev_gen_parts,
    parameter_counts,
    preview_dit_config,
)
from dit_service.model.refiner import ImageConditionRefiner, choose_num_heads
from dit_service.model.sampler import step_entries
from dit_service.model.tiny import tiny_dev_gen_parts, tiny_gen_parts
from dit_service.model.weights import CheckpointMismatch
from dit_service.planning import RenderPlanner
from protos.knobs import FAMILIES
from protos.status import RequestRejected
from servicekit.checkpoint import open_checkpoint, save_tensors
from servicekit.fp8 import FP8Linear
from tests.dit_service import test_engine_batching as engine_batching
from tests.dit_service.conftest import DEV_CONDITION_DIM, write_root

LLM = DEV_CONDITION_DIM
DIT = 64
QUERIES = 16

#: Every tensor of the Q-Former inside the DiT, as the spec lists them (one layer; the tiny has two).
EMBEDDER_LEAVES = (
    "input_proj.0.weight", "input_proj.1.weight", "input_proj.1.bias", "query",
    *(f"layers.{layer}.{leaf}" for layer in (0, 1) for leaf in (
        "ln_q1.weight", "ln_q2.weight", "ln_ffn.weight",
        "self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight", "self_attn.out_proj.bias",
        "cross_attn.in_proj_weight", "cross_attn.in_proj_bias", "cross_attn.out_proj.weight",
        "cross_attn.out_proj.bias", "ffn.linear_1.weight", "ffn.linear_2.weight", "ffn.linear_3.weight",
    )),
)


def _rows(n, seed, width=LLM):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def text():
    return _rows(5, 1)


@pytest.fixture(scope="module")
def image():
    return _rows(11, 2)


@pytest.fixture(scope="module")
def negative():
    return _rows(7, 3)


# -- a plain-torch reading of the released formulas ------------------------------------------------------------------

def rms_norm(x, weight, eps):
    """Qwen3VLTextRMSNorm: float32 normalisation, cast back, then the weight."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def multihead_attention(query, key_value, attn: nn.MultiheadAttention, heads, key_padding=None):
    """nn.MultiheadAttention's math, batch_first: packed in_proj, softmax(QK^T / sqrt(d)) V per head, out_proj."""
    d = query.shape[-1]
    w, b = attn.in_proj_weight, attn.in_proj_bias
    q = query @ w[:d].T + b[:d]
    k = key_value @ w[d : 2 * d].T + b[d : 2 * d]
    v = key_value @ w[2 * d :].T + b[2 * d :]
    split = lambda t: t.unflatten(-1, (heads, d // heads)).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d // heads)
    if key_padding is not None:
        scores = scores.masked_fill(key_padding[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).flatten(-2)
    return out @ attn.out_proj.weight.T + attn.out_proj.bias


def swiglu_ffn(x, ffn):
    """LuminaFeedForward: linear_2(silu(linear_1 x) * linear_3 x), no biases."""
    return F.linear(F.silu(F.linear(x, ffn.linear_1.weight)) * F.linear(x, ffn.linear_3.weight), ffn.linear_2.weight)


def qformer_reference(embedder, x, valid, eps=1e-5):
    """SimpleQFormerImageEmbedder.forward (image_refiner.py 161-186): x [B, L, in], valid [B, L] (True = a real row)."""
    kv = F.linear(rms_norm(x, embedder.input_proj[0].weight, eps), embedder.input_proj[1].weight,
                  embedder.input_proj[1].bias)
    q = embedder.query.repeat(x.shape[0], 1, 1)
    heads = embedder.num_heads
    for layer in embedder.layers:
        h = rms_norm(q, layer.ln_q1.weight, eps)
        q = q + multihead_attention(h, h, layer.self_attn, heads)
        h = rms_norm(q, layer.ln_q2.weight, eps)
        q = q + multihead_attention(h, kv, layer.cross_attn, heads, key_padding=~valid)
        q = q + swiglu_ffn(rms_norm(q, layer.ln_ffn.weight, eps), layer.ffn)
    return q


def randomised(module: nn.Module, seed: int) -> nn.Module:
    """A copy with every parameter random, biases and norm weights included (the tiny's are 0 and 1)."""
    module = copy.deepcopy(module)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            scale = p.shape[-1] ** -0.5 if p.ndim > 1 else 0.2
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if p.ndim == 1 else 0.0))
    return module


# -- the Q-Former ---------------------------------------------------------------------------------------------------

def _padded_batch(lengths, width, seed):
    """[B, max L, width] with garbage in the padding, and the valid mask."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), max(lengths), width, generator=g)
    valid = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    return x.masked_fill(~valid[..., None], 1e3), valid


@pytest.mark.parametrize("dit_hidden", [DIT, 256])
@torch.no_grad()
def test_qformer_matches_the_released_formulas(dev_pipeline, dit_hidden):
    """input_proj RMSNorm + Linear from the LLM's width, self-attention over the queries, cross-attention to the
    valid inputs (key padding masked), SwiGLU FFN, pre-norm residuals; output [B, Q, DiT hidden]. At 64 the tiny's
    own (1 head), at 256 a stand-alone one (max(1, 256 // 128) = 2 heads)."""
    if dit_hidden == DIT:
        embedder = dev_pipeline.transformer.time_caption_embed.image_embedder
        assert embedder.num_heads == 1
    else:
        embedder = ImageConditionRefiner.image_embedder({"num_queries": 8, "num_layers": 2}, LLM, dit_hidden)
        assert embedder.num_heads == 2
    embedder = randomised(embedder, seed=dit_hidden).eval()
    x, valid = _padded_batch([9, 4], LLM, seed=7)
    got = embedder(x, ~valid)
    assert got.shape == (2, embedder.num_queries, dit_hidden)
    torch.testing.assert_close(got, qformer_reference(embedder, x, valid), rtol=2e-5, atol=2e-5)
    # a sample's queries see only its own valid rows: alone, unpadded, it gives the same
    torch.testing.assert_close(embedder(x[1:, :4]), got[1:], rtol=2e-5, atol=2e-5)


def test_head_rule_is_the_released_one():
    """_choose_valid_num_heads (image_refiner.py 146-159) after num_heads = max(1, hidden // 128) (modeling 219)."""
    assert choose_num_heads(64, max(1, 64 // 128)) == 1
    assert choose_num_heads(2520, max(1, 2520 // 128)) == 20  # 19 does not divide 2520; 20 is nearest 2520/128
    assert choose_num_heads(2304, max(1, 2304 // 128)) == 18
    with torch.device("meta"):
        dit, _, refiner = build_modules(dev_dit_config())
    assert refiner is None and dit.time_caption_embed.image_embedder.num_heads == 20


# -- the context ------------------------------------------------------------------------------------------------------

@torch.no_grad()
def test_context_is_the_captioned_text_then_the_qformer_tokens(dev_pipeline, text, image, negative):
    cond, uncond = dev_pipeline.branch_conditions(text, image, negative)
    embed = dev_pipeline.transformer.time_caption_embed
    caption = embed.caption_embedder
    assert cond.shape == (5 + QUERIES, DIT) and uncond.shape == (7, DIT)
    # caption embedder: RMSNorm(llm hidden, eps 1e-5) + Linear(llm hidden -> DiT hidden, bias), text rows only
    expected_text = F.linear(rms_norm(text, caption[0].weight, 1e-5), caption[1].weight, caption[1].bias)
    torch.testing.assert_close(cond[:5], expected_text)
    torch.testing.assert_close(cond[5:], qformer_reference(embed.image_embedder, image[None], torch.ones(1, 11, dtype=torch.bool))[0],
                               rtol=2e-5, atol=2e-5)
    # the unconditional branch: the negative rows through the caption embedder, no Q-Former tokens
    torch.testing.assert_close(uncond, F.linear(rms_norm(negative, caption[0].weight, 1e-5), caption[1].weight,
                                                caption[1].bias))
    assert torch.equal(dev_pipeline.assemble_condition(text, image), cond)


def test_rope_caption_length_counts_the_qformer_tokens(dev_pipeline, text, image, negative, monkeypatch):
    """The context's mask is [text | ones(Q)] (diffusion_transformer.py 630-638): the image patches' axis-0 position
    is the conditional row's text + Q length, and the unconditional row's negative length."""
    positions = []
    real = transformer_module.rope_tables

    def recording(pos, axes):
        positions.append(pos.clone())
        return real(pos, axes)

    monkeypatch.setattr(transformer_module, "rope_tables", recording)
    entry = dev_pipeline.start_entry(text, image, negative, 64, 64, seed=0, steps=2, guidance=4.0)
    dev_pipeline.step([entry])  # one call: [cond, uncond]
    image_positions = positions[1]
    assert set(image_positions[0, :, 0].tolist()) == {5 + QUERIES}
    assert set(image_positions[1, :, 0].tolist()) == {7}


@torch.no_grad()
def test_the_image_condition_changes_the_conditional_branch_only(dev_pipeline, text, image, negative):
    def branch_velocities(image_condition):
        out = []

        def recording(*args):
            out.append(dev_pipeline.transformer(*args))
            return out[-1]

        entry = dev_pipeline.start_entry(text, image_condition, negative, 64, 64, seed=4, steps=3, guidance=4.0)
        step_entries(recording, [entry], dev_pipeline.dtype, separate=True)
        return out  # [conditional, unconditional]

    a = branch_velocities(image)
    b = branch_velocities(image.flip(0) * -2.0)
    assert not torch.allclose(a[0], b[0])
    assert torch.equal(a[1], b[1])
    # and the text condition reaches the conditional branch too
    entry = dev_pipeline.start_entry(text * 3.0, image, negative, 64, 64, seed=4, steps=3, guidance=4.0)
    assert not torch.allclose(entry.cond, dev_pipeline.start_entry(text, image, negative, 64, 64, seed=4, steps=3,
                                                                   guidance=4.0).cond)


def test_an_empty_image_condition_is_refused(dev_pipeline, text, negative):
    assert dev_pipeline.requires_image_condition
    with pytest.raises(ValueError, match="at least one image-condition row"):
        dev_pipeline.branch_conditions(text, torch.zeros(0, LLM), negative)
    planner = DiTEngine(dev_pipeline, FAMILIES["mammothmoda2"], max_condition_positions=4096).planner
    assert planner.requires_image_condition
    header = dict(request_id="r", width=64, height=64, n=1, seed=1, output_format="png", output_compression=None,
                  knobs={}, hidden_size=LLM, dtype="float32", text_positions=5, negative_positions=0)
    with pytest.raises(RequestRejected) as caught:
        planner.plan(image_positions=0, **header)
    assert caught.value.param == "image_positions" and caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert planner.plan(image_positions=3, **header).positions["image"] == 3
    # a Preview model renders without one, as before
    preview_planner = RenderPlanner(size_multiple=16, condition_dim=64, knob_table=FAMILIES["mammothmoda2"],
                                    max_condition_positions=4096)
    assert not preview_planner.requires_image_condition


def test_rows_of_the_wrong_width_are_refused(dev_pipeline, text, image, negative):
    with pytest.raises(ValueError, match=r"image_condition must be \[positions, 48\]"):
        dev_pipeline.branch_conditions(text, _rows(4, 0, width=DIT), negative)
    with pytest.raises(ValueError, match="condition rows must be 64 wide"):
        dev_pipeline.transformer(torch.zeros(1, 16, 8, 8), torch.tensor([0.5]), text[None])


# -- loading ----------------------------------------------------------------------------------------------------------

def test_tiny_dev_parts_are_deterministic_and_in_the_dev_layout():
    parts, tensors = tiny_dev_gen_parts(LLM)
    again_parts, again = tiny_gen_parts(LLM, dev=True)
    assert parts == again_parts and tensors.keys() == again.keys()
    assert all(torch.equal(tensors[k], again[k]) for k in tensors)
    assert parts["gen_dit_config"]["is_image_embedder"] is True
    assert parts["gen_image_condition_refiner_config"] == {"num_queries": QUERIES, "num_layers": 2}
    assert parts["gen_condition_mode"] == DEV_CONDITION_MODE
    embedder = {k.removeprefix(IMAGE_EMBEDDER_PREFIX) for k in tensors if k.startswith(IMAGE_EMBEDDER_PREFIX)}
    assert embedder == set(EMBEDDER_LEAVES)
    assert not any(k.startswith("gen_image_condition_refiner.") for k in tensors)
    assert {k.split(".", 1)[0] for k in tensors} == {"gen_transformer", "gen_vae"}
    assert tensors[IMAGE_EMBEDDER_PREFIX + "input_proj.0.weight"].shape == (LLM,)
    assert tensors[IMAGE_EMBEDDER_PREFIX + "input_proj.1.weight"].shape == (DIT, LLM)
    assert tensors[IMAGE_EMBEDDER_PREFIX + "query"].shape == (1, QUERIES, DIT)
    assert tensors[IMAGE_EMBEDDER_PREFIX + "layers.0.cross_attn.in_proj_weight"].shape == (3 * DIT, DIT)
    assert tensors["gen_transformer.time_caption_embed.caption_embedder.1.weight"].shape == (DIT, LLM)
    with pytest.raises(ValueError, match="no refiner beside it"):
        tiny_gen_parts(LLM, with_refiner=True, dev=True)


def test_a_dev_checkpoint_loads_through_the_checkpoint_path(dev_root, dev_pipeline):
    checkpoint = open_checkpoint(dev_root)
    _, tensors = tiny_dev_gen_parts(LLM)
    assert checkpoint.tensor_names(IMAGE_EMBEDDER_PREFIX) == sorted(IMAGE_EMBEDDER_PREFIX + leaf for leaf in EMBEDDER_LEAVES)
    assert dev_pipeline.refiner is None and dev_pipeline.transformer.is_image_embedder
    assert dev_pipeline.condition_dim == LLM and dev_pipeline.transformer.step_condition_dim == DIT
    assert dev_pipeline.condition_mode == DEV_CONDITION_MODE
    loaded = dev_pipeline.transformer.state_dict()
    for name, tensor in tensors.items():
        if name.startswith("gen_transformer."):
            assert torch.equal(loaded[name.removeprefix("gen_transformer.")], tensor), name


def test_a_dev_checkpoint_without_a_qformer_tensor_fails_naming_it(tmp_path):
    def mutate(config, tensors):
        del tensors[IMAGE_EMBEDDER_PREFIX + "layers.1.cross_attn.in_proj_bias"]
    write_root(tmp_path, dev=True, mutate=mutate)
    with pytest.raises(CheckpointMismatch, match=r"missing gen_transformer\.time_caption_embed\.image_embedder\.layers"
                                                 r"\.1\.cross_attn\.in_proj_bias"):
        DiTPipeline.from_checkpoint(open_checkpoint(tmp_path))


def _with_refiner_config(value):
    def mutate(config, tensors):
        config["gen_image_condition_refiner_config"] = value
    return mutate


@pytest.mark.parametrize(("value", "message"), [
    ({"num_queries": 16, "num_layers": 2, "hidden_size": 64}, "sets hidden_size, which the released code passes itself"),
    ({"num_queries": 16, "num_layers": 2, "num_heads": 2}, "sets num_heads, which the released code passes itself"),
    ({"num_queries": 16, "input_dim": 48}, "sets input_dim"),
    ({"num_queries": 16, "num_layers": 2, "output_hidden_size": 64},
     r"does not take: \['output_hidden_size'\]; accepted: num_queries, num_layers, dropout, norm_eps"),
    (None, "gen_image_condition_refiner_config must be an object"),
])
def test_dev_refiner_config_keys_are_checked(tmp_path, value, message):
    write_root(tmp_path, dev=True, mutate=_with_refiner_config(value))
    with pytest.raises(ValueError, match=message):
        DiTPipeline.from_checkpoint(open_checkpoint(tmp_path))


def test_dropout_and_norm_eps_are_taken():
    embedder = ImageConditionRefiner.image_embedder({"num_queries": 4, "num_layers": 1, "dropout": 0.0,
                                                     "norm_eps": 1e-6}, LLM, DIT)
    assert embedder.input_proj[0].eps == 1e-6 and embedder.layers[0].ln_q1.eps == 1e-6
    assert embedder.query.shape == (1, 4, DIT) and len(embedder.layers) == 1


def test_a_dev_config_beside_preview_refiner_tensors_is_refused(tmp_path):
    _, preview_tensors = tiny_gen_parts(LLM, with_refiner=True)

    def mutate(config, tensors):
        tensors.update({k: v for k, v in preview_tensors.items() if k.startswith("gen_image_condition_refiner.")})
    write_root(tmp_path, dev=True, mutate=mutate)
    with pytest.raises(ValueError, match="also holds .* tensors of a Preview refiner beside the DiT"):
        DiTPipeline.from_checkpoint(open_checkpoint(tmp_path))


def test_a_preview_config_beside_dev_qformer_tensors_is_refused(tmp_path):
    """Dev's tensors under a config without is_image_embedder (the released Dev code builds the Q-Former whatever
    that flag says, modeling_mammothmoda2.py 215): refused naming the flag, before any tensor is read."""
    _, dev_tensors = tiny_dev_gen_parts(LLM)
    root = write_root(tmp_path)
    config = json.loads((root / "config.json").read_text())
    config["llm_config"]["text_config"]["hidden_size"] = LLM
    config["gen_dit_config"]["text_feat_dim"] = LLM
    (root / "config.json").write_text(json.dumps(config))
    save_tensors(root, dev_tensors)
    with pytest.raises(ValueError, match="has no is_image_embedder: true"):
        DiTPipeline.from_checkpoint(open_checkpoint(root))


def test_a_pipeline_takes_no_refiner_beside_a_dev_dit(dev_pipeline, refiner_pipeline):
    with pytest.raises(ValueError, match="takes no refiner beside it"):
        DiTPipeline(dev_pipeline.transformer, dev_pipeline.vae, refiner_pipeline.refiner, "text_image", "cpu",
                    torch.float32)


def test_the_dev_condition_mode_is_the_released_one_whatever_the_config_says(tmp_path):
    write_root(tmp_path, dev=True, mutate=lambda config, tensors: config.update(gen_condition_mode="image"))
    assert DiTPipeline.from_checkpoint(open_checkpoint(tmp_path)).condition_mode == "text_image"


def test_dev_shapes_parameter_counts():
    """Unverified Dev sizes: Preview's DiT, the caption embedder and Q-Former from 4096, Q-Former 128 x 2 at 2520."""
    counts = parameter_counts(dev_dit_config())
    preview = parameter_counts(preview_dit_config())
    embedder = counts[IMAGE_EMBEDDER_PREFIX.rstrip(".")]
    assert counts["gen_image_condition_refiner"] == 0 and counts["gen_vae"] == preview["gen_vae"]
    d, q = 2520, 128
    layer = 3 * d + 2 * (3 * d * d + 3 * d + d * d + d) + 3 * d * 10240
    assert embedder == 4096 + 4096 * d + d + q * d + 2 * layer == 267_141_736
    caption_growth = (4096 - 3584) * (1 + d)  # RMSNorm weight and Linear weight rows
    assert counts["gen_transformer"] == preview["gen_transformer"] + caption_growth + embedder
    assert counts["total"] == counts["gen_transformer"] + counts["gen_vae"]
    assert dev_gen_parts()["gen_dit_config"]["is_image_embedder"] is True


def test_dev_shapes_random_build_scaled_down():
    """The Dev config's random-weight path (meta build, allocation in bf16, random init), one layer deep."""
    config = dev_dit_config(4096)
    config["gen_dit_config"] = dict(config["gen_dit_config"], num_layers=1, num_refiner_layers=1)
    config["gen_image_condition_refiner_config"] = {"num_queries": 128, "num_layers": 1}
    config["gen_vae_config"] = dict(config["gen_vae_config"], block_out_channels=[32, 32, 32, 32], layers_per_block=1)
    pipeline = DiTPipeline.from_config(config, "cpu", torch.bfloat16, random_weights=True)
    embedder = pipeline.transformer.time_caption_embed.image_embedder
    assert embedder.query.shape == (1, 128, 2520) and embedder.input_proj[1].weight.shape == (2520, 4096)
    g = torch.Generator().manual_seed(0)
    out = pipeline.render_latents(torch.randn(3, 4096, generator=g), torch.randn(20, 4096, generator=g),
                                  torch.randn(4, 4096, generator=g), 32, 32, seed=0, steps=1, guidance=2.0)
    assert torch.isfinite(out.latents).all()


# -- rendering and the speed modes -----------------------------------------------------------------------------------

def test_a_dev_render_end_to_end(dev_pipeline, text, image, negative):
    result = dev_pipeline.render_latents(text, image, negative, width=80, height=48, seed=3, steps=3, guidance=4.0)
    pixels = dev_pipeline.decode(result.latents)
    assert result.latents.shape == (1, 16, 6, 10) and result.transformer_calls == 6
    assert pixels.shape == (48, 80, 3) and pixels.dtype == np.uint8
    packed = dev_pipeline.render_latents(text, image, negative, width=80, height=48, seed=3, steps=3, guidance=4.0,
                                         cfg_mode="packed")
    assert torch.equal(packed.latents, result.latents)
    assert dev_pipeline.warm_up() > 0
    again = dev_pipeline.render_latents(text, image, negative, width=80, height=48, seed=3, steps=3, guidance=4.0)
    assert torch.equal(again.latents, result.latents)


def test_a_requests_latents_are_the_same_alone_and_batched(dev_pipeline, text, image, negative):
    def entry(seed, text_rows, neg_rows, cache=0.0):
        return dev_pipeline.start_entry(text_rows, image, neg_rows, 64, 64, seed=seed, steps=6, guidance=4.0,
                                        cache_threshold=cache)

    for cache in (0.0, 0.5):
        alone = entry(1, text, negative, cache)
        while not alone.done:
            dev_pipeline.step([alone])
        batched, other = entry(1, text, negative, cache), entry(2, _rows(12, 9), negative[:2], cache)
        while not batched.done:
            dev_pipeline.step([batched, other])
        assert torch.equal(alone.latents, batched.latents)
        assert (alone.skipped_steps > 0) == (cache > 0) and batched.skipped_steps == alone.skipped_steps


def test_packed_joint_layers_take_the_dev_context(dev_pipeline, text, image, negative):
    """Packing (the CUDA layout: the joint layers over the valid rows back to back) gives each row what it gets
    alone; here on the CPU, to tolerance."""
    cond, uncond = dev_pipeline.branch_conditions(text, image, negative)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 16, 8, 8, generator=g), torch.tensor([0.3, 0.7])
    batch = torch.zeros(2, cond.shape[0], DIT)
    batch[0], batch[1, : uncond.shape[0]] = cond, uncond
    dit = dev_pipeline.transformer
    with torch.no_grad():
        padded = dit(x, t, batch, [cond.shape[0], uncond.shape[0]])
        dit.pack_samples = True
        try:
            packed = dit(x, t, batch, [cond.shape[0], uncond.shape[0]])
        finally:
            dit.pack_samples = False
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_fp8_quantizes_the_blocks_and_leaves_the_qformer(dev_root, dev_pipeline, text, image, negative):
    fp8 = DiTPipeline.from_checkpoint(open_checkpoint(dev_root))
    fp8.quantize("fp8")
    embedder = fp8.transformer.time_caption_embed.image_embedder
    assert not any(isinstance(m, FP8Linear) for m in embedder.modules())
    assert any(isinstance(m, FP8Linear) for m in fp8.transformer.layers.modules())
    a = fp8.render_latents(text, image, negative, 64, 64, seed=3, steps=3, guidance=4.0).latents
    b = dev_pipeline.render_latents(text, image, negative, 64, 64, seed=3, steps=3, guidance=4.0).latents
    assert 0 < float((a - b).norm() / b.norm()) < 0.1


def test_an_engine_render_batched_equals_it_alone(dev_pipeline, text, image, negative):
    """Through the engine, as a Render runs: n = 2 images share one context; batched with another render of other
    lengths, each image equals the deterministic engine's (one call per image)."""
    def submit(engine, seed, n, text_rows, neg_rows):
        plan = engine.plan(request_id=f"r{seed}", width=64, height=48, n=n, seed=seed, output_format="png",
                           output_compression=None, knobs={"num_inference_steps": 3, "text_guidance_scale": 4.0},
                           hidden_size=LLM, dtype="float32", text_positions=text_rows.shape[0],
                           image_positions=image.shape[0], negative_positions=neg_rows.shape[0])
        return engine.submit(plan, torch.cat([text_rows, image]), neg_rows)

    def collect(job):
        return engine_batching.collect(job, timeout=120)[0]

    batched = DiTEngine(dev_pipeline, FAMILIES["mammothmoda2"], max_condition_positions=4096, max_batch_size=4)
    alone = DiTEngine(dev_pipeline, FAMILIES["mammothmoda2"], max_condition_positions=4096, deterministic=True)
    try:
        jobs = [submit(batched, 1, 2, text, negative), submit(batched, 7, 1, _rows(9, 5), negative[:3])]
        results = [collect(job) for job in jobs]
        assert batched.status()["largest_batch"] > 1
        assert jobs[0].branch_conditions is None  # its last image took them
        assert results[0] == collect(submit(alone, 1, 2, text, negative))
        assert results[1] == collect(submit(alone, 7, 1, _rows(9, 5), negative[:3]))
        assert Image.open(io.BytesIO(results[0][0])).size == (64, 48)
    finally:
        batched.close()
        alone.close()
