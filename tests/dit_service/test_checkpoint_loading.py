"""Strict loading of the upstream-layout DiT stage: names and shapes of gen_transformer / gen_vae / refiner."""

import pytest
import torch

from dit_service.model.pipeline import DiTPipeline, parameter_counts, preview_gen_parts
from dit_service.model.tiny import tiny_gen_parts
from dit_service.model.weights import CheckpointMismatch
from servicekit.checkpoint import open_checkpoint
from tests.dit_service.conftest import CONDITION_DIM, write_root


def test_tiny_parts_are_deterministic_and_small():
    parts_a, tensors_a = tiny_gen_parts(CONDITION_DIM)
    parts_b, tensors_b = tiny_gen_parts(CONDITION_DIM)
    assert parts_a == parts_b and tensors_a.keys() == tensors_b.keys()
    assert all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)
    assert parts_a["gen_image_condition_refiner_config"] is None
    assert {k.split(".", 1)[0] for k in tensors_a} == {"gen_transformer", "gen_vae"}
    assert sum(t.numel() * t.element_size() for t in tensors_a.values()) < 2 * 2**20


def test_upstream_module_names(tiny_root):
    names = open_checkpoint(tiny_root).tensor_names("gen_transformer.")
    for expected in (
        "gen_transformer.x_embedder.weight", "gen_transformer.x_embedder.bias",
        "gen_transformer.ref_image_patch_embedder.weight",
        "gen_transformer.time_caption_embed.timestep_embedder.linear_1.weight",
        "gen_transformer.time_caption_embed.timestep_embedder.linear_2.bias",
        "gen_transformer.time_caption_embed.caption_embedder.0.weight",
        "gen_transformer.time_caption_embed.caption_embedder.1.weight",
        "gen_transformer.time_caption_embed.caption_embedder.1.bias",
        "gen_transformer.layers.0.attn.to_q.weight", "gen_transformer.layers.0.attn.to_k.weight",
        "gen_transformer.layers.0.attn.to_v.weight", "gen_transformer.layers.0.attn.to_out.0.weight",
        "gen_transformer.layers.0.attn.norm_q.weight", "gen_transformer.layers.0.attn.norm_k.weight",
        "gen_transformer.layers.0.feed_forward.linear_1.weight", "gen_transformer.layers.0.feed_forward.linear_2.weight",
        "gen_transformer.layers.0.feed_forward.linear_3.weight", "gen_transformer.layers.0.norm1.linear.weight",
        "gen_transformer.layers.0.norm1.linear.bias", "gen_transformer.layers.0.norm1.norm.weight",
        "gen_transformer.layers.0.ffn_norm1.weight", "gen_transformer.layers.0.norm2.weight",
        "gen_transformer.layers.0.ffn_norm2.weight",
        "gen_transformer.noise_refiner.0.norm1.linear.weight", "gen_transformer.ref_image_refiner.0.norm1.linear.weight",
        "gen_transformer.context_refiner.0.norm1.weight",
        "gen_transformer.norm_out.linear_1.weight", "gen_transformer.norm_out.linear_2.weight",
        "gen_transformer.norm_out.linear_2.bias", "gen_transformer.image_index_embedding",
    ):
        assert expected in names, expected
    assert not any("attn.to_q.bias" in n or "feed_forward.linear_1.bias" in n or "norm_out.norm" in n for n in names)
    # The context refiner is not modulated: a plain RMSNorm, no adaLN linear.
    assert "gen_transformer.context_refiner.0.norm1.linear.weight" not in names


def test_caption_embedder_takes_llm_width(pipeline):
    proj = pipeline.transformer.time_caption_embed.caption_embedder
    assert proj[0].weight.shape == (CONDITION_DIM,) and proj[1].weight.shape == (64, CONDITION_DIM)
    assert pipeline.condition_dim == CONDITION_DIM


def _drop(key):
    def mutate(config, tensors):
        del tensors[key]
    return mutate


def _add(key):
    def mutate(config, tensors):
        tensors[key] = torch.zeros(3)
    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_drop("gen_transformer.layers.1.attn.norm_k.weight"), "missing gen_transformer.layers.1.attn.norm_k.weight"),
        (_add("gen_transformer.layers.9.attn.to_q.weight"), "unexpected gen_transformer.layers.9.attn.to_q.weight"),
        (_drop("gen_vae.decoder.conv_out.bias"), "missing gen_vae.decoder.conv_out.bias"),
        (_add("gen_vae.extra"), "unexpected gen_vae.extra"),
    ],
)
def test_missing_or_extra_tensor_fails_naming_it(tmp_path, mutate, message):
    write_root(tmp_path, mutate=mutate)
    with pytest.raises(CheckpointMismatch, match=message.replace(".", r"\.")):
        DiTPipeline.from_checkpoint(open_checkpoint(tmp_path))


