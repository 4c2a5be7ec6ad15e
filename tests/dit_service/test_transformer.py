import torch

from dit_service.model.transformer import apply_rope, ffn_inner_dim, rope_tables


def _inputs(batch=1, size=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 16, size, size, generator=g), torch.full((batch,), 0.6)


def test_ffn_width_matches_preview():
    assert ffn_inner_dim(2520, 256, None) == 10240
    assert ffn_inner_dim(64, 16, 0.5) == 128


def test_rope_positions_rotate_pairs_per_axis():
    pos = torch.tensor([[[3, 3, 3], [5, 1, 2]]])
    cos, sin = rope_tables(pos, (4, 2, 2))
    assert cos.shape == (1, 2, 4)
    # axis 0 frequencies 1, 1/100; axis 1 and 2 frequency 1
    torch.testing.assert_close(cos[0, 1], torch.tensor([5.0, 5 / 100, 1.0, 2.0]).cos())
    x = torch.randn(1, 2, 1, 8)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.pow(2).sum(-1), x.pow(2).sum(-1))  # rotations keep the norm
    zero = apply_rope(x, *rope_tables(torch.zeros(1, 2, 3, dtype=torch.long), (4, 2, 2)))
    torch.testing.assert_close(zero, x)


@torch.no_grad()
def test_empty_condition_forward_is_finite_and_differs(pipeline, text):
    latents, t = _inputs()
    empty = pipeline.transformer(latents, t, torch.zeros(1, 0, text.shape[1]))
    full = pipeline.transformer(latents, t, text[None])
    assert empty.shape == latents.shape and torch.isfinite(empty).all()
    assert not torch.allclose(empty, full)


@torch.no_grad()
def test_padded_batch_equals_one_at_a_time_exactly(pipeline, text, image):
    model = pipeline.transformer
    latents, t = _inputs()
    cond = torch.cat([text, image])
    batch = torch.zeros(3, cond.shape[0], cond.shape[1])
    batch[0], batch[2, :4] = cond, text[:4]
    batch[1] = 7.0  # padding content must not matter
    out = model(latents.expand(3, -1, -1, -1), t.expand(3), batch, [cond.shape[0], 0, 4])
    assert torch.equal(out[0], model(latents, t, cond[None])[0])
    assert torch.equal(out[1], model(latents, t, cond[None, :0])[0])
    assert torch.equal(out[2], model(latents, t, text[None, :4])[0])


@torch.no_grad()
def test_packed_samples_give_the_padded_batch_result(pipeline, text, image):
    """The CUDA layout (samples' valid rows back to back, no padding) computes what the padded layout does."""
    model = pipeline.transformer
    latents, _ = _inputs(batch=3)
    t = torch.tensor([0.2, 0.6, 0.9])
    cond = torch.cat([text, image])
    batch = torch.zeros(3, cond.shape[0], cond.shape[1])
    batch[0], batch[2, :4] = cond, text[:4]
    lengths = [cond.shape[0], 0, 4]
    padded = model(latents, t, batch, lengths)
    model.pack_samples = True
    try:
        packed = model(latents, t, batch, lengths)
    finally:
        model.pack_samples = False
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert not torch.equal(packed[0], packed[1])  # samples kept apart


@torch.no_grad()
def test_output_depends_on_time_and_condition(pipeline, text):
    latents, t = _inputs()
    a = pipeline.transformer(latents, t, text[None])
    b = pipeline.transformer(latents, t * 0.5, text[None])
    c = pipeline.transformer(latents, t, text[None].flip(1))
    assert not torch.allclose(a, b) and not torch.allclose(a, c)
