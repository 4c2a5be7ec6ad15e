import torch

from dit_service.model.transformer import ArditDiTTransformer


def test_save_load_round_trip_has_no_missing_or_unexpected_keys(pipeline, tmp_path):
    pipeline.transformer.save_pretrained(tmp_path)
    loaded, info = ArditDiTTransformer.from_pretrained(
        tmp_path, local_files_only=True, output_loading_info=True, low_cpu_mem_usage=False
    )
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert (tmp_path / "diffusion_pytorch_model.safetensors").exists()
    for name, tensor in pipeline.transformer.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def _inputs(batch=1):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 16, 16, 16, generator=g), torch.full((batch,), 0.6)


@torch.no_grad()
def test_empty_condition_forward_is_finite_and_differs_from_conditioned(pipeline, condition):
    latents, t = _inputs()
    empty = pipeline.transformer(latents, t, torch.zeros(1, 0, condition.shape[1]))
    full = pipeline.transformer(latents, t, condition[None])
    assert empty.shape == latents.shape and torch.isfinite(empty).all()
    assert not torch.allclose(empty, full)


@torch.no_grad()
def test_padded_batch_matches_one_at_a_time(pipeline, condition):
    """Packed CFG: [cond; empty uncond] padded into one batch gives the per-sample results."""
    model = pipeline.transformer
    latents, t = _inputs()
    cond_alone = model(latents, t, condition[None])
    uncond_alone = model(latents, t, condition[None, :0])
    short_alone = model(latents, t, condition[None, :5])
    padded = torch.stack([condition, torch.full_like(condition, 7.0), condition.roll(1, 0)])
    mask = torch.zeros(3, condition.shape[0], dtype=torch.bool)
    mask[0] = True
    mask[2, :5] = True
    padded[2, :5] = condition[:5]
    out = model(latents.repeat(3, 1, 1, 1), t.repeat(3), padded, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], cond_alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], uncond_alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2], short_alone[0], atol=1e-5, rtol=1e-5)