def test_wrong_shape_fails_naming_it(tmp_path):
    def mutate(config, tensors):
        config["gen_dit_config"]["num_kv_heads"] = 2
    write_root(tmp_path, mutate=mutate)
    with pytest.raises(CheckpointMismatch, match=r"wrong shape gen_transformer\.\S*attn\.to_k\.weight"):
        DiTPipeline.from_checkpoint(open_checkpoint(tmp_path))


def test_refiner_tensors_load_strictly(refiner_root, tmp_path):
    names = open_checkpoint(refiner_root).tensor_names("gen_image_condition_refiner.")
    for expected in ("input_proj.0.weight", "input_proj.1.weight", "input_proj.1.bias", "query",
                     "layers.1.ln_q1.weight", "layers.1.self_attn.in_proj_weight", "layers.1.self_attn.in_proj_bias",
                     "layers.1.self_attn.out_proj.weight", "layers.1.ln_q2.weight", "layers.1.cross_attn.in_proj_weight",
                     "layers.1.cross_attn.out_proj.bias", "layers.1.ln_ffn.weight", "layers.1.ffn.linear_1.weight",
                     "layers.1.ffn.linear_2.weight", "layers.1.ffn.linear_3.weight"):
        assert "gen_image_condition_refiner." + expected in names, expected
    write_root(tmp_path, with_refiner=True, mutate=_drop("gen_image_condition_refiner.query"))
    with pytest.raises(CheckpointMismatch, match=r"missing gen_image_condition_refiner\.query"):
        DiTPipeline.from_checkpoint(open_checkpoint(tmp_path))


def test_refiner_config_without_its_tensors_fails(tmp_path):
    def mutate(config, tensors):
        config["gen_image_condition_refiner_config"] = {"num_queries": 4, "num_layers": 1}
    write_root(tmp_path, mutate=mutate)
    with pytest.raises(CheckpointMismatch, match=r"missing gen_image_condition_refiner\.input_proj\.0\.weight, .*query"):
        DiTPipeline.from_checkpoint(open_checkpoint(tmp_path))


def test_preview_parameter_count():
    config = dict(preview_gen_parts(3584), llm_config={"text_config": {"hidden_size": 3584}})
    counts = parameter_counts(config)
    assert 2.2e9 < counts["gen_transformer"] < 2.4e9  # "~2B DiT"
    assert counts["gen_transformer"] == 2_295_975_736
    assert counts["gen_image_condition_refiner"] == 527_192_064
    assert 83e6 < counts["gen_vae"] < 85e6  # Flux VAE, 83.8M
    # bf16 DiT-stage weights ~5.4 GiB (vllm-omni's recipe reports 5.49 GiB for that stage)
    assert 5.3 < counts["total"] * 2 / 2**30 < 5.6


def test_preview_shapes_random_build_scaled_down():
    """The Preview config's code path (meta build -> device allocation in bf16 -> random init), two layers deep."""
    config = dict(preview_gen_parts(3584), llm_config={"text_config": {"hidden_size": 3584}})
    config["gen_dit_config"] = dict(config["gen_dit_config"], num_layers=1, num_refiner_layers=1)
    config["gen_image_condition_refiner_config"] = {"num_queries": 128, "num_layers": 1}
    config["gen_vae_config"] = dict(config["gen_vae_config"], block_out_channels=[32, 32, 32, 32], layers_per_block=1)
    pipeline = DiTPipeline.from_config(config, "cpu", torch.bfloat16, random_weights=True)
    block = pipeline.transformer.layers[0]
    assert block.attn.to_q.weight.shape == (2520, 2520) and block.attn.to_k.weight.shape == (840, 2520)
    assert block.feed_forward.linear_1.weight.shape == (10240, 2520)
    assert block.norm1.linear.weight.shape == (4 * 2520, 1024)
    assert pipeline.refiner.num_heads == 28 and pipeline.refiner.query.shape == (1, 128, 3584)
    assert all(p.dtype == torch.bfloat16 for p in pipeline.transformer.parameters())
    g = torch.Generator().manual_seed(0)
    out = pipeline.render_latents(torch.randn(3, 3584, generator=g), torch.randn(20, 3584, generator=g),
                                  torch.zeros(0, 3584), 32, 32, seed=0, steps=1, guidance=2.0)
    assert out.latents.shape == (1, 16, 4, 4) and torch.isfinite(out.latents).all()
